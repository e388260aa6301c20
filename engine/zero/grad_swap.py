"""The reduced gradient partition in swap files (`offload_optimizer.device: "nvme"`, ZeRO stages 1-3).

[Note: gradient swap] DeepSpeed keeps each rank's fp32 gradient partition in host memory (4 bytes per
partition element), which is what bounds ZeRO-Infinity by host memory once the optimizer state and
the parameters are on NVMe. Here, with the optimizer on NVMe at any stage and the swap chosen (note:
when), the partition gradient has no host bytes at all (`PartitionedParams.flat_grad` holds meta
tensors: shapes only):
- each gradient bucket's reduced segment, as its reduce-scatter finishes, is written to one swap file
  per flat (param group, model dtype) at the flat's element offsets: `SwappedTargets.land`. A later
  micro-step of the same window reads that range back, adds its segment and writes it (read-add-write:
  the same fp32 `a + b` as the in-memory accumulation, so the bytes are equal). Stages 2 and 3 land on
  every micro-step (read-add-write after the first), stage 1 once, at the boundary (a write). At most
  `DEPTH` writes are in flight; each reducing backward ends with every write finished (`flush`).
- at the step, the global norm takes its squares over NORM_CHUNK ranges (partitioned.py's `_global_norm`
  takes them over the same ranges of the in-memory flat, so the norm is bit for bit the same): from the
  landings where it can (note: folded norm), else reading the files,
  and the NVMe stepper reads each sub-group's gradient with its state (nvme_tier.py), unscaled and
  clipped on the way in the same order as the in-memory path (`mul_` by 1/loss scale, then by the
  clip coefficient). A skipped step reads and writes nothing here, and the next window's first
  landing overwrites every slot, as the first reduce-scatter overwrites the in-memory partition.
Host memory for gradients is then the buckets in flight (REDUCE_DEPTH, partitioned.py) plus one
staging copy per landing in flight (a bucket's segment), one NORM_CHUNK or two sub-groups being read,
whatever the model size. Lamb and Muon (nvme_per_tensor.py, nvme_muon.py) read it the same way, one
sub-group at a time (Lamb in its first pass, Muon in its momentum pass and again where a round forms
its update), through the tier's `grad_reader`; a range read twice is the same bits.
[Note: read-ahead] The stepper reads its sub-groups in file order, each the length of the one before
up to the flat's end. So with `offload_optimizer.pipeline_read` (the user's budget for a sub-group
read in flight) each such read also starts the next sub-group's read, and the next call finds it done
or in flight instead of waiting for the disk while the CPU idles: the gradient read of sub-group k+1
overlaps the step of k, as the state's reads do. The elementwise stepper alternates its order
(swapped_partition.py's note: kept sub-groups) and says which ranges it will ask for (`expect`), so a
descending step reads ahead the range below. A call for another range (Lamb's and Muon's passes
read some ranges again) waits the read-ahead out and drops it, and so do a landing, `zero` and
`close` (the file changes), so what a read returns is always what the file holds. The norm's scan
does not read ahead: its squares cost next to nothing against the read, so a second NORM_CHUNK in
flight would buy no overlap and cost 4 MiB of host memory (tests/test_offload_memory.py's bound).
[Note: held gradients] The first reducing backward of a run whose graph has a Python autograd Function
(reentrant checkpointing) holds every full gradient until backward ends (arrivals.py's notes: it finds
parameters whose gradient arrives in pieces), and a deferred
bucket holds its parameters' gradients too: in memory that is the whole model's gradient, 4 bytes
per parameter on every rank, for one backward. With the gradient swapped, `HeldGradients` keeps them
in a file instead (one region per parameter; a second piece is read, added with the same `add_` and
written back), so the first backward is bounded like the others. Stages 2 and 3 only: stage 1 keeps
every full gradient in `.grad` across its accumulation micro-steps by design (stage1.py), so a file
would bound nothing there and cost a write of the model's gradient per micro-step with
`grad_accum_dtype`.
Writes go through a staging buffer placed at the file offset's phase of the O_DIRECT block, so the
aligned middle of every transfer bypasses the page cache (offload/aio.py's note).
[Note: folded norm] A landing has the values it writes in hand, and after a window's last landing of a
range those are the values the norm reads back at the step. So `fold_squares` takes, at every landing,
the square of each NORM_CHUNK range the landing writes whole: the same `mul` by the unscale factor and
the same `vector_norm` over a buffer at the same alignment (a range starts at a multiple of NORM_CHUNK)
as the read-back path, hence the same bits; a later landing of the range replaces it, one that writes
only part of it drops it. The step's `add_squares` takes a range's folded square if the factor it was
taken with is the step's (the loss scale changes only after a step), reads the range back otherwise,
adds them in flat order as before and forgets them all; `zero` forgets them too. With gradient buckets
at least a few NORM_CHUNKs long, most ranges are folded and the norm's read of the partition is gone:
the gradient is then written once and read once per step (plus the read-add-writes of accumulation).
The cost is a `vector_norm` of each landed range at every landing, a few milliseconds per GB.
[Note: when] The swap costs disk traffic: each step writes the partition gradient once and reads it
once for the step, and once more for the norm where it was not folded, 8-12 bytes per partition
element beside the state's 24 (AdamW, read and written). `offload_optimizer.swap_gradients` chooses; unset, the gradient is swapped only when the
parameters are on NVMe too and their partition does not all stay resident (more elements than
`offload_param.max_in_cpu`): that is ZeRO-Infinity where host memory is the limit (the 2.5B run on a
24 GiB machine fits because of it, and the first backward's held gradients would otherwise be 4 bytes
per parameter of host memory). Otherwise it stays in host memory, where DeepSpeed keeps it: with the
optimizer alone on NVMe (the 25M GPT at ZeRO-3, bench_offload.py, 2026-12-06, three rounds: 1789-1874
ms per step in host memory against 2003-2086 swapped and DeepSpeed's 2061-2073), and where `max_in_cpu`
holds the whole parameter partition, whose gradient is the same 4 bytes per element the user allowed
the resident parameters.
"""
from __future__ import annotations

