"""Muon with the optimizer on NVMe: a step that fails on ONE rank only (a swap read or write raising
OffloadIOError). Muon's swapped step orthogonalises its matrices in rounds between its two passes, two
all-to-alls each (engine/zero/nvme_muon.py); before, a rank failing ahead of a round left the other
ranks waiting in that round's all-to-all until the harness timeout. Now every rank raises from the same
`engine.step()`: rank 1 its own OffloadIOError (naming the swap file and the key), rank 0
`PeerStepError` naming rank 1; the step is applied on no rank (two slots: bit for bit the state before
it), the window's gradients are dropped, and training on equals a run that never saw the batch. With
`swap_slots: 1` every rank refuses the next step until a checkpoint load, then training equals that run.

Rank 1's swap I/O of the Muon flat (param group 0 after initialize splits the user's group into its
Muon and AdamW halves) fails in the step of batch FAILED: its momentum writes past the first sub-group
(pass 1, before every round), or once, a read in pass 2 after the first round and before the second
(the master's, or the second round's own read of the momentum). The model's four 32x32 weights make two
rounds against the default swap pool (five 512-element buffers: nvme_muon.py's rounds). Last, a rank
that refuses the step before it begins (fast_init's first step, which cannot be undone, failed on the
other rank) must still meet the others' collectives: Muon's rounds and Lamb's all-reduce (Lamb's own
one-rank failure is test_zero_stage3_step_failure.py's)."""
from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_distributed
from tests.test_zero_stage3_step_failure import (FAILED, FAILING_RANK, STEPS, _state_writes_fail, _weights,
                                                 check_ranks, model_and_groups, rank_batches, swap_io_fails)

MUON_FLAT = "group0-"  # the Muon half of the one user group (engine/optimizers.py's _build_muon)
SUB_GROUP = 512


def _engine(path: str, stage: int, slots: int, optimizer: str, fast_init: bool):
    import engine
    model, params = model_and_groups(1)
    zero = {"stage": stage, "sub_group_size": SUB_GROUP, "offload_optimizer": {
        "device": "nvme", "nvme_path": path, "swap_slots": slots, "fast_init": fast_init}}
    eng = engine.initialize(model=model, model_parameters=params, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": zero,
        "optimizer": {"type": optimizer, "params": {"lr": 0.01}}, "aio": {"block_size": 4096}})[0]
    if optimizer == "Muon":  # the failures below fall before the first round and between the two
        assert len(eng.zero_optimizer.nvme.per_tensor.rounds) == 2
    return eng


def _read_fails_once(armed: bool, file: str):
    """FAILING_RANK's first read of the Muon flat's `file` (a part of its swap file's name) at the third
    sub-group or later fails (EIO) while `armed`: in pass 2, after the first round and before the second
    (the reads after it, putting the master back, pass)."""
    left = [1]

    def fails(name: str, at: int) -> bool:
        if left and MUON_FLAT in name and file in name and at >= 2 * SUB_GROUP * 4:
            return bool(left.pop())
        return False
    return swap_io_fails(armed, "preadv", fails)


def _written_slot(eng) -> int:
    """The slot the Muon flat's step writes, which its rounds read the momentum from (nvme_muon.py)."""
    nvme = eng.zero_optimizer.nvme
    return 1 - nvme.parts[nvme.per_tensor.matrix_keys[0]].source_slot


# the injected failure -> (its context manager given whether it is armed and the engine, the swap file it names)
FAILURES = {
    "momentum write": (lambda armed, eng: _state_writes_fail(armed, 1, "momentum_buffer"), "momentum_buffer"),
    # pass 2's sweep, reading the master of the sub-group the second round is run for
    "master read": (lambda armed, eng: _read_fails_once(armed, ".master."), "master"),
    # the second round's own read of the momentum pass 1 wrote
    "round's momentum read": (lambda armed, eng: _read_fails_once(
        armed, f".momentum_buffer.{_written_slot(eng)}."), "momentum_buffer"),
    "master write": (lambda armed, eng: _state_writes_fail(armed, 1, "master"), "master"),
}


