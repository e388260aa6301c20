"""User code that raises on ONE tensor rank of a pipeline stage (engine/tensor_parallel/collective_ledger.py):
on 2 pipe × 2 model, examples/gpt_pipe.py's GPT, AutoTP'd dense blocks and Megatron-layer blocks, a
block's forward on tensor rank 1 of stage 0, a hook on a block's parameter gradient there (a backward
pass), and the loss_fn on tensor rank 1 of the last stage. Every rank of the world raises at once — the
failing rank its own error, every other one a StageFailed naming the stage, the tensor rank and the error
(before the ledger, the failing rank's tensor peer waited in the block's next tensor-parallel collective
until the process-group timeout: here DSTRAIN_TIMEOUT 30 s and the harness's 100 s, so a hang fails the
test). The forward, backward and loss calls come after the first step (the probe and one schedule recorded
what the collectives are); a fourth, the forward in the probe of a batch of a new shape, is told to the
peers by the probe's guard (the ledger's note). Nothing changed:
engine A, which met the three failing calls between its steps, ends bit for bit where engine B, which did
not, ends, with the same step counters and losses."""
from __future__ import annotations

import time

import pytest
import torch

from tests.harness import run_distributed

ARMED = {"kind": None}  # which user code raises on its tensor rank 1 now


class BadActivation(ValueError):
    pass


class BadGradient(ValueError):
    pass


class BadLabel(ValueError):
    pass


def _build(route: str):
    import torch.distributed as dist

    import engine
    from engine.pipe import PipelineModule
    from engine.topology import Topology
    from examples.gpt import GPTConfig
    from examples.gpt_pipe import gpt_layers, gpt_loss
    topo = Topology.for_world(4, pipe=2, model=2)
    tensor_rank = topo.coord(dist.get_rank()).model

    def loss_fn(logits, targets):
        if ARMED["kind"] == "loss" and tensor_rank == 1:
            raise BadLabel("a bad label on tensor rank 1")
        return gpt_loss(logits, targets)
    block = "ParallelBlockLayer" if route == "layers" else "BlockLayer"
    pm = PipelineModule(gpt_layers(GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=4, d_model=16),
                                   tensor_parallel=route == "layers"),
                        topology=topo, loss_fn=loss_fn, seed_layers=True, partition_method=f"type:{block}")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 1}}
    if route == "autotp":
        config["tensor_parallel"] = {"autotp_size": 2}
    eng, *_ = engine.initialize(model=pm, config=config)
    first = next(m for m in pm.modules() if type(m).__name__ == block)
    if pm.process_groups.coord.pipe == 0 and tensor_rank == 1:  # the first block lives on stage 0
        def forward_check(module, args):
            if ARMED["kind"] == "forward":
                raise BadActivation("an activation out of range on tensor rank 1")

        def gradient_check(grad):
            if ARMED["kind"] == "backward":
                raise BadGradient("a gradient out of range on tensor rank 1")
            return grad
        first.register_forward_pre_hook(forward_check)
        next(first.parameters()).register_hook(gradient_check)
    return pm, eng


def _batch(step: int, seq: int = 8):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randint(0, 32, (4, seq), generator=g), torch.randint(0, 32, (4, seq), generator=g)
    return iter([(x[:2], y[:2]), (x[2:], y[2:])])


def _trained(route: str, failing: tuple) -> tuple[dict, list, list]:
    """Steps 0 and 5 trained; between them, one call per `failing` kind that raises on tensor rank 1
    ("probe": the forward, in the probe of a batch of a new shape)."""
    pm, eng = _build(route)
    losses, outcomes = [], []
    for step in range(6):
        kind = failing[step - 1] if 1 <= step <= len(failing) else None
        if step and kind is None and step != 5:
            continue
        ARMED["kind"] = "forward" if kind == "probe" else kind
        start = time.monotonic()
        try:
            losses.append(float(eng.train_batch(data_iter=_batch(step, 6 if kind == "probe" else 8))))
            outcomes.append(None)
        except Exception as err:  # noqa: BLE001 - the outcome is what the test reads
            outcomes.append((kind, type(err).__name__, str(err), time.monotonic() - start))
        ARMED["kind"] = None
    state = {"params": {n: p.detach().clone() for n, p in pm.named_parameters()},
             "counters": (eng.global_steps, eng.micro_steps, eng.skipped_steps)}
    eng.destroy()
    return state, losses, [o for o in outcomes if o is not None]


def _both(route: str) -> dict:
    import torch.distributed as dist
    a, losses_a, outcomes = _trained(route, ("forward", "backward", "loss", "probe"))
    b, losses_b, _ = _trained(route, ())
    alike = a["counters"] == b["counters"] and losses_a == losses_b and \
        all(a["params"][n].equal(b["params"][n]) for n in b["params"])
    return {"rank": dist.get_rank(), "outcomes": outcomes, "alike": alike, "counters": a["counters"]}


ERRORS = {"forward": ("BadActivation", "an activation out of range on tensor rank 1", 1, 0),
          "probe": ("BadActivation", "an activation out of range on tensor rank 1", 1, 0),
          "backward": ("BadGradient", "a gradient out of range on tensor rank 1", 1, 0),
          "loss": ("BadLabel", "a bad label on tensor rank 1", 3, 1)}  # (type, text, failing rank, its stage)


@pytest.mark.parametrize("route", ["autotp", "layers"])
def test_an_error_on_one_tensor_rank_stops_every_rank_at_once(route):
    results = run_distributed(_both, 4, args=(route,), timeout=100, env={"DSTRAIN_TIMEOUT": "30"})
    for r in results:
        assert r["alike"], r
        assert [o[0] for o in r["outcomes"]] == ["forward", "backward", "loss", "probe"], r
        for kind, name, text, seconds in r["outcomes"]:
            error, message, failing, stage = ERRORS[kind]
            assert seconds < 20, (kind, seconds)
            if r["rank"] == failing:
                assert name == error and message in text, (kind, name, text)
            else:
                assert name == "StageFailed", (kind, name, text)
                assert f"stage {stage} (rank {failing}, data-parallel rank 0, tensor rank 1)" in text, text
                assert message in text, text
