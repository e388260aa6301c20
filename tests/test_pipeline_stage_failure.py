"""An error raised by user code inside a pipeline's schedule on one stage (engine/pipe/stage_failure.py):
the loss_fn on the last stage, a layer's forward on the stage holding it, a backward pass on the stage
holding it (a custom autograd Function's backward, a hook on a parameter's gradient: under zero_bubble
one raises in the input-gradient step, the other in the weight-gradient step), in train_batch and eval_batch,
at the step's first micro-batch or a later one, on every replica or on one. Every rank of the world
raises at once (a hang is the harness's timeout; each call must end within seconds): the failing rank
its own error, every other rank a StageFailed naming the failing stage, its rank and the error. Nothing
changed: training on ends bit for bit where a run that never met the failing calls ends, with the same
step counters.

A forward that raises in the probe (the first batch of a new shape: probe.py) the same way.
With a weight tied between the first and the last stage the same: the stage that raised and the stage
that did not both sum the tied gradient over their tie group before the norm's all-reduce tells the
second one (stage_failure.py's note: the outcome rides on the norm).
Each spawn trains two engines on the same batches: A meets the failing calls after its first step (so
the probe of the usual shape has run), B does not."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

from engine.pipe import LayerSpec, TiedLayerSpec
from tests.harness import run_distributed
from tests.models import micro_batches
from tests.pipe_models import D, assert_trained_alike, global_batches, mlp_specs, mse, trained_state

LR, MICRO, GAS, STEPS = 0.1, 2, 2, 3
# micro-batch (call count) at which the user code raises, or None
ARMED = {"loss": None, "forward": None, "backward": None, "weight": None}
CALLS = {kind: 0 for kind in ARMED}


class BadLabel(ValueError):
    pass


class BadActivation(ValueError):
    pass


class BadGradient(ValueError):
    pass


def _counted(kind: str) -> bool:
    """Whether this call of `kind`'s user code is the armed one."""
    CALLS[kind] += 1
    return ARMED[kind] is not None and CALLS[kind] - 1 == ARMED[kind]


def raising_mse(out, y):
    if _counted("loss"):
        raise BadLabel("a bad label")
    return mse(out, y)


class CheckedGradient(torch.autograd.Function):
    """The identity, whose backward raises when armed (a user's assertion on a gradient)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if _counted("backward"):
            raise BadGradient("a gradient out of range")
        return grad


class Checker(nn.Module):
    """A layer with no parameters whose forward raises when armed (a user's assertion on its input), and
    whose backward does (CheckedGradient)."""

    def forward(self, x):
        if self.training and _counted("forward"):
            raise BadActivation("an activation out of range")
        return CheckedGradient.apply(x) if self.training else x


def _weight_hook(grad):
    if _counted("weight"):
        raise BadGradient("a weight gradient out of range")


class HookedLinear(nn.Linear):
    """nn.Linear with a hook on its weight's gradient that raises when armed."""

    def __init__(self, *args):
        super().__init__(*args)
        self.weight.register_hook(_weight_hook)


def _engine(stages: int, zero: int, schedule: str, tied: bool = False, compressed: bool = False):
    import engine
    from engine.pipe import PipelineModule
    # uniform: the Checker and the HookedLinear on the first and last stage of 2 (1f1b), both in chunk 1
    # (stage 1) under zero_bubble (the weight hook in a weight-gradient step of its own), both on stage 1 of 3;
    # `tied`: a Linear applied first (stage 0) and last (stage 1), one weight over both stages
    specs = mlp_specs(4) + [Checker(), LayerSpec(HookedLinear, D, D)] + mlp_specs(4)[1:]
    if tied:
        specs = [TiedLayerSpec("ends", nn.Linear, D, D), *specs, TiedLayerSpec("ends", nn.Linear, D, D)]
    pm = PipelineModule(specs, num_stages=stages, loss_fn=raising_mse, seed_layers=True, partition_method="uniform",
                        virtual_stages=2 if schedule == "zero_bubble" else 1)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True,
              "gradient_clipping": 0.0, "zero_optimization": {"stage": zero}, "pipeline": {"schedule": schedule},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.05, "warmup_max_lr": LR,
                                                           "warmup_num_steps": 4}}}  # no step at lr 0
    if compressed:  # PowerSGD from the first step, rank 1 (the 8 x 8 weights are compressed, not averaged)
        config["gradient_compression"] = {"rank": 1, "start_step": 0}
    eng, *_ = engine.initialize(model=pm, config=config)
    return pm, eng


def _iterator(eng, batch):
    return iter(list(micro_batches(*batch, eng.comm.rank, eng.comm.world_size, GAS)))


def _failing_call(eng, pm, batch, case) -> dict:
    """(kind "loss"/"forward", micro-batch, "train"/"eval", data-parallel ranks armed or None for all);
    "probe": a batch of a new shape, whose probe forward (micro-batch 0) raises in the Checker."""
    kind, micro, call, replicas = case
    if kind == "probe":
        kind, batch = "forward", global_batches(1, (MICRO + 1) * GAS * eng.comm.world_size, False)[0]
    armed = replicas is None or eng.groups.coord.data in replicas
    CALLS.update({k: 0 for k in CALLS})
    ARMED[kind] = micro if armed else None
    start = time.monotonic()
    try:
        eng.eval_batch(_iterator(eng, batch)) if call == "eval" else eng.train_batch(_iterator(eng, batch))
        message = "no error"
    except Exception as err:  # noqa: BLE001 - the test reads its type and text
        message = f"{type(err).__name__}: {err}"
        notes = getattr(err, "__notes__", [])
    finally:
        ARMED[kind] = None
    holder = {"forward": Checker, "backward": Checker, "weight": HookedLinear}.get(kind)
    holds = any(isinstance(m, holder) for m in pm.modules()) if holder else eng.is_last_stage
    return {"message": message, "notes": notes if message != "no error" else [], "seconds": time.monotonic() - start,
            "raised_here": armed and holds, "user_calls": CALLS[kind]}


