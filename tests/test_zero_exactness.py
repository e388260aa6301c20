"""Every ZeRO stage is exactly single-process training, with oracles that can fail.

The reference is plain SGD without momentum or clipping: its update is linear in the gradient, so a
gradient summed instead of averaged over ranks, a missing 1/gradient_accumulation_steps, a loss scale
not divided out or a predivide factor applied twice all move the weights (AdamW with clipping would
normalise them away). The model (tests.models.ReuseNet) has the cases a review found trained wrong: a
head used only in micro-step 0 of 2 (stage 1 used to drop what it accumulated), a transposed weight
and a channels_last kernel (non-contiguous), and a block whose gradient arrives in two pieces under
reentrant checkpointing. The reported `get_global_grad_norm()` must equal the reference's norm before
clipping (one case clips: there the update cannot see a wrong scale, the norm can).

Tolerances: fp32 weights atol 2e-6 after 4 SGD steps (only summation order differs: ranks, buckets
and the reduce-scatter add in another order than one process; measured max 3e-7), norms rtol 1e-5.
fp16/bf16 at stages 2/3 are compared with stage 0 in the same precision (same 16-bit gradients on the
wire; the fp32 master step is the same), rtol 1e-4 on each tensor's relative error without
accumulation. With accumulation, stage 0 sums micro-steps in 16 bits and stages 2/3 in fp32, so the
bound is the 16-bit rounding (fp16 2e-3, bf16 1.6e-2 relative).
"""
from __future__ import annotations

import functools

import pytest
import torch

import engine
from engine.utils import safe_get_full_fp32_param
from tests.harness import run_distributed
from tests.models import ReuseNet, StackNet, make_batches, micro_batches, reference_accumulated

STEPS = 4
MICRO = 2
LR = 0.2
# (gradient_accumulation_steps, checkpointing flavour, extra top-level config)
CASES = [(1, None, {}),
         (2, "reentrant", {}),
         (2, "non_reentrant", {"gradient_predivide_factor": 2.0}),
         (1, "reentrant", {"prescale_gradients": True}),
         # clipping that bites makes the update blind to the gradient's scale; the norm still sees it
         (2, None, {"gradient_clipping": 0.3}),
         # DeepSpeed's checkpointing.checkpoint API (dstrain's reentrant regions record their parameters):
         # ReuseNet's block in two regions arrives in two pieces; StackNet's layers, one region each, do not
         (2, "dstrain_reentrant", {}),
         (2, "stack_reentrant", {})]


def _model(checkpointing) -> torch.nn.Module:
    return StackNet(checkpointing=True) if checkpointing == "stack_reentrant" else ReuseNet(checkpointing)


def _config(stage: int, gas: int, precision: str = "fp32", **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
           "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True,
           # Small buckets: several collectives per backward, so launch order and overlap matter.
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 700, "allgather_bucket_size": 900,
                                 "overlap_comm": True, "stage3_param_persistence_threshold": 30},
           **extra}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train(stage: int, gas: int, checkpointing, precision: str = "fp32", **extra) -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = _model(checkpointing)
    eng, _, _, _ = engine.initialize(model=model, config=_config(stage, gas, precision, **extra))
    dtype = next(eng.module.parameters()).dtype
    norms = []
    for x, y in make_batches(STEPS, MICRO * gas * world, d_in=13, d_out=5):
        for k, (xm, ym) in enumerate(micro_batches(x.to(dtype), y.to(dtype), rank, world, gas)):
            eng.backward(eng(xm, ym, aux=k == 0))
            eng.step()
        norms.append(eng.get_global_grad_norm())
    assert eng.zero_optimizer.stage == stage and eng.global_steps == STEPS and eng.skipped_steps == 0
    return {"params": {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters()},
            "norms": norms}


def _all_cases() -> dict:
    return {(stage, i): _train(stage, gas, ckpt, **extra)
            for stage in (0, 1, 2, 3) for i, (gas, ckpt, extra) in enumerate(CASES)}


@functools.lru_cache(maxsize=None)
def _reference(world: int, gas: int, checkpointing, clip: float = 0.0):
    torch.manual_seed(0)
    model = _model(checkpointing)
    ref, norms = reference_accumulated(model, make_batches(STEPS, MICRO * gas * world), world, gas, LR, clip=clip)
    return {n: p.detach() for n, p in ref.named_parameters()}, norms


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def sgd_runs(request):
    world = request.param
    return world, run_distributed(_all_cases, world, timeout=240)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("case", range(len(CASES)), ids=["gas1", "gas2-reentrant", "gas2-predivide",
                                                         "gas1-prescale-reentrant", "gas2-clipped",
                                                         "gas2-dstrain-reentrant", "gas2-stack-reentrant"])
