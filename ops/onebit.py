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

[Note: CPU cost] On CPU ranks the passes over the buffer, not the wire, bound a compressed step, so
`CompressedAllReduce` keeps every buffer across calls (a fresh 100 MB tensor is page-faulted anew on
each use), computes in place, and uses only ops that run at memory speed: about 14 passes over
`numel` fp32 values per call, ~6 ms each for 25M values on one core (docs/compression.md, "Measured").
"""
from __future__ import annotations

import math

import torch

# [Note: bit tricks] IEEE floats keep the sign in the top bit of their most significant byte, the last
# one in memory on little-endian machines (x86, ARM, GPUs). Packing copies those bytes out (one per
# element, a strided copy), reads 8 of them as one int64 and keeps bit 7 of each byte: element i is bit
# 8i+7. Multiplying by Σ_j 2^(7j) moves it to bit 56+i; the 64 partial products land on distinct bits
# (8i+7j = 8i'+7j' needs |i−i'| = 7 and |j−j'| = 8), so nothing carries and `>> 56` is the packed byte,
# element i in bit i. Unpacking looks each byte up in a 256 × 8 table of ±1 (`index_select`, rows of
# 32 bytes) and multiplies by the block's scale: ±1·s is exactly copysign(s, ±1). Every step is a
# whole-tensor op into a preallocated buffer; `signbit`, `copysign` with an integer operand, `where`
# with a per-block scale and `mean` over ranks were each 2-10x slower on CPU.
_TOP_BIT_OF_EACH_BYTE = 0x8080808080808080 - (1 << 64)  # as a signed int64
_GATHER_TOP_BITS = sum(1 << (7 * j) for j in range(8))
_TABLES: dict = {}


def _sign_table(dtype: torch.dtype, device) -> torch.Tensor:
    """(256, 8): row b holds −1 where bit i of b is set, else +1."""
    key = (dtype, torch.device(device) if device is not None else torch.device("cpu"))
    if key not in _TABLES:
        bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
        _TABLES[key] = (1 - 2 * bits).to(dtype=dtype, device=key[1])
    return _TABLES[key]


def _sign_bytes(x: torch.Tensor) -> torch.Tensor:
    """A strided uint8 view of `x` (contiguous, floating): the byte that holds each element's sign bit."""
    size = x.element_size()
    return x.view(torch.uint8)[..., size - 1::size]


