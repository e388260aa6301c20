"""`NvmeParamStore` (offload/param_swap.py) when a gather's read fails: the pool buffer the group was
read into goes back to the pool, and only once every read into it has landed.

A group whose parameters lie in two flats (two files) is read by two transfers into one pool buffer.
The second is held inside its syscall while the first fails; the test takes every buffer the pool calls
free, fills it with a sentinel and lets the held read finish: the sentinel must be intact, and once the
test gives its buffers back the pool must have all of them (before, a failed gather kept its buffer out
of the pool for good: `buffer_count` failures later every gather waited forever in `acquire`).
Both ways a group is read: at its gather, and ahead of it (`read_ahead`); and the second read refused
as it is started (its file modified underneath) while the first is held.
"""
from __future__ import annotations

import errno
import os
import threading
from types import SimpleNamespace

import pytest
import torch

from offload import AsyncFileIO, SwapBufferPool, SwapDir
from offload.aio import OffloadIOError
from offload.param_swap import NvmeParamStore
from schemas.features import AioConfig
from tests.offload_runs import evict_kept

KEY = "zero_optimization.offload_param.nvme_path"
NUMEL = 4096  # per flat; one parameter fills each
SENTINEL = 7.0


def store_of_two_flats(tmp_path):
    keys = [(0, torch.float32), (1, torch.float32)]
    flats = {key: torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i, key in enumerate(keys)}
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in keys]
    fragments = {p: SimpleNamespace(key=key, offset=0, numel=NUMEL, padded=NUMEL) for p, key in zip(params, keys)}
    partition = SimpleNamespace(flat=flats, fragments=fragments)
    swap = SwapDir.create(tmp_path, path_key=KEY)
    io = AsyncFileIO(AioConfig(block_size=4096), path_key=KEY)
    pool = SwapBufferPool(2, 2 * NUMEL, pin_memory=False, count_key="zero_optimization.offload_param.buffer_count")
    store = NvmeParamStore(partition, swap, io, pool, max_in_cpu=0, name="rank0")
    return store, params, [os.path.realpath(store.files[key]) for key in keys]


def hold_and_fail(monkeypatch, held: str, failing: str | None):
    """os.preadv: the read of `held` waits inside the syscall for `go`; that of `failing` raises EIO once
    the held one is inside its own."""
    entered, go, landed = threading.Event(), threading.Event(), threading.Event()
    real = os.preadv

    def call(fd, buffers, at):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path == held and not entered.is_set():
            entered.set()
            go.wait(10)
            try:
                return real(fd, buffers, at)
            finally:
                landed.set()
        if path == failing:
            entered.wait(10)
            raise OSError(errno.EIO, "injected")
        return real(fd, buffers, at)
    monkeypatch.setattr(os, "preadv", call)
    return entered, go, landed


@pytest.mark.parametrize("read", ["at-the-gather", "ahead", "refused"])
def test_a_failed_gather_read_gives_its_buffer_back_once_every_read_into_it_landed(tmp_path, monkeypatch, read):
    store, params, paths = store_of_two_flats(tmp_path)
    pool = store.pool
    try:
        store.open_slots(params)  # a gather that works, first
        store.close_slots(params)
        evict_kept(pool)  # the next gather reads the files, not the buffer this one left its slots in
        if read == "refused":
            os.utime(paths[1], ns=(10**9, 10**9))  # "modified by another process": its read is refused
            entered, go, landed = hold_and_fail(monkeypatch, held=paths[0], failing=None)
        else:
            entered, go, landed = hold_and_fail(monkeypatch, held=paths[1], failing=paths[0])
        outcome = {}

        def gather():
            try:
                if read == "ahead":
                    assert store.read_ahead(params)
                store.open_slots(params)
            except BaseException as err:  # noqa: BLE001 - the test checks it
                outcome["error"] = err
        gatherer = threading.Thread(target=gather)
        gatherer.start()
        assert entered.wait(10)
        gatherer.join(1.0)  # the old store raised at once; the mended one waits for the held read here
        taken = [pool.acquire(timeout=0) for _ in range(pool.free_count())]
        for buf in taken:
            buf.fill_(SENTINEL)
        go.set()
        assert landed.wait(10)
        gatherer.join(10)
        assert not gatherer.is_alive()
        monkeypatch.undo()
        assert isinstance(outcome.get("error"), OffloadIOError), outcome
        assert all(bool((buf == SENTINEL).all()) for buf in taken), "a read landed in a buffer handed out again"
        for buf in taken:
            pool.release(buf)
        assert pool.free_count() == pool.buffer_count, "the failed gather kept its buffer out of the pool"
        if read != "refused":
            views = store.open_slots(params)  # and the store gathers on
            assert all(torch.equal(v, store.partition.flat[(i, torch.float32)]) for i, v in enumerate(views))
            store.close_slots(params)
    finally:
        store.close()


def test_a_failed_read_ahead_that_a_write_drops_neither_raises_nor_keeps_its_buffer(tmp_path, monkeypatch):
    """A write drops the reads issued ahead (their values are about to be replaced): one that failed goes
    with its values. Before, its error was raised by that write and by every later one (the entry was
    never dropped), and its buffer never went back: the store was wedged."""
    store, params, paths = store_of_two_flats(tmp_path)
    real = os.preadv

    def failing(fd, buffers, at):
        if os.readlink(f"/proc/self/fd/{fd}") == paths[0]:
            raise OSError(errno.EIO, "injected")
        return real(fd, buffers, at)
    try:
        monkeypatch.setattr(os, "preadv", failing)
        assert store.read_ahead(params)
        monkeypatch.undo()
        key = (0, torch.float32)
        for value in (1.0, 2.0):  # the write that drops it, and a later one
            store.write(key, 0, torch.full((NUMEL,), value))
        assert store.pool.free_count() == store.pool.buffer_count
        views = store.open_slots(params)
        assert torch.equal(views[0], torch.full((NUMEL,), 2.0))
        store.close_slots(params)
    finally:
        store.close()