def test_sgd_matches_single_process_with_its_gradient_norm(sgd_runs, stage, case):
    world, results = sgd_runs
    gas, ckpt, extra = CASES[case]
    ref, ref_norms = _reference(world, gas, ckpt, extra.get("gradient_clipping", 0.0))
    for rank, result in enumerate(results):
        got = result[(stage, case)]
        for name, want in ref.items():
            err = (got["params"][name] - want).abs().max().item()
            assert err < 2e-6, f"rank {rank} {name}: max |w - w_ref| = {err:.2e}"
        assert got["norms"] == pytest.approx(ref_norms, rel=1e-5), f"rank {rank}: grad norms"


# -- fp16/bf16: stages 2 and 3 against stage 0 in the same precision ---------------------------------
def _mixed_cases() -> dict:
    return {(precision, stage, gas): _train(stage, gas, "reentrant", precision)
            for precision in ("fp16", "bf16") for stage in (0, 2, 3) for gas in (1, 2)}


@pytest.fixture(scope="module")
def mixed_runs():
    return run_distributed(_mixed_cases, 2, timeout=240)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("gas", [1, 2])
def test_mixed_precision_matches_stage0_in_the_same_precision(mixed_runs, precision, stage, gas):
    bound = 1e-4 if gas == 1 else {"fp16": 2e-3, "bf16": 1.6e-2}[precision]
    for rank, result in enumerate(mixed_runs):
        got, want = result[(precision, stage, gas)], result[(precision, 0, gas)]
        for name, w in want["params"].items():
            rel = ((got["params"][name] - w).norm() / w.norm()).item()
            assert rel < bound, f"rank {rank} {name}: relative error {rel:.2e} (bound {bound:g})"
        assert got["norms"] == pytest.approx(want["norms"], rel=bound)
    # and the precision's step is not a no-op: the weights moved from their initial values
    torch.manual_seed(0)
    init = dict(ReuseNet("reentrant").named_parameters())
    moved = (mixed_runs[0][(precision, stage, gas)]["params"]["out.weight"] - init["out.weight"].detach()).norm()
    assert moved > 1e-2


# -- NaN/Inf on one rank: every rank skips, at every partitioned stage ------------------------------
BAD_STEP = 2


def _poisoned(stage: int, precision: str, poison: bool) -> dict:
    """5 steps; at BAD_STEP rank 1 feeds an Inf (poison), or that step's batch is left out."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    eng, _, _, _ = engine.initialize(model=ReuseNet(), config=_config(
        stage, 1, precision, fault_tolerance={"nan_policy": "skip"} if precision == "fp32" else {}))
    dtype = next(eng.module.parameters()).dtype
    applied = []
    for step, (x, y) in enumerate(make_batches(5, MICRO * world)):
        if step == BAD_STEP and not poison:
            continue
        xm, ym = next(micro_batches(x.to(dtype), y.to(dtype), rank, world, 1))
        if step == BAD_STEP and rank == 1:
            xm = xm.clone()
            xm[0, 0] = float("inf")
        eng.backward(eng(xm, ym))
        eng.step()
        applied.append(eng.was_step_applied())
    return {"applied": applied, "skipped": eng.skipped_steps,
            "params": {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters()}}


def _poison_cases() -> dict:
    return {(stage, precision, poison): _poisoned(stage, precision, poison)
            for stage in (1, 2, 3) for precision in ("fp32", "fp16") for poison in (True, False)}


@pytest.fixture(scope="module")
def poison_runs():
    return run_distributed(_poison_cases, 2, timeout=240)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_inf_on_one_rank_is_skipped_by_every_rank(poison_runs, stage, precision):
    for rank, result in enumerate(poison_runs):
        poisoned, clean = result[(stage, precision, True)], result[(stage, precision, False)]
        assert poisoned["applied"] == [True, True, False, True, True], f"rank {rank}"
        assert poisoned["skipped"] == 1
        # the skipped step changed nothing: the same weights as a run that never saw that batch
        for name, w in clean["params"].items():
            torch.testing.assert_close(poisoned["params"][name], w, rtol=0, atol=1e-6)


# -- zero_optimization.ignore_unused_parameters -------------------------------------------------------
def _unused(stage: int, ignore: bool):
    """Two steps without ever using the aux head: the steps taken, or the error `step()` raised."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    cfg = _config(stage, 2)
    cfg["zero_optimization"]["ignore_unused_parameters"] = ignore
    eng, _, _, _ = engine.initialize(model=ReuseNet(), config=cfg)
    try:
        for x, y in make_batches(2, MICRO * 2 * world):
            for xm, ym in micro_batches(x, y, rank, world, 2):
                eng.backward(eng(xm, ym))
                eng.step()
    except RuntimeError as e:  # every rank lacks the same gradients, so every rank raises here
        return str(e)
    return eng.global_steps


