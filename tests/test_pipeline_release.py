"""What a pipeline training step keeps between steps (engine/pipe/schedule.py, [Note: what a training step
releases]): no stage output and no received activation's gradient outlives its micro-batch, and the
gradient dropped once its send op is built still reaches the previous stage intact. More micro-batches
than stages, each micro-batch distinct, SGD without clipping: a gradient overwritten or freed before its
send read it would move the weights away from single-process SGD on the global batch."""
from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.models import micro_batches
from tests.pipe_models import global_batches, mlp_specs, mse, reference_params, reference_sgd

LR, MICRO, STEPS = 0.1, 2, 3
CASES = (("1f1b", 1, 6), ("gpipe", 1, 3), ("zero_bubble", 2, 4), ("zb_h1", 1, 4))  # (schedule, chunks per rank, micro-batches)


def _held(eng) -> dict:
    """What this rank's stages still hold: outputs kept for step()'s merged return, and received
    activations whose `.grad` is still set (the gradient sent back)."""
    stages = [st for entry in eng._built.values() for st in entry[0]]
    grads = sum(info.buffer.grad is not None for st in stages for infos in st.args_recv_info.values()
                for info in infos if not info.is_root_arg and info.buffer is not None)
    return {"outputs": sum(len(st.output_chunks) for st in stages), "grads": grads}


def _train(schedule: str, virtual: int, m: int) -> dict:
    import engine
    from engine.pipe import PipelineModule
    pm = PipelineModule(mlp_specs(8), num_stages=2, loss_fn=mse, seed_layers=True, partition_method="uniform",
                        virtual_stages=virtual)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": m,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "gradient_clipping": 0.0,
              "pipeline": {"schedule": schedule}}
    eng, *_ = engine.initialize(model=pm, config=config)
    batches = global_batches(STEPS + 1, MICRO * m, False)
    losses, held = [], []
    for x, y in batches[:STEPS]:
        losses.append(float(eng.train_batch(iter(list(micro_batches(x, y, 0, 1, m))))))
        held.append(_held(eng))
    # eval_batch(return_logits=True) still returns each micro-batch's output: only training drops them
    x, y = batches[STEPS]
    _, logits = eng.eval_batch(iter(list(micro_batches(x, y, 0, 1, m))), return_logits=True)
    params = {n: p.detach().clone() for n, p in pm.named_parameters()}
    eng.destroy()
    return {"losses": losses, "held": held, "params": params, "logits": logits}


def _all_cases() -> list:
    return [_train(*case) for case in CASES]


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_cases, world_size=2, timeout=300)


@pytest.mark.parametrize("k", range(len(CASES)), ids=[c[0] for c in CASES])
def test_training_matches_single_process_and_keeps_nothing_between_steps(results, k):
    schedule, _, m = CASES[k]
    batches = global_batches(STEPS + 1, MICRO * m, False)
    ref, ref_losses = reference_sgd(mlp_specs(8), batches, mse, LR, STEPS)
    want = reference_params(ref)
    seen = set()
    for rank, r in enumerate(res[k] for res in results):
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for name, p in r["params"].items():
            torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6, msg=f"{schedule}: parameter {name}")
            seen.add(name)
        assert r["held"] == [{"outputs": 0, "grads": 0}] * STEPS, (schedule, rank)
    assert seen == set(want)
    last = results[-1][k]["logits"]
    assert results[0][k]["logits"] is None and len(last) == m
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(last), ref(batches[STEPS][0]), rtol=1e-5, atol=1e-6)
