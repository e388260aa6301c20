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
not, ends, with the same step counters and losses.
The same three calls also raise at micro-batch 0 of the first schedule of a new input shape, where no
backward of that shape has run yet: the backward runs guarded until its record exists (the ledger's
note); before, the failing rank had no backward record to post from and its tensor peer waited in that
micro-batch's backward until DSTRAIN_TIMEOUT."""
from __future__ import annotations

import time

import pytest
import torch

from tests.harness import run_distributed

ARMED = {"kind": None, "calls": None, "seen": 0}  # which user code raises on its tensor rank 1 now; a forward:
# at which calls since it was armed (None: every one)


class BadActivation(ValueError):
    pass


class BadGradient(ValueError):
    pass


class BadLabel(ValueError):
    pass


def _build(route: str, m: int = 2, schedule: str = "1f1b"):
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
    chunks = 1 if schedule == "1f1b" else 2  # per rank
    pm = PipelineModule(gpt_layers(GPTConfig(vocab_size=32, seq_len=8, n_layer=2 * chunks, n_head=4, d_model=16),
                                   tensor_parallel=route == "layers"), topology=topo, loss_fn=loss_fn,
                        seed_layers=True, partition_method=f"type:{block}", virtual_stages=chunks)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": m, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 1}, "pipeline": {"schedule": schedule}}
    if route == "autotp":
        config["tensor_parallel"] = {"autotp_size": 2}
    eng, *_ = engine.initialize(model=pm, config=config)
    blocks = [m for m in pm.modules() if type(m).__name__ == block]  # this stage's
    first, last = blocks[0], blocks[-1]  # the same on 1f1b: one chunk of one block per stage
    if pm.process_groups.coord.pipe == 0 and tensor_rank == 1:  # the first block lives on stage 0
        def forward_check(module, args):
            if ARMED["kind"] == "forward":
                ARMED["seen"] += 1
                if ARMED["calls"] is None or ARMED["seen"] in ARMED["calls"]:
                    raise BadActivation("an activation out of range on tensor rank 1")

        def gradient_check(kind):
            def check(grad):
                if ARMED["kind"] == kind:
                    raise BadGradient("a gradient out of range on tensor rank 1")
                return grad
            return check
        first.register_forward_pre_hook(forward_check)
        # the block's first parameter: its gradient comes after the block's tensor-parallel collectives in the
        # backward; its last (the MLP's output bias): before them
        next(last.parameters()).register_hook(gradient_check("backward"))
        list(last.parameters())[-1].register_hook(gradient_check("backward early"))
        next(first.parameters()).register_hook(gradient_check("peer, then own"))
    if pm.process_groups.coord.pipe == 0 and tensor_rank == 0:
        def own_check(module, args):  # the forward of micro-batch 2, after the backward of micro-batch 0
            if ARMED["kind"] == "peer, then own":
                ARMED["seen"] += 1
                if ARMED["seen"] == 4:  # 1: the probe's
                    raise BadActivation("an activation out of range on tensor rank 0")
        first.register_forward_pre_hook(own_check)
    return pm, eng


def _batch(step: int, seq: int = 8, m: int = 2):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randint(0, 32, (2 * m, seq), generator=g), torch.randint(0, 32, (2 * m, seq), generator=g)
    return iter([(x[i:i + 2], y[i:i + 2]) for i in range(0, 2 * m, 2)])


def _trained(route: str, plan: list, schedule: str) -> tuple[dict, list, list]:
    """A train_batch per (seed, kind, sequence length) of `plan`; `kind`: the call that raises on tensor rank 1
    (None: none; "probe": the forward, in the probe of a batch of a new shape; "first forward": the forward
    of micro-batch 0 after that probe, that of micro-batch 1 runs on)."""
    m = 2 if schedule == "1f1b" else 4
    pm, eng = _build(route, m, schedule)
    losses, outcomes = [], []
    for seed, kind, seq in plan:
        ARMED["kind"] = "forward" if kind == "probe" else kind and kind.removeprefix("first ")
        ARMED["calls"], ARMED["seen"] = ((2,) if kind == "first forward" else None), 0  # 1: the probe's
        start = time.monotonic()
        try:
            losses.append(float(eng.train_batch(data_iter=_batch(seed, seq, m))))
            outcomes.append(None)
        except Exception as err:  # noqa: BLE001 - the outcome is what the test reads
            outcomes.append((kind, type(err).__name__, str(err), time.monotonic() - start))
        ARMED["kind"] = None
    state = {"params": {n: p.detach().clone() for n, p in pm.named_parameters()},
             "counters": (eng.global_steps, eng.micro_steps, eng.skipped_steps)}
    eng.destroy()
    return state, losses, [o for o in outcomes if o is not None]


def _both(route: str, plan: list, schedule: str = "1f1b") -> dict:
    """Engine A trains `plan`, engine B its batches that raise nowhere."""
    import torch.distributed as dist
    a, losses_a, outcomes = _trained(route, plan, schedule)
    b, losses_b, _ = _trained(route, [step for step in plan if step[1] is None], schedule)
    alike = a["counters"] == b["counters"] and losses_a == losses_b and \
        all(a["params"][n].equal(b["params"][n]) for n in b["params"])
    return {"rank": dist.get_rank(), "outcomes": outcomes, "alike": alike, "counters": a["counters"]}