import os
from collections import deque

import torch

from offload.aio import ALIGNMENT, OffloadIOError, aligned_empty
from offload.staging import Staging

from .param_nvme import host_memory_is_the_limit
from .stage0 import clip_coefficient
from .swappable import swap_problem

FP32 = 4
NORM_CHUNK = 1 << 20  # elements per squared-norm term, in memory and from the files alike (a 4 MiB read)
DEPTH = 4  # landings whose writes may be in flight
CPU = torch.device("cpu")


def norm_ranges(numel: int):
    """The [start, stop) ranges the global norm sums squares over (module note)."""
    return [(s, min(s + NORM_CHUNK, numel)) for s in range(0, numel, NORM_CHUNK)] or [(0, 0)]


class SwappedTargets:
    """A gradient bucket's partition-gradient slots, in the swap file: the runs of neighbouring slots
    as (flat key, first element, [(element offset in the run, padded)] per parameter)."""

    device = CPU  # where the reduced segments land before they are written (the host tier)

    def __init__(self, swap: "GradientSwap", fragments: list):
        self.swap = swap
        self.runs: list[tuple] = []
        for i, frag in enumerate(fragments):
            last = self.runs[-1] if self.runs else None
            if last is not None and last[0] == frag.key and last[1] + last[2] == frag.offset:
                last[2] += frag.padded
                last[3].append((i, last[2] - frag.padded, frag.padded))
            else:
                self.runs.append([frag.key, frag.offset, frag.padded, [(i, 0, frag.padded)]])

    def land(self, slots: list[torch.Tensor], accumulate: bool) -> None:
        """Write (or add to) the slots: `slots[i]` is parameter i's reduced, scaled fp32 segment slot."""
        for key, start, numel, members in self.runs:
            buf = self.swap.staging.empty(numel, start)  # offload/staging.py's note: why reuse
            path = self.swap.file_of(key)
            if accumulate:
                self.swap.bytes_read += self.swap.io.read(path, buf, start * FP32).wait()
            for i, at, n in members:
                (buf[at:at + n].add_ if accumulate else buf[at:at + n].copy_)(slots[i])
            self.swap.fold_squares(key, start, buf)
            self.swap.push(self.swap.io.write(path, buf, start * FP32), buf)


