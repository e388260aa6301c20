"""The gradient swap's read-ahead (engine/zero/grad_swap.py's note: read-ahead) is speculative: when no
call takes it, a landing, `zero` or a read of another range drops it, and a read ahead that failed goes
with its values. Before, its error was raised by whichever of those came next (a gradient bucket's
landing in backward raising a read nobody asked for), and the range's own read was never retried."""
from __future__ import annotations

import pytest
import torch

from engine.zero.grad_swap import GradientSwap
from offload import AsyncFileIO, SwapDir
from offload.aio import OffloadIOError
from schemas.features import AioConfig

KEY = "zero_optimization.offload_optimizer.nvme_path"
NUMEL = 4096


class _Partition:
    flat = {(0, torch.float32): torch.zeros(NUMEL, device="cpu")}


class _FailedRead:
    def wait(self):
        raise OffloadIOError("swap.grad.swp: read failed (injected)")


@pytest.fixture
def swapped(tmp_path):
    swap = SwapDir.create(tmp_path, path_key=KEY)
    io = AsyncFileIO(AioConfig(block_size=4096), path_key=KEY)
    grads = GradientSwap(_Partition(), swap, io, "rank0", read_ahead=True)
    key = next(iter(_Partition.flat))
    values = torch.arange(NUMEL, dtype=torch.float32, device="cpu")
    base = torch.empty(0, device="cpu")
    grads.push(io.write(grads.file_of(key), values.clone(), 0), base)
    grads.flush()
    yield grads, key, values
    grads.close()
    io.close()
    swap.close()


def _fail_reads_ahead(grads: GradientSwap) -> None:
    real = grads._start_read

    def start(key, s, e):
        handle, out = real(key, s, e)
        handle.wait()  # the real read lands before the handle is replaced: no worker left on `out`
        return _FailedRead(), out
    grads._start_read = start


@pytest.mark.parametrize("then", ["zero", "read_other", "land"])
def test_a_failed_read_ahead_is_dropped_not_raised_by_the_next_call(swapped, then):
    grads, key, values = swapped
    assert torch.equal(grads.read(key, 0, 1024), values[:1024])  # no read ahead asked: a plain read
    real = grads._start_read
    _fail_reads_ahead(grads)
    with pytest.raises(OffloadIOError):  # the range's own read fails where it is asked for
        grads.read(key, 1024, 2048)
    grads._start_read = real
    assert torch.equal(grads.read(key, 1024, 2048, ahead=True), values[1024:2048])  # starts 2048:3072 ahead
    k, s, e, handle, buffer = grads._ahead
    assert (k, s, e) == (key, 2048, 3072)
    handle.wait()  # it lands (no worker left on the buffer); then say it failed
    grads._ahead = (k, s, e, _FailedRead(), buffer)
    if then == "zero":
        grads.zero()
        values = values * 2  # the next window's first landing
        grads.push(grads.io.write(grads.file_of(key), values.clone(), 0), torch.empty(0, device="cpu"))
        grads.flush()
    elif then == "read_other":
        assert torch.equal(grads.read(key, 0, 1024), values[:1024])
    else:
        grads.push(grads.io.write(grads.file_of(key), values[:1024].clone(), 0), torch.empty(0, device="cpu"))
        grads.flush()
    assert grads._ahead is None
    assert torch.equal(grads.read(key, 2048, 3072), values[2048:3072])  # read again, from the file