def _unused_cases() -> dict:
    return {(stage, ignore): _unused(stage, ignore) for stage in (0, 1, 2, 3) for ignore in (True, False)}


@pytest.fixture(scope="module")
def unused_runs():
    return run_distributed(_unused_cases, 2, timeout=120)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ignore_unused_parameters_false_names_the_unused_parameter(unused_runs, stage):
    for result in unused_runs:
        assert result[(stage, True)] == 2  # the default: a missing gradient counts as zero
        text = result[(stage, False)]
        assert isinstance(text, str), "ignore_unused_parameters: false trained on"
        assert "ignore_unused_parameters is false" in text and "aux.weight" in text and "aux.bias" in text
        assert "inp.weight" not in text


# -- reuse that starts after the first step -------------------------------------------------------
def _reuse_from_step_1(stage: int, bucket: int):
    """Reentrant checkpointing switched on after the first step: the block's gradient starts to arrive
    in two pieces after the first backward decided which buckets wait (arrivals.py's note)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = ReuseNet(None)
    cfg = _config(stage, 1)
    cfg["zero_optimization"]["reduce_bucket_size"] = bucket
    eng, _, _, _ = engine.initialize(model=model, config=cfg)
    try:
        for step, (x, y) in enumerate(make_batches(STEPS, MICRO * world)):
            model.checkpointing = "reentrant" if step else None
            xm, ym = next(micro_batches(x, y, rank, world, 1))
            eng.backward(eng(xm, ym, aux=True))
            eng.step()
    except RuntimeError as e:
        return str(e)
    return {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters()}


def _reuse_cases() -> dict:
    # One bucket for the model: the second piece comes before the bucket is full (inp's gradient is
    # last), so it is added there; 1-element buckets: the block's was reduced already, which only an
    # error can answer.
    return {(stage, bucket): _reuse_from_step_1(stage, bucket) for stage in (0, 1, 2, 3) for bucket in (10**6, 1)}


@pytest.fixture(scope="module")
def reuse_runs():
    return run_distributed(_reuse_cases, 2, timeout=120)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reuse_that_starts_later_is_exact_or_a_clear_error(reuse_runs, stage):
    ref, _ = _reference(2, 1, None)  # checkpointing changes memory, not the math
    for result in reuse_runs:
        exact = result[(stage, 10**6)]
        assert isinstance(exact, dict), exact
        for name, want in ref.items():
            assert (exact[name] - want).abs().max().item() < 2e-6, name
        error = result[(stage, 1)]
        assert isinstance(error, str) and f"ZeRO stage {stage}: parameter block." in error
        assert "after its bucket was reduced" in error and "use_reentrant=False" in error


def _first_backward_overlaps(stage: int, checkpointing) -> bool:
    """Whether the first backward launched a bucket's reduction before it ended: read when the input
    layer's gradient, the last one backward makes, arrives. "stack": tests.models.StackNet, whose
    stage-3 units mark their backward with a Function of dstrain's own (stage3_units.py)."""
    torch.manual_seed(0)
    model = StackNet() if checkpointing == "stack" else _model(checkpointing)
    eng, _, _, _ = engine.initialize(model=model, config=_config(stage, 1))
    zopt = eng.zero_optimizer
    launched = []

    def note(_param):
        launched.append((zopt.buckets if stage == 0 else zopt)._next_launch > 0)
    eng.module.inp.weight.register_post_accumulate_grad_hook(note)
    x, y = make_batches(1, MICRO * torch.distributed.get_world_size(), d_in=13, d_out=5)[0]
    xm, ym = next(micro_batches(x, y, torch.distributed.get_rank(), torch.distributed.get_world_size(), 1))
    eng.backward(eng(xm, ym, aux=True))
    eng.step()
    eng.destroy()
    return launched[0]


# checkpointing flavour -> whether the first backward overlaps its reductions; dstrain's reentrant regions
# count only where a parameter is in two of them (ReuseNet's block) or in one and outside
DISCOVERY = {None: True, "non_reentrant": True, "reentrant": False, "stack": True, "dstrain_reentrant": False,
             "stack_reentrant": True}


