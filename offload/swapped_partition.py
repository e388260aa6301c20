"""`SwappedPartition`: an optimizer step over a flat fp32 partition whose master weights and optimizer
state live in swap files, one sub-group of `sub_group_size` elements at a time (ZeRO-Infinity).

The step loop is "for each sub-group: wait for its read, start the next read, step, start its write":
with `pipeline_read` the read of sub-group k+1 runs while k is stepped, with `pipeline_write` the write
of k-1 runs meanwhile too; without them each transfer finishes before the loop goes on. All bytes pass
through a `SwapBufferPool`, so the host memory held for optimizer state is the pool, whatever `numel`.

[Note: any elementwise optimizer] The optimizer is a plain `torch.optim` optimizer over one placeholder
parameter. For each sub-group the placeholder's `.data` and `.grad` become the sub-group's master and
gradient slices, and its `state` entries become views of the pool buffers the state was read into,
so fused CPU AdamW (or SGD, Adagrad, ...) updates them in place. Which state tensors are elementwise
(swapped) and which are per-step scalars (`step`, kept in memory per sub-group) is the optimizer
class's declaration (ops/state_layout.py); which of the declared keys exist is learnt once, by
stepping a throw-away copy of the optimizer on a tiny parameter (never by comparing shapes). The first real step lets the
optimizer create its state as it always does; from then on the state comes from the files.

[Note: two slots] Every file exists twice; a step reads slot s and writes slot 1-s, and flips only
when every sub-group's write has finished. A step that fails halfway (disk full, a bad gradient slice)
leaves slot s, the state the previous step produced, bit for bit as it was; a skipped step (overflow)
is simply not taken. Disk use is twice the state, I/O per step is the same as one slot. A failed
transfer's sub-group gives its buffers back only once its other transfers have landed (`wait_all`).
With `slots=1` (`offload_optimizer.swap_slots: 1`, for a disk that cannot hold the state twice) both
logical slots name the same file, so a step writes in place, as DeepSpeed's swapper does: half the disk,
the same bytes read and written, the same results (every pass reads a sub-group's range before it
writes it, and a later pass of the same step reads what an earlier one wrote from the slot it was
written to). What a failed step leaves is then partly overwritten; the partition remembers which keys
were written since the last commit, and any later read of one of them as committed state (the next
step, a checkpoint) is refused with an error saying so, instead of stepping from mixed state.

[Note: deferred initialisation] `initialize(..., deferred=True)` (`offload_optimizer.fast_init`) writes
nothing: until the first step (or a load) the master is read from `read_master_slice` (the caller's
host copy, which must not change before then except through `on_updated`) wherever it would be read
from the file. The first step then writes the master for the first time, with its update; the files
hold the same bytes as with an initial write, one full write of the master sooner.

[Note: kept sub-groups] `step` visits the sub-groups in alternating order (0..K-1, then K-1..0, ...), and
the buffers of the sub-groups it wrote last go back to the pool tagged with what they hold (pool.py's
note: kept contents): once the step is committed, they are the committed state of those sub-groups,
byte for byte what their files hold. The next step starts with exactly those sub-groups and takes their
buffers back instead of reading them (as many as the pool still has untouched: with `buffer_count`
buffers up to `buffer_count // (1 + state keys)` sub-groups, 4 of AdamW's with 12). Writes are not
deferred: every file is complete when a step returns, so checkpoints, `read_master`, snapshots, a failed
or skipped step and exit see what they saw before, and only reads are saved. Anything else that makes
the files current (a load, `write_master`, `initialize`, the two-pass steppers' commits) drops the tags.
The order changes no bit: each sub-group's update depends on its own elements alone.

[Note: master copy] Where the caller keeps an exact copy of the committed master (the engine's host
flats under a TierMasterStore: engine/zero/partition_store.py's note, master in the tier), `step`
copies each sub-group's master from there instead of reading its file: a third of the step's reads
(AdamW) become a memcpy. Only `step` does, one pass that reads each sub-group before `on_updated`
changes the copy there; the files are written as before and stay the master of record. The copy may
answer None for a sub-group it does not hold whole (the NVMe parameter store's resident copies and
kept buffers: offload/param_swap.py's note, the master's file): that one's file is read.
"""
from __future__ import annotations

