"""1-bit compression and the error-compensated compressed all-reduce of 1-bit Adam (arXiv:2102.02888).

[Note: the compressor] C(x) = (‖x‖₂/√n)·sign(x) per block of n = `block_size` elements, with
sign(+0) = +1 (as DeepSpeed). Signs travel packed 8 per byte, scales as fp32: for block_size 256 a
step moves 1/32 of the fp32 bytes for the signs plus 1/64 of a byte per element for the scales.
A block is the "chunk" that owns one scale; DeepSpeed uses one scale per tensor (worker side) and per
server chunk, which is `block_size` = the whole chunk. Smaller blocks keep the scale of a layer-norm
gain apart from the scale of an embedding when all momenta share one flat buffer.

[Note: two-phase all-reduce] (paper Algorithm 1, DeepSpeed's NcclBackend.compressed_allreduce)
  worker: x += e_w;  send C(x);  e_w = x − C(x)            (all_to_all: rank r gets everyone's chunk r)
  server: y = mean_i C(x_i)[chunk r] + e_s;  send C(y);  e_s = y − C(y)     (all_gather of C(y))
Error feedback makes the errors carry over, so the sum of outputs over T calls differs from the sum of
true means by at most (‖e_w‖ + ‖e_s‖): the running mean converges to the true mean as O(1/T).
Buffers are padded so that every rank's chunk is a whole number of blocks (any size, any world size).
"""
from __future__ import annotations

import math

import torch

# [Note: bit tricks] Packing: 8 bools are 8 bytes of 0/1, i.e. one little-endian int64 with element i
# in bit 8i; multiplying by Σ_k 2^(7k+7) puts element i at bit 56+i with no carry into the top byte,
# so `>> 56` is the packed byte (element i = bit i). Unpacking: multiplying a byte by 0x0101..01
# copies it into all 8 bytes of an int64; masking byte i with 2^i leaves 2^i or 0 there, and adding
# 128 − 2^i (no carry: at most 128) sets byte i's top bit exactly when bit i was set, so the bytes read
# as int8 are negative exactly for the negative elements. `copysign(scale, that)` then decodes ±scale.
# These are whole-tensor int64/float ops at memory speed; `torch.where` with a per-block broadcast
# scale was ~10x slower on CPU. (Little-endian, as x86, ARM and GPUs are.)
_GATHER_BITS = 0x0102040810204080
_REPLICATE_BYTE = 0x0101010101010101
_BIT_I_OF_BYTE_I = 0x8040201008040201 - (1 << 64)  # as a signed int64
_TOP_BIT_IF_SET = sum((128 - (1 << i)) << (8 * i) for i in range(8))  # byte 7 is 0: fits int64


