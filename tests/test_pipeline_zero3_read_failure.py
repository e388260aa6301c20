"""ZeRO-3 inside a pipeline stage with parameters on NVMe: a gather's read failing while the schedule's
hold gathers the stage's groups (engine/pipe/zero3.py's note: one gather per step) is that stage's
failure of the batch (stage_failure.py's note): the schedule runs, every rank drops the batch after it
and raises (the failing rank its OffloadIOError, the other stage StageFailed), and training goes on.
Before, the error left hold on the failing stage's ranks only (stage3_read_failures.py raises outside a
pass at once) while the other stage waited in the schedule for its activations: 2 ranks, harness
timeout with both running. 2 ranks: 2 stages of one data rank each; rank 0's parameter file reads fail
(an EIO injected at os.preadv, the aio workers' read) during step 1's hold, and during an eval_batch's."""
from __future__ import annotations

import errno
import os

import torch

from tests.harness import run_distributed
from tests.test_pipeline_zero3_persistent_retry import GAS

STEPS, FAILED_STEP = 4, 1


def _train(tmp: str, fail: bool, skip: bool) -> dict:
    from engine.utils import safe_get_full_fp32_param
    from tests.models import micro_batches
    from tests.offload_runs import evict_kept
    from tests.pipe_models import global_batches
    from tests.test_pipeline_zero3_persistent_retry import pipeline_on_nvme
    eng, pm = pipeline_on_nvme(os.path.join(tmp, f"{fail}{skip}"), 0)
    real = os.preadv

    def preadv(fd, buffers, at):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".param.swp"):
            raise OSError(errno.EIO, "injected read error")
        return real(fd, buffers, at)
    dp, dp_rank, errors = eng.comm.world_size, eng.comm.rank, []
    for step, (x, y) in enumerate(global_batches(STEPS, 2 * GAS * dp, True)):
        if step == FAILED_STEP and skip:
            continue
        armed = step == FAILED_STEP and fail and torch.distributed.get_rank() == 0
        if armed:
            evict_kept(eng.zero_optimizer.partition.store.pool)  # its groups are read from the files
            os.preadv = preadv
        try:
            eng.train_batch(iter(list(micro_batches(x, y, dp_rank, dp, GAS))))
        except Exception as err:  # noqa: BLE001 - recorded for the test
            errors.append((step, type(err).__name__, str(err)))
        finally:
            os.preadv = real
    weights = {n: safe_get_full_fp32_param(p) for n, p in pm.named_parameters()}
    between = sum(p.numel() for p in pm.parameters())  # nothing stays gathered
    if fail:  # eval_batch's hold: the same, on an evaluation
        if torch.distributed.get_rank() == 0:
            evict_kept(eng.zero_optimizer.partition.store.pool)
            os.preadv = preadv
        try:
            eng.eval_batch(iter(list(micro_batches(x, y, dp_rank, dp, GAS))))
        except Exception as err:  # noqa: BLE001 - recorded for the test
            errors.append(("eval", type(err).__name__, str(err)))
        finally:
            os.preadv = real
        between += sum(p.numel() for p in pm.parameters())
    eng.destroy()
    return {"weights": weights, "errors": errors, "between": between}


def test_a_read_failing_in_the_schedules_hold_drops_the_batch_on_every_stage(tmp_path):
    want = run_distributed(_train, world_size=2, args=(str(tmp_path), False, True), timeout=120)
    got = run_distributed(_train, world_size=2, args=(str(tmp_path), True, False), timeout=120)
    for rank in range(2):
        assert want[rank]["errors"] == [], want[rank]["errors"]
        assert [step for step, _, _ in got[rank]["errors"]] == [FAILED_STEP, "eval"], got[rank]["errors"]
        for _, kind, msg in got[rank]["errors"]:
            if rank == 0:
                assert kind == "OffloadIOError" and ".param.swp" in msg, msg
            else:
                assert kind == "StageFailed" and "stage 0 (rank 0" in msg and "OffloadIOError" in msg, msg
        assert got[rank]["between"] == want[rank]["between"] == 0, got[rank]["between"]
        for name, w in want[rank]["weights"].items():
            assert torch.equal(got[rank]["weights"][name], w), f"rank {rank} {name}: {(got[rank]['weights'][name] - w).abs().max()}"
