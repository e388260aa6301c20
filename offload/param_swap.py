"""`NvmeParamStore`: a rank's stage-3 parameter partition in swap files (`offload_param.device: "nvme"`).

It is a partition store (engine/zero/partition_store.py's note: `read`, `write`, `master_updated`,
`open_slots` / `close_slots` / `read_ahead`), so every reader of the fp32 partition reaches the files
through it. One swap file per flat (param group, model dtype) holds the fp32 values the all-gathers
send, at the flat's element offsets.

[Note: where the master lives] With `offload_optimizer.device: "cpu"` (or none) the optimizer steps
the in-memory flat, which then *is* the fp32 master (as in DeepSpeed, whose fp32 master sits with the
CPU optimizer while the 16-bit parameters go to NVMe): `master_in_memory`, reads come from it and
`master_updated()` (after each applied step or load) writes it to the files. With
`offload_optimizer.device: "nvme"` the master is in the optimizer's swap files and the flat's storage
is dropped (`drop_host_master`): reads come from the files, and the optimizer tier writes each updated
sub-group here; a `write` of new master values (a `GatheredParameters` edit, a state-dict load) reaches
the optimizer's files as well as these, or the next step would step from the old master there
(engine/zero/partition_store.py's note: master in the tier). Either way the gathers read the files.
[Note: bounded host memory] Gathers read a group's slots into one of `buffer_count` pool buffers of
`buffer_size` elements, copy them into the all-gather's send buffer and give the buffer back; the
coordinator asks for reads of the next groups of its plan ahead of their gathers (`read_ahead`, while
more than one buffer is free, so an on-demand read always finds one). Up to `max_in_cpu` elements of
slots read once stay resident (a copy kept per group), so a model that fits is read from disk once.
Resident parameter bytes are therefore at most `max_in_cpu * 4` plus the pool; `accounted_bytes()`
keeps the count, `measured_bytes()` sums the storages that exist. A skipped step writes nothing. A
failed step whose image the optimizer tier could not put back leaves every read refused until a load
(`_check_image`: engine/zero/partition_store.py's note, a refused image).
[Note: kept buffers] A buffer given back after a gather keeps the group's slots (the pool's note: kept
contents) until the pool hands it to another read, so a gather of the same group before then reads
nothing: the backward's first groups are the forward's last, and where `buffer_count` buffers hold
every group (DeepSpeed's parameter buffers, which keep what they hold the same way) no gather reads the
files after the first. Every write reaches the kept buffers it covers as it reaches the resident
copies (and the files, as before: kept buffers are not written back), and a buffer that was open
across a write is given back without its bytes. Reads ahead skip groups that are kept.
[Note: write-back] A resident copy is the truth for its elements: a write updates it and goes to the
files only for the elements no resident copy holds, and every read of the files takes the resident
elements from the copies. A resident copy is never evicted and the files are per job (removed at
exit, never read by a restart: checkpoints read through `read`), so the stale bytes under a copy are
never seen. Where the whole partition is resident (DeepSpeed's default `max_in_cpu` of 1e9 elements
holds models up to 1e9 parameters per rank) a step writes no parameter byte: the updated parameters
stay in host memory as DeepSpeed's parameter buffers keep them, without the write-through's
4 bytes per partition element of disk traffic each step.
[Note: 16-bit files] In fp16/bf16 training with the partition built from values of the model dtype
(engine/zero/param_nvme.py decides), the files, the pool and the resident copies hold that dtype: what
the all-gathers send anyway, cast from the master as each step writes it (the same cast the gather of
an in-memory partition makes), so the gathers read and the steps write half the bytes, as DeepSpeed's
16-bit parameter swapper does. The fp32 master is then kept elsewhere, and every reader of fp32 values
(`read`: checkpoints, `safe_get_*`) and writer of them (`write`: a checkpoint load, a
`GatheredParameters` edit) reaches it there: in host memory with the optimizer on the host; in the NVMe
optimizer's own files with the optimizer on NVMe (`drop_host_master(master_source=...)`: its
`read_master` / `write_master`; a step's update comes with `write_behind` and a checkpoint load's with
`write_image`, both of which write only the 16-bit image, since the tier wrote the master itself).
Otherwise the files hold fp32 and are where readers find the master's values: fp32 training, and
`offload_optimizer.fast_init`, whose first step reads its first master from them.
[Note: the master's file] fp32 files with the optimizer on NVMe would hold the optimizer's master byte for
byte, so a step would write every updated element twice (4 bytes per partition element more per step
than the optimizer's own writes). Once the optimizer's files hold the master (`master_owner.holds_master`:
from `initialize` on, or after `fast_init`'s first step), the store reads the committed master there
instead (`start_read_master` / `read_master`: gathers, reads ahead, `read`) and its own files are left
alone: a write reaches only the resident copies (the tier writes the master) and drops the reads issued
ahead, which hold the master before it. A failed step leaves the committed master where the gathers
read it.
[Note: write-behind] The NVMe optimizer tier hands each updated sub-group over with `write_behind`: the
values bound for the files are copied into a staging buffer of the store (the caller's buffer goes back
to the optimizer's pool when the call returns) and the write is started, not waited for, so it overlaps the next
sub-group's step; at most WRITE_BEHIND writes are in flight (the oldest is finished before another
starts, so writes land in the order given), and every other operation, `flush()` (the tier's, at the
end of each step) and `close()` finish them first. The bytes are the synchronous write's. Host memory:
WRITE_BEHIND + 1 staging copies of a sub-group at most.
"""
from __future__ import annotations

