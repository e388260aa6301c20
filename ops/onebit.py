"""1-bit compression and the error-compensated compressed all-reduce of 1-bit Adam (arXiv:2102.02888).

[Note: the compressor] C(x) = (‖x‖₂/√n)·sign(x) per block of n = `block_size` elements, with
sign(0) = +1 (as DeepSpeed). Signs travel packed 8 per byte, scales as fp32: for block_size 256 a
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

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Signs of `x` (last dim a multiple of 8) as bits, 8 per byte, most significant first; 1 = x >= 0."""
    bits = (x >= 0).to(torch.uint8).unflatten(-1, (-1, 8))
    return (bits * _BIT_WEIGHTS.to(x.device)).sum(-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """±1 values from `pack_signs` output: the last dim grows 8x."""
    bits = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 1
    return (bits.to(dtype) * 2 - 1).flatten(-2)


def compress_(x: torch.Tensor, error: torch.Tensor, valid: torch.Tensor | None = None,
              mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks `x` (..., n) + `error` → (packed signs, per-block scales); `error` becomes x − C(x).

    Scale ‖x‖₂/√n, n = the block's `valid` (non-padding) elements. `mask` (1 = real element) keeps
    padding out of the error, so a mostly padded block neither shrinks its scale nor feeds back."""
    x.add_(error)
    count = valid if valid is not None else torch.tensor(float(x.shape[-1]))
    scale = torch.linalg.vector_norm(x, dim=-1) / count.sqrt()
    packed = pack_signs(x)
    torch.sub(x, unpack_signs(packed, x.dtype) * scale.unsqueeze(-1), out=error)
    if mask is not None:
        error.mul_(mask)
    return packed, scale


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
        index = torch.arange(self.padded, device=device).view(self.world, per_rank, block_size)
        self.mask = (index < self.numel).float()
        self.valid = self.mask.sum(-1).clamp_min(1.0)  # elements per block that are not padding
        self.server_error = torch.zeros(per_rank, block_size, device=device)

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        """The compressed average over ranks of `flat` (1-D fp32, `numel` long), as a new tensor."""
        x = torch.zeros(self.padded, dtype=torch.float32, device=flat.device)
        x[:self.numel] = flat
        x = x.view(self.world, self.blocks, self.block)
        bits, scales = compress_(x, self.worker_error, self.valid, self.mask)
        got_bits, got_scales = torch.empty_like(bits), torch.empty_like(scales)
        self.comm.all_to_all(got_bits.view(-1), bits.view(-1))
        self.comm.all_to_all(got_scales.view(-1), scales.view(-1))
        # Server: this rank owns chunk `rank`; average what every worker sent for it.
        rank = self.comm.rank
        y = (unpack_signs(got_bits) * got_scales.unsqueeze(-1)).mean(0).mul_(self.mask[rank])
        bits, scales = compress_(y, self.server_error, self.valid[rank], self.mask[rank])
        all_bits = torch.empty(self.world, *bits.shape, dtype=bits.dtype, device=bits.device)
        all_scales = torch.empty(self.world, *scales.shape, dtype=scales.dtype, device=scales.device)
        self.comm.all_gather(all_bits.view(-1), bits.view(-1))
        self.comm.all_gather(all_scales.view(-1), scales.view(-1))
        out = unpack_signs(all_bits) * all_scales.unsqueeze(-1)
        return out.view(-1)[:self.numel]

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
