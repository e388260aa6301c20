"""A pipeline over ZeRO with the optimizer on NVMe: an optimizer step that fails on ONE rank of one stage
(a write of its momentum swap file raising OffloadIOError past the first sub-group) fails on every rank
of every stage. Before, only the failing rank's data group agreed on it (partitioned.py's and stage3.py's
notes: a step failed on some rank): the other stages applied the batch, returned its loss and trained on
while the failing stage had undone it (engine/pipe/stage_failure.py's note: a step failing on one stage).
Now every rank raises from the same `train_batch` (rank 1 its own OffloadIOError, every other rank
PeerStepError naming rank 1), no stage applies the batch, no counter moves, and training on equals a run
that never saw the batch, bit for bit (SGD with momentum, unclipped, fp32: linear in the gradient). With
`swap_slots: 1` (written in place: nothing to go back to) every rank refuses every later batch until a
checkpoint load, and then trains on as that run.

2 stages x 1 data rank (rank 1 is stage 1) or 2 stages x 2 data ranks (rank 1 is stage 0's second data
rank: its data peer hears of it, stage 1 did not); batch FAILED only. Lamb, whose first pass fails on
rank 1 and ends in an all-reduce of norms over the data group: stage 1 names rank 1 alone."""
from __future__ import annotations

import contextlib
import os

import torch

from tests.harness import run_distributed
from tests.test_zero_stage3_step_failure import FAILING_RANK, _state_writes_fail

STEPS, FAILED, GAS, MICRO, WIDTH = 4, 1, 2, 2, 32


def _engine(path: str, stage: int, slots: int, optimizer: dict):
    import engine
    from engine.pipe import LayerSpec, PipelineModule
    from tests.pipe_models import mse
    torch.manual_seed(0)
    specs = [LayerSpec(torch.nn.Linear, WIDTH, WIDTH) if i % 2 == 0 else torch.nn.Tanh() for i in range(8)]
    pm = PipelineModule(specs, num_stages=2, loss_fn=mse, seed_layers=True, partition_method="uniform")
    zero = {"stage": stage, "sub_group_size": 512, "stage3_param_persistence_threshold": WIDTH,
            "offload_optimizer": {"device": "nvme", "nvme_path": path, "swap_slots": slots}}
    return engine.initialize(model=pm, config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
        "zero_optimization": zero, "zero_allow_untested_optimizer": True, "pipeline": {"schedule": "1f1b"},
        "optimizer": optimizer, "aio": {"block_size": 4096}})[0], pm


def _train(eng, batches, fail_at: int | None, errors: dict, steps, state: str) -> list:
    from tests.models import micro_batches
    losses, dp, dp_rank = [], eng.comm.world_size, eng.comm.rank
    for i in steps:
        x, y = batches[i]
        try:
            with _state_writes_fail(i == fail_at, 1, state):
                losses.append(float(eng.train_batch(iter(list(micro_batches(x, y, dp_rank, dp, GAS))))))
        except RuntimeError as err:
            errors.setdefault(i, []).append((type(err).__name__, str(err)))
    return losses


@contextlib.contextmanager
def _status_gathers():
    """The size of each int32 all-gather (a step's status: partitioned.py's _agree_on_step) made meanwhile."""
    from engine.comm import Communicator
    real, sizes = Communicator.all_gather, []

    def all_gather(comm, output, input, async_op=False):
        if output.dtype == torch.int32:
            sizes.append(output.numel())
        return real(comm, output, input, async_op)
    Communicator.all_gather = all_gather
    try:
        yield sizes
    finally:
        Communicator.all_gather = real