def _run(stages: int, zero: int, cases: list, schedule: str = "1f1b", tied: bool = False,
         compressed: bool = False) -> dict:
    pm_a, eng_a = _engine(stages, zero, schedule, tied, compressed)
    batches = global_batches(STEPS + 2, MICRO * GAS * eng_a.comm.world_size, False)
    losses_a = [float(eng_a.train_batch(_iterator(eng_a, batches[0])))]
    calls = [_failing_call(eng_a, pm_a, batches[-1], case) for case in cases]
    losses_a += [float(eng_a.train_batch(_iterator(eng_a, b))) for b in batches[1:STEPS + 1]]
    pm_b, eng_b = _engine(stages, zero, schedule, tied, compressed)
    losses_b = [float(eng_b.train_batch(_iterator(eng_b, b))) for b in batches[:STEPS + 1]]
    return {"calls": calls, "a": trained_state(pm_a, eng_a), "b": trained_state(pm_b, eng_b), "stage": eng_a.stage_id,
            "rank": eng_a.groups.rank, "data": eng_a.groups.coord.data, "losses": (losses_a, losses_b)}


ALL = [("loss", 1, "train", None), ("forward", 0, "train", None), ("loss", 0, "eval", None),
       ("forward", 1, "train", None), ("probe", 0, "train", None), ("backward", 1, "train", None),
       ("weight", 0, "train", None)]
BACKWARD = [("backward", 0, "train", None), ("weight", 1, "train", None)]
ONE_REPLICA = [("loss", 1, "train", {1}), ("forward", 0, "train", {0}), ("probe", 0, "train", {1}),
               ("backward", 0, "train", {1}), ("weight", 1, "train", {0})]
TIED = [("loss", 1, "train", None), ("forward", 0, "train", None), ("weight", 0, "train", None)]
# 2 stages of 2 chunks each under zero_bubble (its input-gradient step sends what autograd.grad gives),
# and under 1f1b, with a weight tied between them at ZeRO-1; 3 stages (and under zb_h1, whose input- and
# weight-gradient steps are its own loop's, engine/pipe/zb_h1.py); 2 stages × 2 replicas at ZeRO-3,
# and at stage 0 with PowerSGD, whose error feedback a data group that did not know of the failure fed
# with the dropped batch's gradient before the norm's all-reduce told it (the outcome is voted first there)
LAYOUTS = {2: [(2, 0, ALL, "zero_bubble"), (2, 0, BACKWARD), (2, 1, TIED, "1f1b", True)],
           3: [(3, 0, ALL), (3, 0, BACKWARD, "zb_h1")],
           4: [(2, 3, ONE_REPLICA), (2, 0, ONE_REPLICA[:2], "1f1b", False, True)]}


def _each(layouts: list) -> list:
    return [_run(*layout) for layout in layouts]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def results(request):
    world = request.param
    return world, run_distributed(_each, world_size=world, args=(LAYOUTS[world],), timeout=60 + 30 * world)


ORIGINAL = {"loss": "BadLabel: a bad label", "forward": "BadActivation: an activation out of range",
            "probe": "BadActivation: an activation out of range", "backward": "BadGradient: a gradient out of range",
            "weight": "BadGradient: a weight gradient out of range"}
IN_BACKWARD = {"backward", "weight"}


def test_every_rank_raises_at_once_naming_the_failing_stage(results):
    world, per_rank = results
    for layout, (_, _, cases, *_) in enumerate(LAYOUTS[world]):
        for i, (kind, micro, _, _) in enumerate(cases):
            calls = [r[layout]["calls"][i] for r in per_rank]
            failing = [(r[layout]["stage"], r[layout]["rank"], r[layout]["data"]) for r, c in zip(per_rank, calls)
                       if c["raised_here"]]
            assert len(failing) == 1, (kind, failing)
            stage, rank, data = failing[0]
            for r, call in zip(per_rank, calls):
                assert call["seconds"] < 10, call
                where = ", in a backward pass" if kind in IN_BACKWARD else ""
                if call["raised_here"]:
                    assert call["message"] == ORIGINAL[kind], call
                    if kind in IN_BACKWARD:  # the batch's later backward passes here ran no user code
                        assert call["user_calls"] == micro + 1, call
                    assert call["notes"] == [f"stage {stage} (rank {rank}){where}: every rank of the pipeline stopped "
                                             "after this batch's schedule; its gradients were dropped, no step was "
                                             "taken"], call
                else:
                    assert call["message"] == (
                        f"StageFailed: stage {r[layout]['stage']}: stage {stage} (rank {rank}, data-parallel rank "
                        f"{data}) raised inside the schedule{where}: {ORIGINAL[kind]}; every "
                        "rank stops here, the batch's gradients were dropped and no step was taken"), call


def test_training_on_after_the_failing_calls_is_bit_for_bit_a_run_without_them(results):
    world, per_rank = results
    for layout in range(len(LAYOUTS[world])):
        for r in per_rank:
            assert_trained_alike(r[layout]["a"], r[layout]["b"], r[layout]["losses"])