class GradientSwap:
    """One rank's partition gradient in swap files (module note)."""

    def __init__(self, partition, swap_dir, io, name: str, read_ahead: bool = False):
        self.partition, self.io = partition, io
        self.staging = Staging()  # the reads' and landings' buffers (offload/staging.py)
        self.numel = {key: flat.numel() for key, flat in partition.flat.items()}
        self.files = {key: swap_dir.file(f"{name}.{i}.grad.swp") for i, key in enumerate(partition.flat)}
        self._pending: deque = deque()
        self.bytes_written = self.bytes_read = 0
        self.unscale, self.clip_coef = 1.0, None  # this step's factors, applied as ranges are read
        self._made = False  # the files are made at the first landing (fast_init writes no file at initialize)
        self.held = None  # HeldGradients, set by attach_grad_swap
        self.read_ahead = read_ahead  # offload_optimizer.pipeline_read, as the stepper has it (module note)
        self._ahead = None  # (key, start, stop, handle, buffer): the read started ahead (module note)
        self.reads_ahead_used = 0  # read-aheads a later call took (tests count them)
        self._plan: dict[tuple, tuple | None] = {}  # (key, start, stop) -> the range asked for next (`expect`)
        # (flat key, norm range start) -> (unscale factor, |range|^2) of a range a landing wrote whole (note:
        # folded norm); `unscale_now` gives the factor the step will apply (set by attach_grad_swap)
        self._folded: dict[tuple, tuple[float, torch.Tensor]] = {}
        self.unscale_now = lambda: 1.0
        self.norm_ranges_folded = 0  # norm ranges the step took from landings, not from a read (tests count them)

    def targets(self, fragments: list) -> SwappedTargets:
        return SwappedTargets(self, fragments)

    def file_of(self, key) -> str:
        if not self._made:
            self.zero()
        return self.files[key]

    def push(self, handle, buffer: torch.Tensor) -> None:
        self._drop_ahead()  # the file changes under it
        self._pending.append((handle, buffer))  # the buffer lives until its write finished
        while len(self._pending) > DEPTH:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        handle, _ = self._pending.popleft()
        self.bytes_written += handle.wait()

    def flush(self) -> None:
        while self._pending:
            self._finish_oldest()

    def zero(self) -> None:
        """Every element 0 (a step with no reducing backward; the start): the files become holes."""
        self._folded.clear()
        self._drop_ahead()
        self.flush()
        self._made = True
        for key, path in self.files.items():
            self.io.forget(path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # private, as the I/O engine makes its files
            try:
                os.ftruncate(fd, 0)
                os.ftruncate(fd, self.numel[key] * FP32)
            finally:
                os.close(fd)

    def expect(self, key, ranges: list[tuple[int, int]]) -> None:
        """The stepper will ask for flat `key`'s `ranges` in this order: each read ahead reads the next
        (module note: read-ahead)."""
        self._plan = {k: v for k, v in self._plan.items() if k[0] != key}
        for (s, e), nxt in zip(ranges, [*ranges[1:], None]):  # the last: nothing after it
            self._plan[(key, s, e)] = nxt

    def read(self, key, start: int, stop: int, ahead: bool = False) -> torch.Tensor:
        """Elements [start, stop) of flat `key`'s gradient, in a new host tensor. `ahead`: the range `expect`
        named next, or else (a scan in file order) the next range of the same length, starts reading now
        (module note: read-ahead)."""
        self.flush()
        if self._ahead is not None and self._ahead[:3] == (key, start, stop):
            handle, out = self._ahead[3:]
            self._ahead = None
            self.reads_ahead_used += 1
        else:
            self._drop_ahead()
            handle, out = self._start_read(key, start, stop)
        self.bytes_read += handle.wait()
        if (key, start, stop) in self._plan:
            planned = self._plan.pop((key, start, stop))
            if ahead and planned is not None:
                self._ahead = (key, *planned, *self._start_read(key, *planned))
        elif ahead and stop < self.numel[key]:
            nxt = min(stop + (stop - start), self.numel[key])
            self._ahead = (key, stop, nxt, *self._start_read(key, stop, nxt))
        return out

    def _start_read(self, key, start: int, stop: int) -> tuple:
        """(handle, buffer) of a read of [start, stop) into a buffer at the offset's block phase."""
        out = self.staging.empty(stop - start, start)
        return self.io.read(self.file_of(key), out, start * FP32), out

    def _drop_ahead(self) -> None:
        """Waits out a read ahead no call will take (its buffer is free once no worker fills it) and drops
        its values and its error with it: a landing, `zero` or another range's read is not the place to
        raise a read they never asked for; the range's own read, if it comes, meets the file as it is."""
        if self._ahead is not None:
            handle = self._ahead[3]
            self._ahead = None
            try:
                self.bytes_read += handle.wait()
            except OffloadIOError:
                pass

    def slot(self, frag, unscaled: bool = False) -> torch.Tensor:
        """`frag`'s padded slot as reduced (`unscaled`: divided by the loss scale, as the norm sees it)."""
        out = self.read(frag.key, frag.offset, frag.offset + frag.padded)
        return self._unscale(out) if unscaled else out

    # -- the step (module note) -------------------------------------------------------------------
    def _unscale(self, grad: torch.Tensor) -> torch.Tensor:
        if self.unscale != 1.0:  # the in-memory path's `b.mul_(inv_scale)` over the flat
            grad.mul_(self.unscale)
        return grad

    def fold_squares(self, key, start: int, values: torch.Tensor) -> None:
        """A landing wrote `values` at [start, start + numel) of flat `key`: the square of every norm range it
        covers whole, taken now from the values in hand (note: folded norm); a range it covers in part no
        longer matches what was folded for it."""
        stop, factor, numel = start + values.numel(), self.unscale_now(), self.numel[key]
        for s in range(start // NORM_CHUNK * NORM_CHUNK, stop, NORM_CHUNK):  # the ranges [start, stop) meets
            e = min(s + NORM_CHUNK, numel)
            if start <= s and e <= stop:
                grad = values[s - start:e - start]
                grad = grad.mul(factor) if factor != 1.0 else grad  # a copy: `values` is what gets written
                self._folded[(key, s)] = (factor, torch.linalg.vector_norm(grad, dtype=torch.float32).square())
            else:
                self._folded.pop((key, s), None)

    def add_squares(self, sq: torch.Tensor) -> None:
        """`sq += |range|^2` for every NORM_CHUNK range of every flat, in flat order (as _global_norm does
        over the in-memory flats): folded at its landing where that is this step's (note: folded norm),
        else read back. Each step takes the folded squares once."""
        for key, numel in self.numel.items():
            for s, e in norm_ranges(numel) if numel else ():
                folded = self._folded.get((key, s))
                if folded is not None and folded[0] == self.unscale:
                    term = folded[1]
                    self.norm_ranges_folded += 1
                else:
                    grad = self._unscale(self.read(key, s, e))  # no read-ahead: the module note says why
                    term = torch.linalg.vector_norm(grad, dtype=torch.float32).square()
                sq += term.to(sq.device)
        self._folded.clear()

    def clip_to(self, norm: float, max_norm: float) -> None:
        self.clip_coef = clip_coefficient(norm, max_norm) if max_norm > 0 else None

    def step_slice(self, key, start: int, stop: int) -> torch.Tensor:
        """The gradient the stepper uses for [start, stop): unscaled, then clipped (stage0.clip_'s rule)."""
        grad = self._unscale(self.read(key, start, stop, ahead=self.read_ahead))
        if self.clip_coef is not None:
            grad.mul_(self.clip_coef)
        return grad

    def close(self) -> None:
        try:
            self._drop_ahead()
            self.flush()
        finally:
            if self.held is not None:
                self.held.close()
            for path in self.files.values():
                self.io.delete(path)


class HeldGradients:
    """Full gradients held aside during a backward (module note: held gradients), in a swap file: the
    mapping `PartitionedZeroOptimizer._accum` uses (`in`, `get`, `[]=`, `pop`, `values`, `clear`)."""

    def __init__(self, params: list, swap_dir, io, name: str):
        self.io, self.path = io, swap_dir.file(f"{name}.held.swp")
        self.bytes_written = self.bytes_read = 0
        self.offsets, at = {}, 0
        for p in params:  # a region per parameter (its full shape: stage 3's are placeholders), block-aligned
            self.offsets[p] = at
            numel = torch.Size(getattr(p, "ds_shape", p.shape)).numel()
            at += -(-numel * max(4, p.element_size()) // ALIGNMENT) * ALIGNMENT
        self._held: dict = {}  # param -> (dtype, shape) of what its region holds
        self.files_made = 0  # times the file was (re)created: a test's check that it goes when empty

    def __contains__(self, param) -> bool:
        return param in self._held

    def __setitem__(self, param, grad: torch.Tensor) -> None:
        staged = aligned_empty(grad.numel(), grad.dtype)
        staged.copy_(grad.reshape(-1))
        self.files_made += not self._held
        self.bytes_written += self.io.write(self.path, staged, self.offsets[param]).wait()
        self._held[param] = (grad.dtype, grad.shape)

    def get(self, param, default=None):
        if param not in self._held:
            return default
        dtype, shape = self._held[param]
        out = aligned_empty(shape.numel(), dtype)
        self.bytes_read += self.io.read(self.path, out, self.offsets[param]).wait()
        return out.view(shape)

    def pop(self, param, default=None):
        out = self.get(param, default)
        if self._held.pop(param, None) is not None and not self._held:
            self._drop_file()
        return out

    def values(self) -> list:
        return []  # no host bytes held

    def clear(self) -> None:
        if self._held:
            self._held.clear()
            self._drop_file()

    def _drop_file(self) -> None:
        """Nothing held: give the file's blocks back. The first backward holds the whole model's
        gradient here (4 bytes per parameter on every rank); kept, that is disk the optimizer's swap
        files may need for the rest of the run (a 2.5B model on a 72 GB disk: README, ZeRO-Infinity)."""
        self.io.delete(self.path)

    def close(self) -> None:
        self.io.delete(self.path)


def swaps_gradients(zero, optimizer, param_partition_numel: int = 0) -> bool:
    """Whether the gradient partition lives in swap files (module note): the optimizer on NVMe, one the
    NVMe tier steps (any other is refused there, by name), and `offload_optimizer.swap_gradients` true,
    or unset with the parameters on NVMe too and more partition elements (`param_partition_numel`, the
    slots the parameter store would keep resident) than `offload_param.max_in_cpu` (note: when)."""
    section = zero.offload_optimizer
    if section is None or section.device != "nvme" or swap_problem(optimizer) is not None:
        return False
    if section.swap_gradients is not None:
        return section.swap_gradients
    return host_memory_is_the_limit(zero, param_partition_numel)


def attach_grad_swap(zopt) -> None:
    """After the NVMe optimizer tier is built: the gradient files beside its swap files, and every
    gradient bucket's targets in them."""
    if not zopt.partition.grads_swapped:
        return
    read_ahead = any(part.pipeline_read for part in zopt.nvme.parts.values())  # the pool has room for it
    swap = GradientSwap(zopt.partition, zopt.nvme.swap, zopt.nvme.io, f"rank{zopt.comm.rank}", read_ahead)
    swap.unscale_now = lambda: 1.0 / zopt.guard.scaler.loss_scale  # the step's `inv_scale`, the same float
    zopt.grad_swap = zopt.nvme.grad_swap = swap
    if zopt.reduce_every_micro_step:  # stages 2 and 3 (module note: held gradients)
        zopt._accum = swap.held = HeldGradients(zopt.params, zopt.nvme.swap, zopt.nvme.io, name=f"rank{zopt.comm.rank}")
    fragments = zopt.partition.fragments
    for bucket in zopt.buckets:
        bucket.targets = swap.targets([fragments[p] for p in bucket.layout.params])
