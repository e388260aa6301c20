"""ChunkFile's dead-slot finalizer (offload/chunk_file.py) runs in a garbage collection at any allocation,
and on any thread: also while `_punch_dead` itself is between taking a dead slot and dropping it from the
list. The nested call must not punch and drop the slot the outer call is handling, else the outer one
drops another slot, never punched (its bytes stay on disk), or pops an empty list: an IndexError out of
`put`, i.e. out of a module's construction under zero.Init(remote_device="nvme")."""
from __future__ import annotations

import os
import tempfile
import types

import torch

from offload.aio import AsyncFileIO
from offload.chunk_file import ChunkFile
from offload.swap_dir import SwapDir

SLOT = 16384  # 4096 fp32 elements: one O_DIRECT-aligned slot


def _file() -> ChunkFile:
    aio = types.SimpleNamespace(block_size=1 << 20, queue_depth=8, intra_op_parallelism=1, single_submit=False,
                                overlap_events=True, use_gds=False)
    return ChunkFile(SwapDir.create(tempfile.mkdtemp(), path_key="k"), AsyncFileIO(aio, path_key="k"), "r0")


def test_a_slot_freed_while_a_dead_slot_is_being_punched_is_punched_once_and_put_succeeds():
    f = _file()
    kept = f.put(torch.ones(4096))
    first, second = [f.put(torch.ones(4096) * 2)], [f.put(torch.ones(4096) * 3)]
    with f.io._files[f.path].lock:  # a collection inside the I/O engine's lock: its punch waits (_dead)
        first.clear()
    assert len(f._dead) == 1
    discard, calls = f.io.discard, []

    def discard_after_a_collection(*args):
        # the moment a collection runs inside the outer call: the second chunk's last reference goes
        calls.append(args)
        if len(calls) == 1:
            second.clear()
        return discard(*args)
    f.io.discard = discard_after_a_collection
    third = f.put(torch.ones(4096) * 4)  # the old code: IndexError (pop from empty list)
    assert f._dead == []
    assert sorted({a[1] for a in calls}) == [SLOT, 2 * SLOT]  # both dead slots punched
    assert os.stat(f.path).st_blocks * 512 == 2 * SLOT  # only the two live slots hold blocks
    assert kept.load().eq(1).all() and third.load().eq(4).all()
    f.close()


def test_a_punch_that_must_wait_keeps_its_slot_for_the_next_put():
    f = _file()
    kept, dead = f.put(torch.ones(4096)), [f.put(torch.ones(4096) * 2)]
    with f.io._files[f.path].lock:
        dead.clear()
        assert len(f._dead) == 1  # not lost while the punch could not run
    third = f.put(torch.ones(4096) * 3)
    assert f._dead == [] and os.stat(f.path).st_blocks * 512 == 2 * SLOT
    assert kept.load().eq(1).all() and third.load().eq(3).all()
    f.close()
