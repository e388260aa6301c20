"""offload/staging.py: a staging buffer is handed out again only once nothing refers to its storage (a
view, a transfer in flight), at the O_DIRECT phase of the offset asked for, on huge pages where it spans
one; bases that fit no request are dropped."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from offload import huge_pages as hp
from offload import staging as st
from offload.aio import ALIGNMENT, AsyncFileIO
from schemas.features import AioConfig

pytestmark = pytest.mark.skipif(st._use_count is None, reason="this torch has no storage use count: nothing is reused")


def test_reused_once_released_never_while_a_view_lives():
    s = st.Staging()
    a = s.empty(1000, 0)
    first = a.data_ptr()
    del a
    b = s.empty(900, 0)
    assert b.data_ptr() == first and (s.made, s.reused) == (1, 1)
    view = b[10:20]
    del b
    c = s.empty(900, 0)  # `view` still holds the first base
    assert c.data_ptr() != first and (s.made, s.reused) == (2, 1)
    del view, c
    assert s.empty(900, 0).data_ptr() in {b.data_ptr() for b in s._bases}
    assert s.reused == 2 and s.made == 2


@pytest.mark.parametrize("offset,dtype", [(0, torch.float32), (5, torch.float32), (4099, torch.bfloat16), (7, torch.uint8)])
def test_address_has_the_offsets_block_phase(offset, dtype):
    s = st.Staging()
    for numel in (1, 4096, 300_000):
        t = s.empty(numel, offset, dtype)
        assert t.dtype == dtype and t.numel() == numel and t.device.type == "cpu"
        assert t.data_ptr() % ALIGNMENT == offset * dtype.itemsize % ALIGNMENT


def test_not_reused_while_its_write_is_in_flight(tmp_path, monkeypatch):
    """The I/O engine's transfer holds the buffer: a write not yet landed keeps it out of reuse even when
    the caller dropped every reference of its own."""
    io = AsyncFileIO(AioConfig(), path_key="test")
    path = str(tmp_path / "w.bin")
    io.write(path, torch.zeros(1024, dtype=torch.uint8), 0).wait()  # opened (the O_DIRECT probe)
    gate, real = threading.Event(), os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, off: (gate.wait(10), real(fd, bufs, off))[1])
    s = st.Staging()
    buf = s.empty(1 << 18, 0)
    buf.fill_(3.0)
    handle = io.write(path, buf, 0)
    first = buf.data_ptr()
    del buf
    other = s.empty(1 << 18, 0)  # the write has not landed: a new base
    assert other.data_ptr() != first
    other.fill_(9.0)
    gate.set()
    handle.wait()
    io.close()
    back = torch.from_file(path, size=1 << 20, dtype=torch.uint8).view(torch.float32)
    assert torch.equal(back, torch.full((1 << 18,), 3.0))  # the bytes written are the first buffer's
    del other
    assert s.empty(1 << 18, 0).data_ptr() in {b.data_ptr() for b in s._bases} and s.reused == 1


def test_bases_that_fit_nothing_are_dropped_and_at_most_keep_kept():
    s = st.Staging()
    small = [s.empty(1000, 0) for _ in range(3)]
    del small
    big = s.empty(1 << 20, 0)  # no idle base fits: the three small ones go
    assert len(s._bases) == 1 and s._bases[0].numel() >= (1 << 20) * 4
    held = [big] + [s.empty(1 << 10, 0) for _ in range(st.KEEP + 3)]
    assert len(s._bases) == st.KEEP and len({t.data_ptr() for t in held}) == len(held)


@pytest.mark.skipif(not hp.available(), reason="this kernel gives no transparent huge pages")
def test_a_base_spanning_a_huge_page_is_advised():
    s = st.Staging()
    t = s.empty(1 << 20, 0)  # 4 MiB
    assert hp.advised_bytes(t) == 4 << 20
    assert hp.advised_bytes(s.empty(1000, 0)) == 0