def pack_signs(x: torch.Tensor, out: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Sign bits of `x` (last dim a multiple of 8), 8 per byte, element i of each 8 in bit i; a set bit
    means negative (the IEEE sign bit: +0 counts as positive, as sign(0) = +1 in DeepSpeed).
    `out` (uint8, shape (..., n/8)) and `scratch` (uint8, x.numel() elements) may be given to reuse buffers."""
    x = x.contiguous()
    if x.shape[-1] % 8:
        raise ValueError(f"the last dimension must be a multiple of 8, got {tuple(x.shape)}")
    packed_shape = (*x.shape[:-1], x.shape[-1] // 8)
    if scratch is None:
        scratch = torch.empty(x.numel(), dtype=torch.uint8, device=x.device)
    if out is None:
        out = torch.empty(packed_shape, dtype=torch.uint8, device=x.device)
    tops = scratch[:x.numel()]
    tops.view(x.shape).copy_(_sign_bytes(x))
    words = tops.view(torch.int64)
    words.bitwise_and_(_TOP_BIT_OF_EACH_BYTE).mul_(_GATHER_TOP_BITS).bitwise_right_shift_(56)
    out.view(-1).copy_(words)  # the low byte of each word
    return out


def _signs_into(packed: torch.Tensor, out: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """±1 (out's dtype) from packed signs (..., n/8) into `out` (contiguous, ..., n); `index` (int64,
    packed.numel() elements) may be given to reuse a buffer."""
    if index is None:
        index = torch.empty(packed.numel(), dtype=torch.int64, device=packed.device)
    index = index[:packed.numel()]
    index.view(packed.shape).copy_(packed)
    torch.index_select(_sign_table(out.dtype, out.device), 0, index, out=out.view(-1, 8))
    return out


def decompress(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None,
               index: torch.Tensor | None = None) -> torch.Tensor:
    """C(x) from its packed signs (..., n/8) and per-block scales (...): ±scale, shape (..., n).
    `out` (fp32, contiguous) and `index` (int64, packed.numel() elements) may be given to reuse buffers."""
    if out is None:
        out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 8, dtype=scale.dtype, device=packed.device)
    return _signs_into(packed, out, index).mul_(scale.unsqueeze(-1))


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """±1 values from `pack_signs` output: the last dim grows 8x."""
    return decompress(packed, torch.ones(packed.shape[:-1], dtype=dtype, device=packed.device))


def compress_(x: torch.Tensor, error: torch.Tensor, valid: torch.Tensor | None = None,
              padding_from: int | None = None, *, error_added: bool = False, out: tuple | None = None,
              scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks `x` (..., n) + `error` → (packed signs, per-block scales); `error` becomes x − C(x).

    Scale ‖x‖₂/√n, n = the block's `valid` (non-padding) element count. Flat positions from
    `padding_from` on are padding: kept out of the error, so a mostly padded block neither shrinks its
    scale nor feeds back. `error_added`: x already holds x + error. `out` = (packed, scales) buffers and
    `scratch` (uint8, x.numel()) avoid allocations."""
    if not error_added:
        x.add_(error)
    bits, scale = out if out is not None else (None, None)
    scale = torch.linalg.vector_norm(x, dim=-1, out=scale)
    scale.div_(valid.sqrt() if valid is not None else torch.tensor(float(x.shape[-1])).sqrt())
    torch.copysign(scale.unsqueeze(-1), x, out=error)  # C(x), then x − C(x) in the same buffer
    torch.sub(x, error, out=error)
    if padding_from is not None:
        error.view(-1)[max(padding_from, 0):] = 0.0
    return pack_signs(x, bits, scratch), scale


class CompressedAllReduce:
    """Error-compensated 1-bit average of a flat fp32 tensor of `numel` elements over `comm`.

    `comm` is any object with `world_size`, `all_to_all(out, in)` and `all_gather(out, in)` (dstrain's
    `engine.comm.Communicator` counts the bytes). The worker and server errors persist across calls
    and are part of the owner's checkpoint (`state_dict`). All buffers are allocated once."""

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
        # The input; the decoded average overwrites it (padding is zeroed again: its error is 0).
        self._padded_input = torch.zeros(self.padded, device=device)
        self._server = torch.empty(per_rank, block_size, device=device)  # y, this rank's chunk

        def packed(*lead):
            return (torch.empty(*lead, per_rank, block_size // 8, dtype=torch.uint8, device=device),
                    torch.empty(*lead, per_rank, device=device))
        self._sent, self._got = packed(self.world), packed(self.world)  # all_to_all
        self._mine, self._all = packed(), packed(self.world)  # all_gather
        self._scratch = torch.empty(self.padded, dtype=torch.uint8, device=device)  # sign bytes
        self._index = torch.empty(self.padded // 8, dtype=torch.int64, device=device)  # table rows

    def input_buffer(self) -> torch.Tensor:
        """Where a caller may write the next input in place (saves a copy); pass it to `__call__`."""
        return self._padded_input[:self.numel]

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        """The compressed average over ranks of `flat` (1-D fp32, `numel` long). The result is a view of
        this object's buffer, valid until the next call (copy it to keep it)."""
        x = self._padded_input
        if flat.data_ptr() != x.data_ptr():
            torch.add(flat, self.worker_error.view(-1)[:self.numel], out=x[:self.numel])
        else:
            x[:self.numel].add_(self.worker_error.view(-1)[:self.numel])  # (padding: 0 + 0)
        return self._reduce()

    def average(self, tensors: list[torch.Tensor], factors: list[torch.Tensor] | None = None,
                into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The compressed average of `tensors` (fp32, `numel` elements together, in this order), or of
        tensors[i]·factors[i] when `factors` are given, as views shaped like `tensors` into this
        object's buffer (valid until the next call), or written into `into` (shaped like `tensors`;
        may be `tensors`) and returned. Each input is read once, on its way into the buffer with the
        worker error added."""
        x, error, offset = self._padded_input, self.worker_error.view(-1), 0
        views = []
        for i, t in enumerate(tensors):
            k = t.numel()
            slot, err = x[offset:offset + k].view_as(t), error[offset:offset + k].view_as(t)
            if factors is None:
                torch.add(t, err, out=slot)
            else:
                torch.addcmul(err, t, factors[i], out=slot)
            views.append(slot)
            offset += k
        if offset != self.numel:
            raise ValueError(f"expected {self.numel} elements, got {offset}")
        self._reduce(into)
        return views if into is None else into

    def average_(self, tensors: list[torch.Tensor]) -> None:
        """Replace `tensors` by their compressed average (see `average`), decoded straight into them."""
        self.average(tensors, into=tensors)

    def _reduce(self, into: list[torch.Tensor] | None = None) -> torch.Tensor | None:
        """The two phases on `_padded_input`, which holds x + e_w. Returns the decoded average (a view of
        the buffer), or writes it into the tensors `into` (laid out back to back) and returns None."""
        x = self._padded_input.view(self.world, self.blocks, self.block)
        compress_(x, self.worker_error, self.valid, self.numel, error_added=True, out=self._sent,
                  scratch=self._scratch)
        self.comm.all_to_all(self._got[0].view(-1), self._sent[0].view(-1))
        self.comm.all_to_all(self._got[1].view(-1), self._sent[1].view(-1))
        # Server: this rank owns chunk `rank`; average what every worker sent for it (their signs are
        # decoded into x, which is free now): y = Σ_i ±s_i / world, summed in rank order.
        rank, chunk = self.comm.rank, self.blocks * self.block
        signs, scales = _signs_into(self._got[0], x, self._index), self._got[1].unsqueeze(-1)
        y = torch.mul(signs[0], scales[0], out=self._server)
        for i in range(1, self.world):
            y.addcmul_(signs[i], scales[i])
        if self.world > 1:
            y.div_(self.world)
        y.view(-1)[max(self.numel - rank * chunk, 0):] = 0.0  # padding stays zero
        compress_(y, self.server_error, self.valid[rank], self.numel - rank * chunk,
                  out=self._mine, scratch=self._scratch)
        self.comm.all_gather(self._all[0].view(-1), self._mine[0].view(-1))
        self.comm.all_gather(self._all[1].view(-1), self._mine[1].view(-1))
        flat = _signs_into(self._all[0], x, self._index).view(-1)
        if into is None:
            x.mul_(self._all[1].unsqueeze(-1))
        else:
            self._scale_into(flat, into)
        flat[self.numel:] = 0.0  # the next input's padding
        return flat[:self.numel] if into is None else None

    def _scale_into(self, signs: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """tensors ← signs·(scale of each element's block), for tensors laid out back to back in `signs`:
        whole blocks as one broadcast multiply, the partial blocks at either end by one scale each."""
        b, scales, offset = self.block, self._all[1].view(-1), 0
        for t in tensors:
            end = offset + t.numel()
            out = t.view(-1) if t.is_contiguous() else torch.empty(t.numel(), device=t.device)
            head = min(end, -(-offset // b) * b)  # the first block boundary after offset
            tail = max(head, end // b * b)  # the last one before end
            if head > offset:
                torch.mul(signs[offset:head], scales[offset // b], out=out[:head - offset])
            if tail > head:
                torch.mul(signs[head:tail].view(-1, b), scales[head // b:tail // b].unsqueeze(-1),
                          out=out[head - offset:tail - offset].view(-1, b))
            if end > tail:
                torch.mul(signs[tail:end], scales[tail // b], out=out[tail - offset:])
            if not t.is_contiguous():
                t.copy_(out.view_as(t))
            offset = end

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