ERRORS = {"forward": ("BadActivation", "an activation out of range on tensor rank 1", 1, 0),
          "probe": ("BadActivation", "an activation out of range on tensor rank 1", 1, 0),
          "backward": ("BadGradient", "a gradient out of range on tensor rank 1", 1, 0),
          "loss": ("BadLabel", "a bad label on tensor rank 1", 3, 1)}  # (type, text, failing rank, its stage)
for _kind in ("forward", "backward", "loss"):
    ERRORS[f"first {_kind}"] = ERRORS[_kind]
ERRORS["first backward early"] = ERRORS["backward"]


def _check(results: list, kinds: list, seconds_at_most: float) -> None:
    for r in results:
        assert r["alike"], r
        assert [o[0] for o in r["outcomes"]] == kinds, r
        for kind, name, text, seconds in r["outcomes"]:
            error, message, failing, stage = ERRORS[kind]
            assert seconds < seconds_at_most, (kind, seconds)
            if r["rank"] == failing:
                assert name == error and message in text, (kind, name, text)
            else:
                assert name == "StageFailed", (kind, name, text)
                assert f"stage {stage} (rank {failing}, data-parallel rank 0, tensor rank 1)" in text, text
                assert message in text, text


@pytest.mark.parametrize("route", ["autotp", "layers"])
def test_an_error_on_one_tensor_rank_stops_every_rank_at_once(route):
    kinds = ["forward", "backward", "loss", "probe"]
    plan = [(0, None, 8)] + [(step, kind, 6 if kind == "probe" else 8) for step, kind in enumerate(kinds, 1)]
    results = run_distributed(_both, 4, args=(route, plan + [(5, None, 8)]), timeout=100,
                              env={"DSTRAIN_TIMEOUT": "30"})
    _check(results, kinds, 20)


@pytest.mark.parametrize("route,schedule", [("autotp", "1f1b"), ("layers", "1f1b"), ("layers", "zero_bubble")])
def test_an_error_on_one_tensor_rank_in_the_first_schedule_of_a_shape_stops_every_rank_at_once(route, schedule):
    """Each failing batch the first of its shape (7, 6, 5, 4 tokens; the probe's forward passes; the backward
    raising after the block's last tensor-parallel collective, then before them); then a batch of each of
    those shapes trains (its backward runs guarded again and records) and one of 8 tokens. A hang in a
    backward collective fails the test: DSTRAIN_TIMEOUT 20 s, the harness's 90 s. Under zero_bubble (2
    chunks per rank, input- and weight-gradient steps) a rank told of its peer's error in a guarded step
    still posts the whole record of a later step that has one (4 micro-batches; the gradient hooks on the
    stage's second chunk)."""
    kinds = ["first forward", "first backward", "first backward early", "first loss"]
    plan = [(0, None, 8)] + [(seed, kind, 8 - seed) for seed, kind in enumerate(kinds, 1)] + \
        [(seed, None, 8 - seed + 4) for seed in range(5, 9)] + [(9, None, 8)]
    results = run_distributed(_both, 4, args=(route, plan, schedule), timeout=90, env={"DSTRAIN_TIMEOUT": "20"})
    _check(results, kinds, 15)  # a raise that came from the timeout takes 20 s; one that did not, ~0.3 s


def _peer_then_own() -> dict:
    import torch.distributed as dist
    pm, eng = _build("layers", m=4)
    ARMED["kind"], ARMED["seen"] = "peer, then own", 0
    try:
        eng.train_batch(data_iter=_batch(1, 7, m=4))
        return {"rank": dist.get_rank(), "name": None}
    except Exception as err:  # noqa: BLE001 - the outcome is what the test reads
        return {"rank": dist.get_rank(), "name": type(err).__name__, "text": str(err),
                "notes": getattr(err, "__notes__", [])}
    finally:
        ARMED["kind"] = None
        eng.destroy()


def test_a_rank_told_of_a_peers_backward_error_then_raising_in_its_forward_reports_its_forward():
    """1F1B, 4 micro-batches, a new shape: tensor rank 1's backward raises at micro-batch 0 (guarded), its peer
    meets the 1 and skips its backward passes; then the peer's own forward raises at micro-batch 2. Its error's
    note names no backward pass (it was told of the peer's there, that error is not its own)."""
    results = {r["rank"]: r for r in run_distributed(_peer_then_own, 4, timeout=60, env={"DSTRAIN_TIMEOUT": "15"})}
    assert results[0]["name"] == "BadActivation", results[0]
    assert any("stage 0 (rank 0): every rank" in note for note in results[0]["notes"]), results[0]
    assert results[1]["name"] == "BadGradient", results[1]
    for rank in (2, 3):
        assert results[rank]["name"] == "StageFailed" and "(rank 1, data-parallel rank 0, tensor rank 1)" in \
            results[rank]["text"] and "in a backward pass" in results[rank]["text"], results[rank]
