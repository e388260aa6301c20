"""The 1-bit compressor and the error-compensated compressed all-reduce (ops.onebit)."""
from __future__ import annotations

import pytest
import torch

from ops.onebit import CompressedAllReduce, compress_, pack_signs, unpack_signs
from tests.harness import run_distributed

SIZES = (1, 7, 1000, 4099)
CALLS = 40


@pytest.mark.parametrize("shape", [(8,), (3, 64), (2, 5, 256)])
def test_sign_packing_round_trips_8_per_byte(shape):
    x = torch.randn(shape)
    x.view(-1)[0] = 0.0  # sign(0) is +1, as DeepSpeed's compressor
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], shape[-1] // 8)
    assert torch.equal(unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))


def test_compressor_scale_is_rms_and_error_is_the_residual():
    x = torch.randn(4, 256)
    error = torch.zeros_like(x)
    packed, scale = compress_(x.clone(), error)
    torch.testing.assert_close(scale, x.norm(dim=-1) / 16.0)  # ‖x‖/√n, n = 256
    torch.testing.assert_close(unpack_signs(packed) * scale[:, None] + error, x)


def _true_value(rank: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + size)
    return torch.randn(size, generator=g) * torch.logspace(-2, 1, size)  # mixed magnitudes


def _repeated_all_reduce(block_size: int):
    from engine.comm import Communicator
    comm = Communicator()
    world = comm.world_size
    out = {}
    for size in SIZES:
        x = _true_value(comm.rank, size)
        ar = CompressedAllReduce(size, comm, block_size=block_size)
        comm.stats.reset()
        total = torch.zeros(size)
        for _ in range(CALLS):
            total += ar(x.clone())
        per_call = sum(comm.stats.bytes.values()) / CALLS
        mean = sum(_true_value(r, size) for r in range(world)) / world
        out[size] = {"avg": total / CALLS, "mean": mean, "worker_error": ar.worker_error.clone(),
                     "server_error": ar.server_error.clone(), "bytes": per_call, "wire": ar.wire_bytes()}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_all_reduce_converges_to_the_mean_with_bounded_error(world):
    results = run_distributed(_repeated_all_reduce, world, args=(64,), timeout=120)
    for size in SIZES:
        ranks = [r[size] for r in results]
        for r in ranks[1:]:  # every rank decodes the same all-gathered result
            torch.testing.assert_close(r["avg"], ranks[0]["avg"], rtol=0, atol=0)
        avg, mean = ranks[0]["avg"], ranks[0]["mean"]
        # Error feedback telescopes: CALLS·(avg − mean) = −(mean_i e_worker,i + e_server), chunk by chunk.
        worker = sum(r["worker_error"].reshape(-1) for r in ranks) / world
        server = torch.cat([r["server_error"].reshape(-1) for r in ranks])
        residual = -(worker + server)[:size] / CALLS
        torch.testing.assert_close(avg - mean, residual, rtol=1e-3, atol=1e-5)
        # ...and the errors stay bounded: a few times the value's norm after CALLS calls (an error that
        # grew with the calls would be ~CALLS times it).
        bound = max(_true_value(r, size).norm() for r in range(world))
        assert worker.norm() <= 4 * bound and server.norm() <= 4 * bound, (size, worker.norm() / bound)
        assert (avg - mean).norm() <= 8 * bound / CALLS
        assert ranks[0]["bytes"] == ranks[0]["wire"]  # every byte went through the Communicator


class _OneRankComm:
    """A world of one for CompressedAllReduce: the collectives copy (the algorithm runs unchanged)."""

    world_size, rank = 1, 0

    def all_to_all(self, out, inp):
        out.copy_(inp)

    def all_gather(self, out, inp):
        out.copy_(inp)


def test_average_of_tensors_matches_the_flat_call_bit_for_bit():
    # Tensors that start and end inside blocks, span several, sit inside one, are empty or strided.
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 100), (5,), (0,), (40, 30), (1,), (7, 9)]
    factors = [torch.rand(s, generator=g) + 0.5 for s in shapes]
    numel = sum(torch.Size(s).numel() for s in shapes)
    flat_ar, list_ar, scaled_ar = (CompressedAllReduce(numel, _OneRankComm(), block_size=64) for _ in range(3))
    for _ in range(5):
        tensors = [torch.randn(s, generator=g) * 10 ** torch.randint(-3, 3, (), generator=g) for s in shapes]
        tensors[-1] = torch.randn(9, 7, generator=g).T  # not contiguous
        want = flat_ar(torch.cat([t.reshape(-1) for t in tensors])).clone()
        got = [t.clone() for t in tensors]
        list_ar.average_(got)
        assert torch.equal(torch.cat([t.reshape(-1) for t in got]), want)
        product = [t * f for t, f in zip(tensors, factors)]
        scaled = torch.cat([v.reshape(-1) for v in scaled_ar.average(tensors, factors)])
        assert torch.equal(scaled, CompressedAllReduce(numel, _OneRankComm(), block_size=64)(
            torch.cat([p.reshape(-1) for p in product])))  # (fresh: zero errors on both sides)
        scaled_ar.reset()
    assert torch.equal(list_ar.worker_error, flat_ar.worker_error)
    assert torch.equal(list_ar.server_error, flat_ar.server_error)