def _train(eng, data, fail_at: int | None, errors: dict, batches, failure: str) -> None:
    for i in batches:
        x, y = data[i]
        try:
            eng.backward(torch.nn.functional.mse_loss(eng(x), y))
            with FAILURES[failure][0](i == fail_at, eng):
                eng.step()
        except RuntimeError as err:
            errors.setdefault(i, []).append((type(err).__name__, str(err)))


def _run(tmp: str, stage: int, slots: int, failure: str, optimizer: str, fast_init: bool = False) -> dict:
    """The failing run and a reference without batch FAILED, one after the other on the same ranks."""
    data = rank_batches(STEPS)
    out = {"errors": {}}
    failed = 0 if fast_init else FAILED  # fast_init: its first step, which no rank can undo
    kept = [i for i in range(STEPS) if i != failed]
    for name in ("ref", "fail"):
        path = os.path.join(tmp, name)
        os.makedirs(path, exist_ok=True)
        eng = _engine(path, stage, slots, optimizer, fast_init)
        if name == "ref":
            _train(eng, data, None, out["errors"], kept, failure)
        else:
            eng.save_checkpoint(os.path.join(path, "ckpt"), tag="start")
            _train(eng, data, failed, out["errors"], range(failed + 2 if fast_init else STEPS), failure)
            if slots == 1 or fast_init:  # refused (the next batch) until a load; then the reference's batches
                eng.load_checkpoint(os.path.join(path, "ckpt"), tag="start")
                _train(eng, data, None, out["errors"], kept, failure)
        out[name] = _weights(eng)
        eng.destroy()
    return out


def _check(tmp_path, stage: int, failure: str, slots: int = 2, optimizer: str = "Muon") -> None:
    ranks = run_distributed(_run, world_size=2, args=(str(tmp_path), stage, slots, failure, optimizer), timeout=60)
    check_ranks(ranks, slots, FAILURES[failure][1])


@pytest.mark.parametrize("stage", [2, 3])
def test_muon_failing_in_its_first_pass_fails_on_every_rank(tmp_path, stage):
    _check(tmp_path, stage, "momentum write")


@pytest.mark.parametrize("failure", ["master read", "round's momentum read"])
def test_muon_failing_between_its_rounds_fails_on_every_rank(tmp_path, failure):
    _check(tmp_path, 2, failure)


def test_muon_in_place_slots_refuse_until_a_load(tmp_path):
    # rank 0 committed in place: it refuses the next step before it begins, rank 1 in its first pass
    # (its momentum was partly overwritten); both still enter the rounds
    _check(tmp_path, 1, "momentum write", slots=1)


@pytest.mark.parametrize("optimizer", ["Muon", "Lamb"])
def test_a_rank_refusing_a_two_pass_step_still_meets_the_others(tmp_path, optimizer):
    """fast_init's first step cannot be undone: rank 1's master write failing in it leaves rank 0, which
    committed it, refusing every step until a load (nvme_tier.py's check_image), while rank 1 steps on.
    Rank 0 still enters the step's collectives (before, rank 1 waited in them): at the next batch it
    raises its refusal and rank 1 PeerStepError naming rank 0; after a load, a run without batch 0."""
    ranks = run_distributed(_run, world_size=2, args=(str(tmp_path), 1, 2, "master write", optimizer, True),
                            timeout=60)
    for rank, out in enumerate(ranks):
        errors = out["errors"]
        assert sorted(errors) == [0, 1], errors
        (kind0, msg0), = errors[0]
        (kind1, msg1), = errors[1]
        if rank == FAILING_RANK:  # its own failure, then rank 0's refusal
            assert kind0 == "OffloadIOError" and ".master." in msg0 and "offload_optimizer.nvme_path" in msg0, msg0
            assert kind1 == "PeerStepError" and "rank 0's optimizer step failed" in msg1, msg1
        else:
            assert kind0 == "PeerStepError" and "rank 1's optimizer step failed" in msg0, msg0
            assert "fast_init's first step, cannot be undone: load a checkpoint" in msg0, msg0
            assert kind1 == "OffloadIOError" and "load a checkpoint" in msg1, msg1
        for a, b in zip(out["fail"], out["ref"]):
            assert torch.equal(a, b), (rank, (a - b).abs().max())
