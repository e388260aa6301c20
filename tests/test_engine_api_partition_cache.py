"""engine.empty_partition_cache() (DeepSpeed's name): at ZeRO-3 a forward in training mode with grad
enabled keeps the parameters gathered for its backward; the call brings the bytes the parameters hold
back to what they held after the step (the partition's placeholders), after an evaluation phase and
also between a forward and its backward, and training continues bit for bit as a run without the calls
(the backward gathers again), which equals single-process SGD. Other stages: a no-op."""
from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.models import OddMLP, make_batches, micro_batches, reference_train

LR, WORLD, STEPS = 0.1, 2, 4


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _held_bytes(module) -> int:
    return sum(p.data.untyped_storage().nbytes() for p in module.parameters())


def _run(stage: int, evaluate: bool) -> dict:
    import engine
    torch.manual_seed(0)
    eng, *_ = engine.initialize(model=OddMLP(), config=_config(stage))
    rank, world = eng.comm.rank, eng.comm.world_size
    held = []
    for step, (x, y) in enumerate(make_batches(STEPS, 2 * world)):
        (xm, ym), = micro_batches(x, y, rank, world, 1)
        if evaluate and step == STEPS // 2:
            held.append(_held_bytes(eng.module))  # after a step
            eng.eval()
            for _ in range(2):  # an evaluation phase
                eng(xm, ym)
            eng.train()
            eng.empty_partition_cache()
            held.append(_held_bytes(eng.module))
        loss = eng(xm, ym)
        if evaluate and step >= STEPS // 2:  # the training forward holds the model for its backward
            held.append(_held_bytes(eng.module))
            eng.empty_partition_cache()
            held.append(_held_bytes(eng.module))
        eng.backward(loss)
        eng.step()
    with engine.zero.GatheredParameters(list(eng.module.parameters())):
        params = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    return {"params": params, "held": held}


def _all_stages():
    return {stage: (_run(stage, True), _run(stage, False)) for stage in (0, 1, 2, 3)}


def test_empty_partition_cache_releases_gathered_parameters_and_training_continues_exactly():
    results = run_distributed(_all_stages, WORLD, timeout=300)
    torch.manual_seed(0)
    model = OddMLP()
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    ref, _, _ = reference_train(model, make_batches(STEPS, 2 * WORLD), lambda ps: torch.optim.SGD(ps, lr=LR))
    for per_rank in results:
        for stage, (evaluated, plain) in per_rank.items():
            after_step, after_eval, *mid_pass = evaluated["held"]
            assert len(mid_pass) == 2 * (STEPS - STEPS // 2)
            if stage == 3:
                assert after_step == after_eval == 0  # placeholders only (no persistent parameter here)
                # every step's forward held the whole model (the frozen parameter too), until the call
                assert mid_pass == [full, 0] * (STEPS - STEPS // 2)
            else:
                assert after_step == after_eval == full and set(mid_pass) == {full}
            for n, p in evaluated["params"].items():
                assert torch.equal(p, plain["params"][n]), f"stage {stage} {n}"
                torch.testing.assert_close(p, dict(ref.named_parameters())[n].detach(), rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
