"""What a pipeline's train_batch communicates per step besides the schedule's sends and receives, counted
at torch.distributed's entry points on each rank: on one data-parallel replica, one all-reduce for the
batch's agreement (engine/pipe/batch_agreement.py) and one for the step's norm², which carries the loss
and the batch's outcome (engine/pipe/reduction.py, stage_failure.py: the outcome rides on the norm), plus
one per tied weight over its tie group; nothing else (no loss broadcast, no outcome vote of its own).
Every small collective is a point where each stage waits for the slowest, on the path from the first
stage's last backward to its next forward (docs/pipeline_measurements.md, 2026-12-07)."""
from __future__ import annotations

import contextlib

import torch

from tests.harness import run_distributed
from tests.models import micro_batches
from tests.pipe_models import global_batches, lm_loss, mlp_specs, mse, tied_specs

MICRO, STEPS = 2, 3
COUNTED = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "reduce_scatter", "barrier", "reduce")


@contextlib.contextmanager
def _counting(calls: dict):
    """Counts each call of the COUNTED collectives (they still run)."""
    import torch.distributed as dist
    originals = {name: getattr(dist, name) for name in COUNTED}

    def counted(name):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return originals[name](*args, **kwargs)
        return call
    for name in COUNTED:
        setattr(dist, name, counted(name))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _per_step(gas: int, tied: bool) -> dict:
    """The collectives of this rank's last train_batch (the first builds and probes the schedule), and
    the losses every stage returned."""
    import engine
    from engine.pipe import PipelineModule
    pm = PipelineModule(tied_specs(4) if tied else mlp_specs(8), num_stages=2, loss_fn=lm_loss if tied else mse,
                        seed_layers=True, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}  # clipping at DeepSpeed's default 1.0
    eng, *_ = engine.initialize(model=pm, config=config)
    losses, calls = [], {}
    for step, (x, y) in enumerate(global_batches(STEPS, MICRO * gas, tied)):
        batch = iter(list(micro_batches(x, y, 0, 1, gas)))
        if step < STEPS - 1:
            losses.append(float(eng.train_batch(batch)))
            continue
        with _counting(calls):
            losses.append(float(eng.train_batch(batch)))
    return {"calls": calls, "losses": losses}


def _each() -> dict:
    return {(gas, tied): _per_step(gas, tied) for gas in (1, 4) for tied in (False, True)}


def test_a_step_on_one_replica_makes_two_small_collectives_plus_one_per_tied_weight():
    per_rank = run_distributed(_each, world_size=2, timeout=120)
    for (gas, tied), first in per_rank[0].items():
        for rank, r in enumerate(per_rank):
            got = r[(gas, tied)]
            assert got["calls"] == {"all_reduce": 3 if tied else 2}, (rank, gas, tied, got["calls"])
            # the loss that rode on the norm's all-reduce: the same on both stages
            assert got["losses"] == first["losses"] and all(torch.isfinite(torch.tensor(first["losses"]))), (rank, gas)


if __name__ == "__main__":
    test_a_step_on_one_replica_makes_two_small_collectives_plus_one_per_tied_weight()