import warnings
from collections import deque
from typing import Callable, Optional, Sequence

import torch

from offload.aio import AsyncFileIO, IOHandle, OffloadIOError, OffloadIOWarning, round_up, started, wait_all
from offload.file_snapshot import FrozenState, snapshot_files, write_file
from offload.partition_stream import PartitionStream, copy_value
from offload.pool import SwapBufferPool
from offload.swap_dir import SwapDir
from offload.swapped_master import MASTER, MasterFile
from ops.state_layout import ELEMENTWISE, PER_TENSOR, SCALAR, StateLayoutError, probe_state

SUB_GROUP_KEY = "zero_optimization.sub_group_size"
COUNT_KEY = "zero_optimization.offload_optimizer.buffer_count"
SLOTS_KEY = "zero_optimization.offload_optimizer.swap_slots"


def sub_group_buffer_elements(numel: int, sub_group_size: int) -> int:
    """Elements one pool buffer needs for this partition: a sub-group, rounded up to the O_DIRECT block."""
    return round_up(min(max(numel, 1), sub_group_size) * 4) // 4


def learn_state_layout(make_optimizer: Callable[[list], torch.optim.Optimizer]) -> tuple[list[str], list[str]]:
    """(per-element state keys, scalar state keys) of the optimizer `make_optimizer` builds: the keys
    its first step creates, each of the kind its class declares (ops/state_layout.py `probe_state`)."""
    optimizer, probe, kinds = probe_state(make_optimizer)
    whole = sorted(k for k, kind in kinds.items() if kind == PER_TENSOR)
    if whole:
        raise StateLayoutError(f"optimizer {type(optimizer).__name__}'s state {whole} is per tensor; swap files "
                               "hold per-element and scalar state only")
    elementwise = sorted(k for k, kind in kinds.items() if kind == ELEMENTWISE)
    for key in elementwise:
        if optimizer.state[probe][key].dtype != torch.float32:
            raise OffloadIOError(f"optimizer state {key!r} is {optimizer.state[probe][key].dtype}; NVMe offload "
                                 "swaps fp32 state only")
    return elementwise, sorted(k for k, kind in kinds.items() if kind == SCALAR)