def _pack_bool(bits: torch.Tensor) -> torch.Tensor:
    as_int64 = bits.contiguous().view(torch.uint8).view(torch.int64)
    return ((as_int64 * _GATHER_BITS) >> 56).to(torch.uint8).view(*bits.shape[:-1], bits.shape[-1] // 8)


def _negative_where_set(packed: torch.Tensor) -> torch.Tensor:
    """int8 values, 8 per packed byte, negative exactly where the bit is set."""
    spread = ((packed.to(torch.int64) * _REPLICATE_BYTE) & _BIT_I_OF_BYTE_I) + _TOP_BIT_IF_SET
    return spread.view(torch.int8).view(*packed.shape[:-1], packed.shape[-1] * 8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Sign bits of `x` (last dim a multiple of 8), 8 per byte, element i of each 8 in bit i; a set bit
    means negative (the IEEE sign bit: +0 counts as positive, as sign(0) = +1 in DeepSpeed)."""
    return _pack_bool(torch.signbit(x))


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """±1 values from `pack_signs` output: the last dim grows 8x."""
    negative = _negative_where_set(packed)
    return torch.copysign(torch.ones((), dtype=dtype, device=packed.device).expand(negative.shape), negative)


def decompress(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """C(x) from its packed signs (..., n/8) and per-block scales (...): ±scale, shape (..., n)."""
    negative = _negative_where_set(packed)
    return torch.copysign(scale.unsqueeze(-1).expand(negative.shape), negative)


def compress_(x: torch.Tensor, error: torch.Tensor, valid: torch.Tensor | None = None,
              padding_from: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks `x` (..., n) + `error` → (packed signs, per-block scales); `error` becomes x − C(x).

    Scale ‖x‖₂/√n, n = the block's `valid` (non-padding) element count. Flat positions from
    `padding_from` on are padding: kept out of the error, so a mostly padded block neither shrinks its
    scale nor feeds back."""
    x.add_(error)
    count = valid if valid is not None else torch.tensor(float(x.shape[-1]))
    scale = torch.linalg.vector_norm(x, dim=-1) / count.sqrt()
    torch.sub(x, torch.copysign(scale.unsqueeze(-1).expand(x.shape), x), out=error)
    if padding_from is not None:
        error.view(-1)[max(padding_from, 0):] = 0.0
    return pack_signs(x), scale


class CompressedAllReduce:
    """Error-compensated 1-bit average of a flat fp32 tensor of `numel` elements over `comm`.

    `comm` is any object with `world_size`, `all_to_all(out, in)` and `all_gather(out, in)` (dstrain's
    `engine.comm.Communicator` counts the bytes). The worker and server errors persist across calls
    and are part of the owner's checkpoint (`state_dict`)."""

    def __init__(self, numel: int, comm, block_size: int = 256, device=None):
        if block_size % 8:
            raise ValueError(f"block_size must be a multiple of 8 (signs are packed 8 per byte), got {block_size}")
        self.comm = comm
        self.numel = int(numel)
        self.world = comm.world_size
        self.block = block_size
        per_rank = math.ceil(self.numel / (self.world * block_size)) if self.numel else 1
        self.blocks = per_rank  # blocks in each rank's server chunk
        self.padded = self.world * per_rank * block_size
        self.worker_error = torch.zeros(self.world, per_rank, block_size, device=device)
        starts = torch.arange(self.world * per_rank, device=device).view(self.world, per_rank) * block_size
        self.valid = (self.numel - starts).clamp(1, block_size).float()  # non-padding elements per block
        self.server_error = torch.zeros(per_rank, block_size, device=device)
        self._padded_input = torch.zeros(self.padded, device=device)  # padding stays 0 (its error is 0)

    def input_buffer(self) -> torch.Tensor:
        """Where a caller may write the next input in place (saves a copy); pass it to `__call__`."""
        return self._padded_input[:self.numel]

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        """The compressed average over ranks of `flat` (1-D fp32, `numel` long), as a new tensor."""
        if flat.data_ptr() != self._padded_input.data_ptr():
            self._padded_input[:self.numel] = flat
        x = self._padded_input.view(self.world, self.blocks, self.block)
        bits, scales = compress_(x, self.worker_error, self.valid, self.numel)
        got_bits, got_scales = torch.empty_like(bits), torch.empty_like(scales)
        self.comm.all_to_all(got_bits.view(-1), bits.view(-1))
        self.comm.all_to_all(got_scales.view(-1), scales.view(-1))
        # Server: this rank owns chunk `rank`; average what every worker sent for it.
        rank, chunk = self.comm.rank, self.blocks * self.block
        y = decompress(got_bits, got_scales).mean(0)
        y.view(-1)[max(self.numel - rank * chunk, 0):] = 0.0  # padding stays zero
        bits, scales = compress_(y, self.server_error, self.valid[rank], self.numel - rank * chunk)
        all_bits = torch.empty(self.world, *bits.shape, dtype=bits.dtype, device=bits.device)
        all_scales = torch.empty(self.world, *scales.shape, dtype=scales.dtype, device=scales.device)
        self.comm.all_gather(all_bits.view(-1), bits.view(-1))
        self.comm.all_gather(all_scales.view(-1), scales.view(-1))
        return decompress(all_bits, all_scales).view(-1)[:self.numel]

    def wire_bytes(self) -> int:
        """Bytes this rank hands to the collectives per call (Communicator's accounting)."""
        signs, scales = self.padded // 8, self.world * self.blocks * 4
        return 2 * (signs + scales)

    def reset(self) -> None:
        self.worker_error.zero_()
        self.server_error.zero_()

    def state_dict(self) -> dict:
        return {"world_size": self.world, "numel": self.numel, "block_size": self.block,
                "worker_error": self.worker_error.clone(), "server_error": self.server_error.clone()}

    def load_state_dict(self, state: dict) -> bool:
        """Restore the errors when they were saved for the same layout; returns whether it did."""
        same = (state.get("world_size"), state.get("numel"), state.get("block_size")) == \
            (self.world, self.numel, self.block)
        if same:
            self.worker_error.copy_(state["worker_error"])
            self.server_error.copy_(state["server_error"])
        else:
            self.reset()
        return same