def _discovery_cases() -> dict:
    return {(stage, ckpt): _first_backward_overlaps(stage, ckpt) for stage in (0, 1, 2, 3)
            for ckpt in DISCOVERY}


@pytest.fixture(scope="module")
def discovery_runs():
    return run_distributed(_discovery_cases, 2, timeout=120)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_first_backward_holds_gradients_only_where_they_can_arrive_twice(discovery_runs, stage):
    # arrivals.py's note (when to discover): autograd's own nodes deliver each gradient once, so the
    # first backward overlaps its reductions, as with dstrain's own Functions that say they deliver
    # once; reentrant checkpointing's Python Function may deliver pieces, so that backward holds them
    # to its end, unless its regions are dstrain's and no parameter is in two places
    # (region_params.py; the parity tests above cover each way)
    for rank, result in enumerate(discovery_runs):
        got = {ckpt: result[(stage, ckpt)] for ckpt in DISCOVERY}
        assert got == DISCOVERY, f"rank {rank}: {got}"


class _Doubling(torch.autograd.Function):
    """A user's custom Function: nothing says it delivers each gradient once."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_which_graph_nodes_can_deliver_a_gradient_twice():
    # arrivals.py's note (when to discover): autograd's own nodes and dstrain's Functions marked
    # `delivers_gradients_once` cannot; an unmarked Python Function (a user's, reentrant checkpointing's) can
    from engine.activation_checkpointing.partition import ToHost
    from engine.tensor_parallel.mappings import _CopyToRegion
    from engine.zero.arrivals import may_arrive_twice
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)
    assert not may_arrive_twice(torch.tanh(layer(x)).sum())
    assert not may_arrive_twice(ToHost.apply(_CopyToRegion.apply(layer(x), None)).sum())
    assert may_arrive_twice(_Doubling.apply(layer(x)).sum())
    assert may_arrive_twice(torch.utils.checkpoint.checkpoint(torch.tanh, layer(x), use_reentrant=True).sum())


def test_dstrain_reentrant_regions_count_only_parameters_used_in_two_places():
    # region_params.py's note: a region records the parameters it uses while an engine is discovering;
    # a parameter gets its gradient in pieces only when used in two regions, or in one and outside them
    from engine.activation_checkpointing import checkpoint
    from engine.zero.arrivals import ArrivalLog, may_arrive_twice
    inp, a, b = (torch.nn.Linear(4, 4) for _ in range(3))
    x = torch.randn(3, 4)

    def region(m):
        return lambda t: torch.tanh(m(t))
    log = ArrivalLog()  # discovering: regions record
    assert not may_arrive_twice(checkpoint(region(b), checkpoint(region(a), inp(x))).sum())
    assert may_arrive_twice(checkpoint(region(a), checkpoint(region(a), inp(x))).sum())  # two regions
    assert may_arrive_twice(checkpoint(region(a), a(inp(x))).sum())  # a region and outside
    # a parameter handed in as an input gets its gradient through the region's outputs' graph: once
    assert not may_arrive_twice(checkpoint(lambda t, w: t @ w, inp(x), a.weight).sum() + a(x).sum())
    captured = a(x)  # the region's backward runs into the graph that made it: unknown
    assert may_arrive_twice(checkpoint(lambda t: t + captured, inp(x)).sum())
    assert may_arrive_twice(checkpoint(lambda t: checkpoint(region(a), t), inp(x)).sum())  # nested: unknown
    log.end_pass()  # discovery over: nothing records, so a region is unknown again
    assert may_arrive_twice(checkpoint(region(b), checkpoint(region(a), inp(x))).sum())


def test_the_first_backward_says_once_why_it_holds_every_gradient():
    # a user whose first step needs more memory than the rest is told which node or parameter caused it
    import warnings

    from engine.activation_checkpointing import checkpoint
    from engine.zero.arrivals import ArrivalLog
    inp, a = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    names = {**{p: f"inp.{n}" for n, p in inp.named_parameters()}, **{p: f"a.{n}" for n, p in a.named_parameters()}}
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match="because of a CheckpointFunctionBackward node .*use_reentrant=False"):
        ArrivalLog(names).before_reducing_backward(
            torch.utils.checkpoint.checkpoint(a, inp(x), use_reentrant=True).sum())
    with pytest.warns(UserWarning, match=r"because of parameter a\.(weight|bias) \(in two reentrant"):
        ArrivalLog(names).before_reducing_backward(checkpoint(a, checkpoint(a, inp(x))).sum())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no hold, no warning
        log = ArrivalLog(names)
        log.before_reducing_backward(checkpoint(a, inp(x)).sum())
        assert not log.discovering