import contextlib

import torch

from collections import deque

from offload.aio import AsyncFileIO, OffloadIOError, started, wait_all
from offload.chunk_file import SwappedChunk
from offload.param_slots import KeptBuffers, ResidentSpans, Slots, assembled
from offload.pool import SwapBufferPool
from offload.staging import Staging
from offload.swap_dir import SwapDir

CPU = torch.device("cpu")
WRITE_BEHIND = 1  # write-backs in flight (module note: write-behind)


class NvmeParamStore:
    swapped = True

    def __init__(self, partition, swap: SwapDir, io: AsyncFileIO, pool: SwapBufferPool, max_in_cpu: int,
                 name: str, dtype: torch.dtype = torch.float32):
        self.partition, self.swap, self.io, self.pool = partition, swap, io, pool
        self.max_in_cpu = int(max_in_cpu)
        # what the files, the pool and the resident copies hold (module note: 16-bit files)
        self.dtype, self.itemsize = dtype, torch.empty(0, dtype=dtype).element_size()
        if pool.dtype != dtype:
            raise ValueError(f"the parameter pool holds {pool.dtype}, the files {dtype}")
        self.master_in_memory = True
        self.master_source = None  # the NVMe optimizer tier, where it holds the master and the files 16 bits
        self.master_owner = None  # the NVMe optimizer tier, whose files hold the master (every write reaches it)
        self.files = {key: swap.file(f"{name}.{i}.param.swp") for i, key in enumerate(partition.flat)}
        self._slots: dict[tuple, Slots] = {}
        self._cache: dict[tuple, torch.Tensor] = {}  # group -> its slots, resident (max_in_cpu)
        self._spans = ResidentSpans()  # module note: write-back
        self._cached = 0  # elements in _cache
        self._ahead: dict[tuple, tuple] = {}  # group -> (buffer, handles) of a read issued ahead
        self._open: dict[tuple, tuple] = {}  # group -> (the pool buffer its slots are in, self._writes then)
        self._kept = KeptBuffers(pool)  # module note: kept buffers
        self._writes = 0  # _write_file calls: a buffer open across one is not kept
        self._events: dict[int, object] = {}  # buffer ptr -> event of the device copy still reading it
        self._behind: deque = deque()  # (handles, staging buffer) of writes in flight (module note: write-behind)
        self._staging = Staging()
        self.bytes_read = self.bytes_written = 0
        self.writes_behind = 0  # writes left in flight when their call returned
        self.reads_ahead = 0  # groups read ahead of their gather (the prefetcher's requests that found a buffer)
        self.kept_hits = 0  # gathers served by a pool buffer that still held their slots (no read)
        self.reads_at_gather = 0  # gathers that read their group's slots then (not ahead, not kept)
        self.peak_accounted = self.accounted_bytes()
        swapped_init = getattr(partition, "swapped_init", {})
        if dtype != torch.float32 and any(c.dtype != dtype for cs in swapped_init.values() for _, c in cs):
            # load_host_master reads the master back from the files: 16-bit ones only hold their dtype exactly
            raise ValueError(f"parameter files of {dtype} would round chunks of another dtype")
        for key, flat in partition.flat.items():  # the files start as the partition built in memory
            if key in swapped_init:
                self._copy_chunks(key, swapped_init[key])
            else:
                self._write_staged(key, flat.detach())
        if swapped_init:  # the flat was never written (stage3_params.py's Stage3Partition)
            self.master_in_memory = False
            for chunk_file in {id(c.file): c.file for cs in swapped_init.values() for _, c in cs
                               if isinstance(c, SwappedChunk)}.values():
                chunk_file.close()
            swapped_init.clear()

    # -- the partition-store interface (partition_store.py) ----------------------------------------
    def read(self, key, start: int, stop: int) -> torch.Tensor:
        self._check_image([key])
        if self.master_in_memory:
            return self.partition.flat[key].detach()[start:stop]
        if self.master_source is not None:  # module note: 16-bit files
            return self.master_source.read_master(key, start, stop)
        out = torch.empty(stop - start, dtype=torch.float32, device=CPU)
        parts = self._spans.parts(key, start, stop)
        if sum(b - a for a, b, _ in parts) < stop - start and self._master_file(key):  # module note: the master's file
            out = self.master_owner.read_master(key, start, stop)
            self.bytes_read += out.numel() * 4
        elif sum(b - a for a, b, _ in parts) < stop - start:  # some elements are only in the file
            self.flush()
            # 16-bit files are read here only before load_host_master, when they hold the chunks the
            # master is built from, exactly (module note: 16-bit files)
            raw = out if self.dtype == torch.float32 else torch.empty(stop - start, dtype=self.dtype, device=CPU)
            self.bytes_read += self.io.read(self.files[key], raw, start * self.itemsize).wait()
            if raw is not out:
                out.copy_(raw)
        for a, b, view in parts:  # module note: write-back
            out[a - start:b - start].copy_(view)
        return out

    def write(self, key, start: int, values: torch.Tensor) -> None:
        values = values.detach().reshape(-1)
        if self.master_in_memory:
            dst = self.partition.flat[key].detach()[start:start + values.numel()]
            if dst.data_ptr() != values.data_ptr():
                dst.copy_(values)
        elif self.master_owner is not None and self.master_owner.holds_master(key):
            # the optimizer's files hold the master too (module note: where the master lives)
            self.master_owner.write_master(key, start, values)
        self._write_file(key, start, values)

    def write_image(self, key, start: int, values: torch.Tensor) -> None:
        """Only what the gathers send (the files and the resident copies): the caller writes the master
        itself (the NVMe optimizer tier's checkpoint load)."""
        self._write_file(key, start, values.detach().reshape(-1))

    def write_behind(self, key, start: int, values: torch.Tensor) -> None:
        """`write`, with the file write overlapping what the caller does next (module note: write-behind)."""
        values = values.detach().reshape(-1)
        if self.master_in_memory:  # the optimizer tier on NVMe drops the host master: not met there
            self.write(key, start, values)
            return
        self._write_file(key, start, values, behind=True)

    @property
    def writes_in_flight(self) -> int:
        return len(self._behind)

    def flush(self) -> None:
        """Finish every write in flight (module note: write-behind)."""
        while self._behind:
            self._finish_oldest()

    def slot(self, param) -> torch.Tensor:
        frag = self.partition.fragments[param]
        return self.read(frag.key, frag.offset, frag.offset + frag.padded)

    def master_updated(self) -> None:
        """The optimizer stepped (or a load wrote) the in-memory master: the files follow."""
        if self.master_in_memory:
            for key, flat in self.partition.flat.items():
                self._write_staged(key, flat.detach())

    def load_host_master(self) -> None:
        """The optimizer steps in memory (offload_optimizer "cpu" or none) but the flat was never written
        (zero.Init(remote_device="nvme")): read it from the files; it is the master from now on."""
        if self.master_in_memory:
            return
        self.flush()
        for key, flat in self.partition.flat.items():
            dst = flat.detach()
            if self.dtype == torch.float32:
                self.bytes_read += self.io.read(self.files[key], dst, 0).wait()
            else:  # 16-bit files hold chunks of that dtype exactly (module note): cast up through a pool buffer
                buf = self.pool.acquire()
                try:
                    for s in range(0, dst.numel(), buf.numel()):
                        n = min(buf.numel(), dst.numel() - s)
                        self.bytes_read += self.io.read(self.files[key], buf[:n], s * self.itemsize).wait()
                        dst[s:s + n].copy_(buf[:n])
                finally:
                    self.pool.release(buf)
            for a, b, view in self._spans.parts(key, 0, flat.numel()):  # module note: write-back
                dst[a:b].copy_(view)
        self.master_in_memory = True

    def drop_host_master(self, master_source=None) -> None:
        """The master lives in the NVMe optimizer's files now: free the flats' bytes (module note). 16-bit
        files round it, so fp32 reads and writes then go to `master_source` (`read_master`,
        `write_master`: the optimizer tier); fp32 files hold it exactly."""
        if self.dtype != torch.float32:
            if master_source is None:
                raise RuntimeError("the parameter files hold 16-bit values; the fp32 master cannot leave memory "
                                   "without the optimizer's files to read it from")
            self.master_source = master_source
        self.master_owner = master_source
        self.master_in_memory = False
        for flat in self.partition.flat.values():
            flat.detach().untyped_storage().resize_(0)

    def master_copy(self, key, start: int, stop: int) -> torch.Tensor | None:
        """Flat `key`'s committed master [start, stop) from the resident copies and kept buffers where they
        hold all of it, which with the master in the optimizer's files (module note: the master's file)
        they do bit for bit; else None (the optimizer reads its file: swapped_partition.py's note)."""
        if not self._master_file(key):
            return None
        parts = self._spans.parts(key, start, stop) + [p[:3] for p in self._kept.parts(key, start, stop)]
        return assembled(parts, start, stop)

    def _check_image(self, keys) -> None:
        """Refuse to serve a send image a failed step left half-updated (engine/zero/partition_store.py's
        note: a refused image): the optimizer tier's one error."""
        if self.master_owner is not None and self.master_owner.unrestored:
            self.master_owner.check_image(keys)

    def _master_file(self, key) -> bool:
        """Whether the gathers read flat `key` from the optimizer's master file (module note: the master's file)."""
        return self.dtype == torch.float32 and self.master_owner is not None and self.master_owner.holds_master(key)

    # -- gathers -----------------------------------------------------------------------------------
    def open_slots(self, params: list) -> list[torch.Tensor]:
        group = tuple(params)
        slots = self._layout(group)
        self._check_image([run[0] for run in slots.runs])
        if group in self._cache:
            return slots.views(self._cache[group])
        buf, handles = self._ahead.pop(group, (None, None))
        if buf is None:  # still in the buffer it was last read into? (module note: kept buffers)
            buf = self._kept.claim(slots)
        if buf is not None and handles is None:
            self.kept_hits += 1
            self._open[group] = (buf, self._writes)
            return slots.views(buf)
        self.flush()
        if buf is None:
            buf = self._acquire(slots)
            handles = self._reads_into(slots, buf)
            self.reads_at_gather += 1
        try:  # a failed read: the buffer goes back, once every read into it landed (aio.wait_all)
            self.bytes_read += wait_all(handles)
        except BaseException:
            self._kept.release(buf)
            raise
        if self._cached + slots.numel <= self.max_in_cpu:  # keep it (module note: bounded host memory)
            self._keep(group, slots, buf)
            self._kept.release(buf)
            return slots.views(self._cache[group])
        self._open[group] = (buf, self._writes)
        return slots.views(buf)

    def persistent_slots(self, params: list) -> list[torch.Tensor]:
        """The slots of parameters read after every step outside the gathers (stage 3's persistent
        ones): kept resident like a gathered group's where `max_in_cpu` has room (so the step's write
        of them stays in memory: module note, write-back), else read from the files each time."""
        group = tuple(params)
        slots = self._layout(group)
        self._check_image([run[0] for run in slots.runs])
        if group not in self._cache and self._cached + slots.numel <= self.max_in_cpu:
            self._keep(group, slots, None)
        if group in self._cache:
            return slots.views(self._cache[group])
        return [self.slot(p) for p in params]

    def _keep(self, group: tuple, slots: Slots, buf: torch.Tensor | None) -> None:
        """Make `group`'s slots resident: from `buf` where they were just read into it, else from the files."""
        # Pinned like the pool (a clone of pinned memory is pageable): the gathers copy resident
        # groups to the device for the whole run, asynchronously only from pinned memory.
        resident = torch.empty(slots.numel, dtype=self.dtype, device=CPU, pin_memory=self.pool.pinned)
        if buf is not None:
            resident.copy_(buf[:slots.numel])
        else:
            self.flush()
            self.bytes_read += wait_all(started(self._start_reads(slots, resident)))
        self._cache[group] = resident
        self._cached += slots.numel
        self._spans.add(slots, resident)
        self._note_peak()

    def close_slots(self, params: list) -> None:
        group = tuple(params)
        buf, opened = self._open.pop(group, (None, None))
        if buf is None:
            return
        if buf.is_pinned() and torch.cuda.is_available():  # copy_chunks may still be reading it
            event = torch.Event(device=torch.device("cuda", torch.cuda.current_device()))
            event.record()
            self._events[buf.data_ptr()] = event
        # its bytes are the slots' unless a write came while it was open (module note: kept buffers)
        self._kept.release(buf, self._slots[group] if opened == self._writes else None)

    def read_ahead(self, params: list) -> bool:
        group = tuple(params)
        if group in self._cache or group in self._ahead or group in self._open or self.pool.free_count() <= 1:
            return False
        if self.master_owner is not None and self.master_owner.unrestored:  # its gather is refused anyway
            return False
        slots = self._layout(group)
        kept = self._kept.claim(slots)
        if kept is not None:  # held for its gather, so no read ahead of another group hands it out
            self._ahead[group] = (kept, None)
            return False
        self.flush()
        buf = self._acquire(slots)
        self._ahead[group] = (buf, self._reads_into(slots, buf))
        self.reads_ahead += 1
        return True

    # -- accounting (module note) ------------------------------------------------------------------
    def accounted_bytes(self) -> int:
        return self._cached * self.itemsize + self.pool.nbytes

    def measured_bytes(self) -> int:
        """Bytes of the parameter copies that exist: the resident slots, the pool, and the flats when the
        master is not in memory (0 once dropped)."""
        n = sum(t.untyped_storage().nbytes() for t in self._cache.values()) + self.pool.nbytes
        if not self.master_in_memory:
            n += sum(f.untyped_storage().nbytes() for f in self.partition.flat.values())
        return n

    def resident_bytes(self) -> int:
        return self.measured_bytes()

    def close(self) -> None:
        try:
            self.flush()
            self._drain_ahead()
            self._cache.clear()
            self._spans.clear()
            self._kept.clear()
            self.io.close()
        finally:
            self.swap.close()

    # -- internals ---------------------------------------------------------------------------------
    def _layout(self, group: tuple) -> Slots:
        if group not in self._slots:
            self._slots[group] = Slots(self.partition.fragments, list(group))
        return self._slots[group]

    def _acquire(self, slots: Slots) -> torch.Tensor:
        if slots.numel > self.pool.buffer_size:
            raise ValueError(f"a gather group needs {slots.numel} elements, more than one swap buffer holds "
                             f"({self.pool.buffer_size}); raise zero_optimization.offload_param.buffer_size")
        buf = self.pool.acquire()
        self._device_done(buf)
        return buf

    def _device_done(self, buf: torch.Tensor) -> None:
        """Wait for the device copy that may still be reading pool buffer `buf` (close_slots)."""
        event = self._events.pop(buf.data_ptr(), None)
        if event is not None:
            event.synchronize()

    def _start_reads(self, slots: Slots, buf: torch.Tensor):
        for key, start, stop, at in slots.runs:
            if self._master_file(key):  # module note: the master's file
                yield from self.master_owner.start_read_master(key, buf[at:at + stop - start], start)
            else:
                yield self.io.read(self.files[key], buf[at:at + stop - start], start * self.itemsize)

    def _reads_into(self, slots: Slots, buf: torch.Tensor) -> list:
        """The reads of `slots` into the pool buffer `buf`, started; where starting one fails, `buf` goes
        back to the pool once those started landed (aio.started)."""
        try:
            return started(self._start_reads(slots, buf))
        except BaseException:
            self._kept.release(buf)
            raise

    def drop_reads_ahead(self) -> None:
        """Forget the reads issued ahead, a failed one with its error (a gather's read failed on some rank:
        engine/zero/stage3_read_failures.py's note)."""
        self._drain_ahead()

    def _drain_ahead(self) -> None:
        """Reads issued ahead would hand back values a write is about to replace: finish and drop them. A
        failed one goes with its values (a gather of the group reads the file again), not raised by the
        write, which has nothing to do with it."""
        ahead, self._ahead = self._ahead, {}
        for group, (buf, handles) in ahead.items():
            if handles is None:  # a kept buffer held for its gather: kept again, the write reaches it
                self._kept.release(buf, self._slots[group])
                continue
            with contextlib.suppress(OffloadIOError):
                wait_all(handles)
            self._kept.release(buf)

    def _write_file(self, key, start: int, values: torch.Tensor, behind: bool = False) -> None:
        """Write `values` at `start` of flat `key`: into the resident copies it meets, and into the file
        for the rest (module note: write-back); `behind`: that file write staged and left in flight
        (module note: write-behind), else waited for."""
        if not values.is_contiguous() or values.device != CPU or values.dtype != self.dtype:
            values = values.to(device=CPU, dtype=self.dtype).contiguous()
        self._writes += 1
        stop, gaps, at = start + values.numel(), [], start
        for a, b, view in self._spans.parts(key, start, stop):
            view.copy_(values[a - start:b - start])
            if at < a:
                gaps.append((at, a))
            at = b
        if at < stop:
            gaps.append((at, stop))
        master_file = self._master_file(key)  # the optimizer's files take it (module note: the master's file)
        if master_file or gaps:
            self._drain_ahead()
        self._kept.update(key, start, values, self._device_done)
        if master_file or not gaps:
            return
        if not behind:
            self.flush()  # writes land in the order given
            for a, b in gaps:
                self.bytes_written += self.io.write(self.files[key], values[a - start:b - start],
                                                    a * self.itemsize).wait()
            return
        lo, hi = gaps[0][0], gaps[-1][1]  # staged: only the run of elements bound for the file
        staged = self._staging.empty(hi - lo, lo, self.dtype)  # offload/staging.py's note: why reuse
        staged.copy_(values[lo - start:hi - start])
        while len(self._behind) >= WRITE_BEHIND:
            self._finish_oldest()
        self._behind.append(([self.io.write(self.files[key], staged[a - lo:b - lo], a * self.itemsize)
                              for a, b in gaps], staged))
        self.writes_behind += 1

    def _finish_oldest(self) -> None:
        handles, _ = self._behind.popleft()
        for handle in handles:
            self.bytes_written += handle.wait()

    def _copy_chunks(self, key, chunks: list) -> None:
        """The partition's chunks of flat `key` into its file, one parameter at a time: zero.Init's
        (`SwappedChunk`), or cut from parameters in memory as they are copied (`load()`)."""
        for offset, chunk in chunks:
            values = chunk.load() if hasattr(chunk, "load") else chunk
            self._write_file(key, offset, values)

    def _write_staged(self, key, flat: torch.Tensor) -> None:
        """All of `flat` into its file through a pool buffer. Not from `flat` itself: the I/O engine's byte
        view of a tensor makes its storage unresizable, and `drop_host_master` must free it. A run held
        resident whole goes from `flat` straight into the copies (no file I/O: module note, write-back)."""
        buf = self._acquire(Slots({}, []))
        try:
            for s in range(0, flat.numel(), buf.numel()):
                n = min(buf.numel(), flat.numel() - s)
                if sum(b - a for a, b, _ in self._spans.parts(key, s, s + n)) == n:
                    self._write_file(key, s, flat[s:s + n])
                    continue
                part = buf[:n]
                part.copy_(flat[s:s + n])
                self._write_file(key, s, part)
        finally:
            self._kept.release(buf)

    def _note_peak(self) -> None:
        self.peak_accounted = max(self.peak_accounted, self.accounted_bytes())
