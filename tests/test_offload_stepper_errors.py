"""`SwappedPartition` (offload/swapped_partition.py) after one transfer of a sub-group fails: no pool
buffer goes back to the pool while an I/O worker still reads or writes it.

A sub-group's master and optimizer state (AdamW: three tensors) move as three transfers in flight at
once. When one of them fails (a read error, a disk that fills during the write) or a later one is
refused at submission (a swap file modified underneath), the step raises and the sub-group's buffers
go back to the pool; a sibling transfer still running would then land in (read) or be sourced from
(write) a buffer the pool has already handed to its next user. Each test holds that sibling inside its
syscall, lets the failing one fail, takes every buffer the pool calls free and fills it with a sentinel,
then lets the sibling finish: the sentinel must be intact (read) and must not reach the file (write).
"""
from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from offload import AsyncFileIO, SwapBufferPool, SwapDir, SwappedPartition, sub_group_buffer_elements
from offload.aio import OffloadIOError
from schemas.features import AioConfig

KEY = "zero_optimization.offload_optimizer.nvme_path"
NUMEL, SUB_GROUP, BUFFERS = 4096, 1024, 9
SENTINEL = 7.0  # no AdamW master or moment of these gradients takes this value in every element


def make(params):
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


class Held:
    """Wraps os.preadv / os.pwritev: the call on `held` (a path) at byte `offset` waits for `go` inside the
    syscall; the call on `failing` there raises once `held` is inside its own (so it is in flight)."""

    def __init__(self, monkeypatch, name: str, held: str, failing: str | None, offset: int = 0):
        self.held, self.failing = held, failing
        self.entered, self.go, self.landed = threading.Event(), threading.Event(), threading.Event()
        real = getattr(os, name)

        def call(fd, buffers, at):
            path = os.readlink(f"/proc/self/fd/{fd}")
            if path == self.held and at == offset and not self.entered.is_set():
                self.entered.set()
                self.go.wait(10)
                try:
                    return real(fd, buffers, at)
                finally:
                    self.landed.set()
            if path == self.failing and at == offset:
                self.entered.wait(10)
                raise OSError(errno.EIO if name == "preadv" else errno.ENOSPC, "injected")
            return real(fd, buffers, at)
        monkeypatch.setattr(os, name, call)


def stepped_twice(tmp_path):
    swap = SwapDir.create(tmp_path, path_key=KEY)
    io = AsyncFileIO(AioConfig(block_size=4096), path_key=KEY)
    pool = SwapBufferPool(BUFFERS, sub_group_buffer_elements(NUMEL, SUB_GROUP), pin_memory=False)
    part = SwappedPartition(NUMEL, make, swap, io, pool, SUB_GROUP)  # sequential: one sub-group's buffers out
    gen = torch.Generator().manual_seed(0)
    part.initialize(lambda s, e: torch.randn(e - s, generator=gen))
    grad = torch.randn(NUMEL, generator=gen)
    for _ in range(2):  # the state exists: a step reads and writes master, exp_avg, exp_avg_sq
        part.step(lambda s, e: grad[s:e])
    return swap, io, pool, part, grad


def path_of(part: SwappedPartition, key: str, slot: int) -> str:
    return os.path.realpath(part._file(key, slot))


def last_read(part: SwappedPartition) -> int:
    """The byte offset of the sub-group the next step reads last: the first ones it takes from the pool,
    kept there by the step before (swapped_partition.py's note: kept sub-groups), so reads no file."""
    return part.step_order()[-1] * part.stride_bytes


def step_with_a_transfer_held(part, pool, grad, held: Held, call=None):
    """Steps (or runs `call`) in a thread; once the held transfer is inside its syscall and the step had a
    second to finish, takes every free buffer and fills it with SENTINEL, then lets the held transfer
    finish. Returns (the buffers taken, the step's error)."""
    outcome = {}
    call = call or (lambda: part.step(lambda s, e: grad[s:e]))

    def run():
        try:
            call()
        except BaseException as err:  # noqa: BLE001 - the test checks it
            outcome["error"] = err
    stepper = threading.Thread(target=run)
    stepper.start()
    assert held.entered.wait(10), "the held transfer never started"
    stepper.join(1.0)  # the old stepper raised (and freed the buffers) at once; the mended one waits here
    taken = [pool.acquire(timeout=0) for _ in range(pool.free_count())]
    for buf in taken:
        buf.fill_(SENTINEL)
    held.go.set()
    assert held.landed.wait(10)
    stepper.join(10)
    assert not stepper.is_alive()
    return taken, outcome.get("error")


@pytest.mark.parametrize("how", ["sibling-fails", "later-one-refused", "sibling-fails-in-a-save"])
def test_no_read_lands_in_a_buffer_handed_out_again(tmp_path, monkeypatch, how):
    """The master's read fails while exp_avg's is in flight; or exp_avg's read is refused at submission
    (its file modified underneath) while the master's, submitted first, is in flight. In a save: the
    checkpoint's read of the state (`state_chunks`, engine/checkpoint/nvme.py), after which a caught error
    lets training go on with the buffers it gave back (partition_stream.py waited only up to the failure)."""
    swap, io, pool, part, grad = stepped_twice(tmp_path)
    try:
        slot = part.source_slot
        if how.startswith("sibling-fails"):  # last_read: the sub-group read from the files (others: kept)
            held = Held(monkeypatch, "preadv", path_of(part, "exp_avg", slot), path_of(part, "master", slot),
                        last_read(part))
            said = "master"
        else:
            os.utime(part._file("exp_avg", slot), ns=(10**9, 10**9))  # "modified by another process"
            held = Held(monkeypatch, "preadv", path_of(part, "master", slot), None, last_read(part))
            said = "modified by another process"
        save = (lambda: list(part.state_chunks())) if how.endswith("save") else None
        taken, error = step_with_a_transfer_held(part, pool, grad, held, call=save)
        monkeypatch.undo()
        assert isinstance(error, OffloadIOError) and said in str(error), error
        assert all(bool((buf == SENTINEL).all()) for buf in taken), \
            "a read landed in a buffer the pool had already handed out again"
        for buf in taken:
            pool.release(buf)
        assert pool.free_count() == BUFFERS
    finally:
        part.close(), io.close(), swap.close()


def test_a_failed_write_leaves_no_sibling_write_sourced_from_a_freed_buffer(tmp_path, monkeypatch):
    swap, io, pool, part, grad = stepped_twice(tmp_path)
    try:
        target = 1 - part.source_slot
        held = Held(monkeypatch, "pwritev", path_of(part, "exp_avg", target), path_of(part, "master", target))
        taken, error = step_with_a_transfer_held(part, pool, grad, held)
        monkeypatch.undo()
        assert isinstance(error, OffloadIOError) and "master" in str(error), error
        written = torch.from_file(part._file("exp_avg", target), size=SUB_GROUP, dtype=torch.float32)
        assert not bool((written == SENTINEL).any()), "a write took its bytes from a buffer handed out again"
        for buf in taken:
            pool.release(buf)
    finally:
        part.close(), io.close(), swap.close()