def _run(tmp: str, stage: int, slots: int, lamb: bool) -> dict:
    """The failing run and a reference without batch FAILED, one after the other on the same ranks."""
    from engine.utils import safe_get_full_fp32_param
    world = torch.distributed.get_world_size()
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(MICRO * GAS * world // 2, WIDTH, generator=g),
                torch.randn(MICRO * GAS * world // 2, WIDTH, generator=g)) for _ in range(STEPS)]
    kept = [i for i in range(STEPS) if i != FAILED]
    optimizer, state = (({"type": "Lamb", "params": {"lr": 0.01}}, "exp_avg") if lamb else
                        ({"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}, "momentum_buffer"))
    out = {"errors": {}}
    for name in ("ref", "fail"):
        path = os.path.join(tmp, name, str(torch.distributed.get_rank()))
        os.makedirs(path, exist_ok=True)
        eng, pm = _engine(path, stage, slots, optimizer)
        if name == "ref":
            losses = _train(eng, batches, None, out["errors"], kept[:-1], state)
            with _status_gathers() as out["status_gathers"]:  # a clean step's
                losses += _train(eng, batches, None, out["errors"], kept[-1:], state)
        else:
            eng.save_checkpoint(os.path.join(tmp, name, "ckpt"), tag="start")
            losses = _train(eng, batches, FAILED, out["errors"], range(STEPS), state)
            if slots == 1:  # refused (batch FAILED + 1) until a load; then the reference's batches
                eng.load_checkpoint(os.path.join(tmp, name, "ckpt"), tag="start")
                losses = _train(eng, batches, None, out["errors"], kept, state)
        out[name] = {"params": {n: safe_get_full_fp32_param(p) for n, p in pm.named_parameters()},
                     "counters": (eng.global_steps, eng.micro_steps, eng.skipped_steps), "losses": losses}
        eng.destroy()
    return out


def _check(tmp_path, stage: int, world: int, slots: int = 2, lamb: bool = False) -> None:
    ranks = run_distributed(_run, world_size=world, args=(str(tmp_path), stage, slots, lamb), timeout=90)
    for rank, out in enumerate(ranks):
        errors = out["errors"]
        assert sorted(errors) == ([FAILED] if slots == 2 else list(range(FAILED, STEPS))), (rank, errors)
        (kind, msg), = errors[FAILED]
        if rank == FAILING_RANK:  # its own error, naming the swap file and the key
            assert kind == "OffloadIOError" and (".exp_avg." if lamb else ".momentum_buffer.") in msg, (rank, msg)
        else:
            assert kind == "PeerStepError" and f" rank {FAILING_RANK}'s optimizer step failed" in msg, (rank, msg)
        for later in range(FAILED + 1, STEPS) if slots == 1 else ():  # every batch refused until the load
            (kind, msg), = errors[later]
            assert kind == "OffloadIOError" and "load a checkpoint" in msg, (rank, msg)
        # one status per rank of the world, in the step's one status all-gather (stage_failure.py's note)
        assert out["status_gathers"] == [world], out["status_gathers"]
        fail, ref = out["fail"], out["ref"]
        assert fail["counters"] == ref["counters"], (rank, fail["counters"], ref["counters"])
        assert fail["losses"] == ref["losses"], (rank, fail["losses"], ref["losses"])
        for name, w in ref["params"].items():
            assert torch.equal(fail["params"][name], w), (rank, name, (fail["params"][name] - w).abs().max())


def test_stage2_one_stage_failing_its_step_fails_it_on_every_stage(tmp_path):
    _check(tmp_path, stage=2, world=2)


def test_stage3_two_data_ranks_one_failing_fails_the_step_on_every_stage(tmp_path):
    _check(tmp_path, stage=3, world=4)


def test_stage1_in_place_slots_refuse_every_later_batch_on_every_stage_until_a_load(tmp_path):
    _check(tmp_path, stage=1, world=2, slots=1)


def test_stage2_lamb_failing_in_its_first_pass_names_the_failing_rank_on_every_stage(tmp_path):
    # rank 0 hears of rank 1's failure in Lamb's norms all-reduce (nvme_per_tensor.py) and tells the world
    # it failed a peer's way: stage 1 names rank 1 alone (before: "ranks 0, 1")
    _check(tmp_path, stage=2, world=4, lamb=True)