class SwappedPartition(MasterFile, PartitionStream):
    """See the module docstring and offload/__init__.py for the interface the engine calls."""

    def __init__(self, numel: int, make_optimizer: Callable[[list], torch.optim.Optimizer], swap_dir: SwapDir,
                 aio: AsyncFileIO, pool: SwapBufferPool, sub_group_size: int, pipeline_read: bool = False,
                 pipeline_write: bool = False, name: str = "partition", slots: int = 2):
        if sub_group_size < 1:
            raise ValueError(f"{SUB_GROUP_KEY} must be at least 1 element (got {sub_group_size})")
        self.numel, self.aio, self.pool, self.name = int(numel), aio, pool, name
        self.sub_group_size = int(sub_group_size)
        self.groups = [(s, min(s + sub_group_size, self.numel)) for s in range(0, self.numel, sub_group_size)]
        self.buffer_elements = sub_group_buffer_elements(self.numel, sub_group_size)
        self.stride_bytes = self.buffer_elements * 4
        if pool.dtype != torch.float32 or pool.buffer_size < self.buffer_elements:
            raise ValueError(f"swap pool buffers hold {pool.buffer_size} {pool.dtype} elements; a sub-group "
                             f"needs {self.buffer_elements} float32 (lower {SUB_GROUP_KEY} or enlarge the pool)")
        self.state_keys, self.scalar_keys = learn_state_layout(make_optimizer)
        self.per_group = 1 + len(self.state_keys)
        if pool.buffer_count < self.per_group:
            raise ValueError(f"{COUNT_KEY} is {pool.buffer_count}; this optimizer swaps {self.per_group} "
                             f"tensors per sub-group (master + {', '.join(self.state_keys) or 'no state'}); "
                             f"set it to at least {self.per_group}")
        if slots not in (1, 2):
            raise ValueError(f"{SLOTS_KEY} is {slots}; use 2 (a failed step keeps the previous state) or 1 "
                             "(in place: half the disk)")
        self.slots = slots
        self.pipeline_read, self.pipeline_write = self._fit_pipeline(pipeline_read, pipeline_write)
        self._param = torch.nn.Parameter(torch.zeros(0, dtype=torch.float32, device="cpu"))
        self.optimizer = make_optimizer([self._param])
        self._files = {(key, slot): swap_dir.file(f"{name}.{key}.{slot}.swp")
                       for key in [MASTER, *self.state_keys] for slot in range(slots)}
        self._slot = 0
        self._generation = 0  # commits and in-place master writes so far (`mark`, `revert`)
        # slots=1: key -> [lo, hi), the span of the elements written in place since the last commit (module
        # note); the elements outside it are still committed
        self._overwritten: dict[str, tuple[int, int]] = {}
        self._has_state = False  # false until the first step (or a load) wrote optimizer state
        self._initial: Optional[Callable[[int, int], torch.Tensor]] = None  # deferred master (module note)
        self._scalars: list[dict] = [{} for _ in self.groups]
        self.sub_groups_kept = 0  # sub-groups a step took from the pool instead of reading (tests count them)
        self.masters_copied = 0  # sub-groups whose master a step took from the caller's copy (note: master copy)
        self._writes: deque[tuple[list[IOHandle], list[torch.Tensor], list]] = deque()
        self._descending = False  # the next step's order (module note: kept sub-groups)
        self._kept: Optional[object] = None  # the token of the buffers that hold committed sub-groups
        self._master_copy: Optional[Callable[[int, int], torch.Tensor]] = None  # during `step` (note: master copy)

    @property
    def paths(self) -> list[str]:
        """Its swap files: one per swapped key and slot."""
        return list(self._files.values())

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's param groups: set `lr` etc. here (LR schedules)."""
        return self.optimizer.param_groups

    def _fit_pipeline(self, pipeline_read: bool, pipeline_write: bool) -> tuple[bool, bool]:
        """Pipelining needs a sub-group's buffers per stage in flight; fewer buffers mean less overlap."""
        fits = self.pool.buffer_count // self.per_group
        wanted = 1 + bool(pipeline_read) + bool(pipeline_write)
        if fits >= wanted:
            return bool(pipeline_read), bool(pipeline_write)
        warnings.warn(f"{COUNT_KEY} is {self.pool.buffer_count}: room for {fits} sub-group(s) of {self.per_group} "
                      f"buffers, pipelining wants {wanted}; set it to {wanted * self.per_group} for full overlap",
                      OffloadIOWarning, stacklevel=3)
        read = bool(pipeline_read) and fits >= 2
        return read, bool(pipeline_write) and fits >= 2 + read

    # -- buffers and transfers -----------------------------------------------------------------
    def _acquire(self, count: int) -> list[torch.Tensor]:
        while self.pool.free_count() < count and self._writes:
            self._finish_oldest_write()
        return [self.pool.acquire() for _ in range(count)]

    def _release(self, buffers: list[torch.Tensor]) -> None:
        for buf in buffers:
            self.pool.release(buf)

    def _finish_oldest_write(self) -> None:
        handles, buffers, tags = self._writes.popleft()
        try:
            wait_all(handles)
        finally:
            for buf, tag in zip(buffers, tags):
                self.pool.release(buf, tag)

    def _finish_writes(self) -> None:
        while self._writes:
            self._finish_oldest_write()

    def _keys(self, with_state: bool) -> list[str]:
        return [MASTER, *self.state_keys] if with_state else [MASTER]

    def _transfer(self, k: int, files: list[tuple[str, int]], buffers, write: bool) -> list[IOHandle]:
        # Sub-group k's elements rounded up to the O_DIRECT block, not the whole pool buffer: the last
        # sub-group of a flat is shorter, and the buffer's tail past it is bytes nothing reads (they cost
        # a read and a write of up to a sub-group per tensor each step)
        op = self.aio.write if write else self.aio.read
        n = round_up((self.groups[k][1] - self.groups[k][0]) * 4) // 4
        return started(op(self._file(key, slot), buf[:n], k * self.stride_bytes)
                       for (key, slot), buf in zip(files, buffers))

    def _file(self, key: str, slot: int) -> str:
        """The swap file of `key` in logical slot `slot` (one file for both with slots=1: module note)."""
        return self._files[key, slot % self.slots]

    def _check_committed(self, read: dict, start: int = 0, stop: Optional[int] = None) -> None:
        """Refuse to read, as the committed state of elements [start, stop), a key a failed step (or a
        pass in progress: a load reads each sub-group's master before writing it) overwrote in place
        there (slots=1)."""
        stop = self.numel if stop is None else stop
        stale = sorted(key for key, slot in read.items() if slot == self._slot and key in self._overwritten
                       and self._overwritten[key][0] < stop and start < self._overwritten[key][1])
        if stale:
            named = MASTER if MASTER in stale else stale[0]
            raise OffloadIOError(f"{self._file(named, self._slot)}: the optimizer state {stale} was partly "
                                 "overwritten in place by a step that did not finish; load a checkpoint to go "
                                 f"on (with {SLOTS_KEY}: 2 a failed step leaves the previous state)")

    def _start_read(self, k: int, keys: list[str], read: dict[str, int]):
        """Buffers for `keys` of sub-group k; those in `read` (key -> slot) are read into theirs, or taken
        back from the pool where the last step left them there (module note: kept sub-groups)."""
        if self._kept is not None and all(slot == self._slot for slot in read.values()):
            kept = self.pool.claim([(self, k, key, self._kept) for key in keys])
            if kept is not None:
                self.sub_groups_kept += 1
                return kept, []
        buffers = self._acquire(len(keys))
        try:
            pairs = [((key, read[key]), buf) for key, buf in zip(keys, buffers) if key in read]
            # the current master never written (module note: deferred), or a host copy of it (note: master copy)
            source = self._initial if self._initial is not None else self._master_copy
            master = [buf for (key, slot), buf in pairs if key == MASTER and slot == self._slot]
            values = source(*self.groups[k]) if source is not None and master else None
            if values is not None:
                master[0][:values.numel()].copy_(values)
                self.masters_copied += 1
                pairs = [((key, slot), buf) for (key, slot), buf in pairs if not (key == MASTER and slot == self._slot)]
            return buffers, self._transfer(k, [f for f, _ in pairs], [b for _, b in pairs], write=False)
        except BaseException:
            self._release(buffers)
            raise

    def _start_write(self, k: int, keys: list[str], buffers, write: Sequence[str], token: object = None) -> None:
        """Write the buffers of `write` (a subset of `keys`) to the target slot; all of `buffers` go back
        to the pool once the writes finished (with `token`, tagged: module note, kept sub-groups)."""
        try:
            pairs = [((key, 1 - self._slot), buf) for key, buf in zip(keys, buffers) if key in write]
            if self.slots == 1:
                s, e = self.groups[k]
                for (key, _), _ in pairs:
                    lo, hi = self._overwritten.get(key, (s, e))
                    self._overwritten[key] = (min(lo, s), max(hi, e))
            handles = self._transfer(k, [f for f, _ in pairs], [b for _, b in pairs], write=True)
        except BaseException:
            self._release(buffers)
            raise
        whole = token is not None and set(write) == set(keys)  # every buffer then holds what its file will
        self._writes.append((handles, buffers, [(self, k, key, token) if whole else None for key in keys]))
        if not self.pipeline_write:
            self._finish_writes()

    def _abandon(self, reads: dict) -> None:
        """After an error: let in-flight transfers land before their buffers go back to the pool."""
        for buffers, handles in reads.values():
            for handle in handles:
                try:
                    handle.wait()
                except OffloadIOError:
                    pass
            self._release(buffers)
        while self._writes:
            try:
                self._finish_oldest_write()
            except OffloadIOError:
                pass

    # -- the interface -------------------------------------------------------------------------
    def initialize(self, read_master_slice: Callable[[int, int], torch.Tensor], deferred: bool = False) -> None:
        """Write the initial fp32 master weights, sub-group by sub-group (with `deferred`, not yet:
        module note); the optimizer state starts empty (the first step creates it, as the optimizer
        would in memory)."""
        if deferred:
            self._initial, self._has_state, self._scalars = read_master_slice, False, [{} for _ in self.groups]
            return
        try:
            for k, (s, e) in enumerate(self.groups):
                buffers = self._acquire(1)
                try:
                    buffers[0][:e - s].copy_(read_master_slice(s, e))
                except BaseException:
                    self._release(buffers)
                    raise
                self._start_write(k, [MASTER], buffers, write=[MASTER])
            self._finish_writes()
        except BaseException:
            self._abandon({})
            raise
        self.commit([{} for _ in self.groups], has_state=False)

    @property
    def has_state(self) -> bool:
        """Whether the files hold optimizer state (false until the first step or a load)."""
        return self._has_state

    @property
    def source_slot(self) -> int:
        """The slot the last committed step wrote: what a step reads."""
        return self._slot

    def scalars(self, k: int) -> dict:
        """Sub-group k's per-step scalars (copies)."""
        return {key: copy_value(value) for key, value in self._scalars[k].items()}

    def sweep(self, visit: Callable[[int, dict], None], read: dict[str, int], write: Sequence[str],
              groups: Optional[Sequence[int]] = None, token: object = None) -> None:
        """One pass over every sub-group (or those in `groups`, in that order), without committing (a step
        may take several passes: engine/zero/nvme_per_tensor.py). For sub-group k, `visit(k, views)` gets
        {key: n-element view} for every key in `read` (key -> slot to read it from) or `write`; a key
        only written starts as zeros. The `write` keys then go to the slot `commit` makes current; until
        then the current slot is as the last commit left it (the two-slots note). `token`: the written
        buffers go back to the pool tagged with it (module note: kept sub-groups)."""
        self._check_committed(read)
        keys = [key for key in [MASTER, *self.state_keys] if key in read or key in write]
        order = list(range(len(self.groups)) if groups is None else groups)
        reads: dict = {}
        try:
            for i, k in enumerate(order):
                s, e = self.groups[k]
                if k not in reads:
                    reads[k] = self._start_read(k, keys, read)
                buffers, handles = reads.pop(k)
                try:
                    wait_all(handles)
                    if self.pipeline_read and i + 1 < len(order):
                        reads[order[i + 1]] = self._start_read(order[i + 1], keys, read)
                    views = {key: buf[:e - s] for key, buf in zip(keys, buffers)}
                    for key in keys:
                        if key not in read:
                            views[key].zero_()
                    visit(k, views)
                except BaseException:
                    self._release(buffers)
                    raise
                self._start_write(k, keys, buffers, write, token)
            self._finish_writes()
        except BaseException:
            self._abandon(reads)
            raise

    def commit(self, scalars: list[dict], has_state: bool = True) -> None:
        """Make the slot the last sweeps wrote current, with these per-sub-group scalars."""
        self._slot, self._has_state, self._scalars, self._initial = 1 - self._slot, has_state, scalars, None
        self._generation += 1
        self._overwritten.clear()
        self._kept = None  # `step` names the buffers it kept after committing (module note: kept sub-groups)

    def mark(self) -> tuple:
        """The committed state as it is now, for `revert` after the next step."""
        return self._generation, self._slot, self._has_state, self._scalars, self._initial

    def revert(self, mark: tuple) -> bool:
        """Undo the one step committed since `mark` (a step another rank, or another flat of this rank,
        failed: engine/zero/nvme_tier.py's `revert_step`): with two slots the other slot still holds the
        state `mark` names, bit for bit (a step writes only the slot it makes current). Not possible
        written in place (slots=1), from the deferred master (its host copy is what the step updated) or
        after anything else wrote the files: then False, the state left as it is. True with nothing to undo."""
        generation, slot, has_state, scalars, initial = mark
        if self._generation == generation:
            return True
        if self.slots == 1 or initial is not None or self._generation != generation + 1 or self._slot == slot:
            return False
        self._finish_writes()
        self._slot, self._has_state, self._scalars, self._initial = slot, has_state, scalars, initial
        self._generation += 1
        self._kept = None  # the kept buffers hold the undone step's state (module note: kept sub-groups)
        return True

    def step_order(self) -> list[int]:
        """The sub-groups the next `step` visits, in its order (module note: kept sub-groups)."""
        order = list(range(len(self.groups)))
        return order[::-1] if self._descending else order

    def step(self, grad_slice: Callable[[int, int], torch.Tensor],
             on_updated: Optional[Callable[[int, int, torch.Tensor], None]] = None,
             master_copy: Optional[Callable[[int, int], torch.Tensor]] = None) -> None:
        """One optimizer step over every sub-group. `grad_slice(start, end)` gives the fp32 gradient of
        elements [start, end) (a CPU tensor); `on_updated(start, end, master)` sees the updated master
        slice, valid only during the call (copy it to the model there). `master_copy(start, end)`: the
        caller's copy of the committed master, bit for bit, read instead of the file (note: master copy)."""
        had_state = self._has_state
        scalars = [dict() for _ in self.groups]

        def visit(k: int, views: dict) -> None:
            s, e = self.groups[k]
            scalars[k] = self._step_sub_group(k, views, grad_slice(s, e), had_state)
            if on_updated is not None:
                on_updated(s, e, views[MASTER])
        token = object()
        self._master_copy = master_copy
        try:
            self.sweep(visit, {key: self._slot for key in self._keys(had_state)}, self._keys(True),
                       self.step_order(), token)
        finally:
            self._master_copy = None
        self.commit(scalars)
        self._kept, self._descending = token, not self._descending

    def _step_sub_group(self, k: int, views: dict, grad: torch.Tensor, had_state: bool) -> dict:
        s, e = self.groups[k]
        n = e - s
        if grad.shape != (n,) or grad.dtype != torch.float32 or grad.device.type != "cpu":
            raise ValueError(f"grad_slice({s}, {e}) gave {tuple(grad.shape)} {grad.dtype} on {grad.device}; "
                             f"expected ({n},) torch.float32 on cpu")
        param = self._param
        param.data = views[MASTER]
        param.grad = grad
        state = self.optimizer.state[param]
        state.clear()
        if had_state:
            state.update({key: views[key] for key in self.state_keys})
            state.update(self.scalars(k))
        self.optimizer.step()
        late = sorted(set(state) - set(self.state_keys) - set(self.scalar_keys))
        if late:  # made after the first step: it was not in learn_state_layout's probe, so has no file
            raise StateLayoutError(f"optimizer {type(self.optimizer).__name__} made state {late} after its first "
                                   "step; swap files are laid out from the first step's state")
        for key in self.state_keys:
            value, view = state[key], views[key]
            if value.data_ptr() != view.data_ptr():  # created by the optimizer, or replaced rather than updated
                view.copy_(value)
        kept = {key: state[key] for key in self.scalar_keys if key in state}
        state.clear()
        param.grad = None
        param.data = torch.zeros(0, dtype=torch.float32, device="cpu")
        return kept

    def frozen(self, path_for: Callable[[str], str], path_key: str) -> FrozenState:
        """The current state as copies of its swap files (`path_for(kind)` names each copy), which the
        next steps do not touch: an async checkpoint's snapshot without the state in memory
        (offload/file_snapshot.py)."""
        self._finish_writes()
        scalars = {key: copy_value(v) for key, v in self._scalars[0].items()} if self.groups else {}
        if self._initial is not None:  # no file yet (deferred initialisation): the master from memory
            write_file(path_for(MASTER), ((k * self.stride_bytes, self._initial(s, e))
                                          for k, (s, e) in enumerate(self.groups)), path_key)
            return FrozenState({MASTER: path_for(MASTER)}, self.groups, self.stride_bytes, scalars)
        keys = self._keys(self._has_state)
        self._check_committed(dict.fromkeys(keys, self._slot))
        files = {key: self._file(key, self._slot) for key in keys}
        return FrozenState(snapshot_files(files, path_for, path_key), self.groups, self.stride_bytes, scalars)

    def close(self) -> None:
        """Finish outstanding writes and delete this partition's swap files."""
        try:
            self._finish_writes()
        finally:
            for path in self._files.values():
                self.aio.delete(path)

