"""`NvmeParamStore`'s kept buffers (offload/param_swap.py's note): a gather finds its group still in the
pool buffer the last one left it in and reads nothing; a write reaches the kept buffers it covers; a
buffer open across a write goes back without its bytes; a buffer the pool handed to another group is
not written into. The engine-level check (training equal to no offload, each group read once) is
tests/test_offload_param_nvme.py's kept-buffers test."""
from __future__ import annotations

import torch

from tests.test_offload_param_store_errors import NUMEL, store_of_two_flats


def _values(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 + seed))


def test_a_second_gather_of_a_group_reads_nothing_and_sees_the_writes_made_between(tmp_path):
    store, params, _ = store_of_two_flats(tmp_path)
    try:
        first = [s.clone() for s in store.open_slots(params)]
        store.close_slots(params)
        assert (store.reads_at_gather, store.kept_hits) == (1, 0)
        read = store.bytes_read
        new = _values(1)
        store.write(store.partition.fragments[params[1]].key, 0, new)  # a kept buffer, written into
        got = store.open_slots(params)
        assert (store.reads_at_gather, store.kept_hits, store.bytes_read) == (1, 1, read)
        assert torch.equal(got[0], first[0]) and torch.equal(got[1], new)
        store.close_slots(params)
    finally:
        store.close()


def test_a_buffer_open_across_a_write_goes_back_without_its_bytes(tmp_path):
    store, params, _ = store_of_two_flats(tmp_path)
    try:
        store.open_slots(params)
        new = _values(2)
        store.write(store.partition.fragments[params[0]].key, 0, new)  # while the gather's buffer is open
        store.close_slots(params)
        got = store.open_slots(params)  # from the files: the open buffer held the old values
        assert (store.reads_at_gather, store.kept_hits) == (2, 0)
        assert torch.equal(got[0], new)
        store.close_slots(params)
    finally:
        store.close()


def test_a_buffer_handed_to_another_group_is_not_written_into(tmp_path):
    store, params, _ = store_of_two_flats(tmp_path)
    try:
        store.open_slots(params[:1])
        store.close_slots(params[:1])  # group [p0] kept
        taken = [store.pool.acquire() for _ in range(store.pool.buffer_count)]  # both, the kept one too
        for buf in taken:
            buf.fill_(7.0)
        store.write(store.partition.fragments[params[0]].key, 0, _values(3))
        assert all(bool((buf == 7.0).all()) for buf in taken), "a write reached a buffer the pool handed out"
        for buf in taken:
            store.pool.release(buf)
        assert torch.equal(store.open_slots(params[:1])[0], _values(3))
        assert (store.reads_at_gather, store.kept_hits) == (2, 0)
        store.close_slots(params[:1])
    finally:
        store.close()
