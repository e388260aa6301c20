"""ZeRO-Infinity's optimizer tier at stages 1, 2 and 3 (`offload_optimizer.device: "nvme"`).

[Note: nvme tier] The partition is placed as for `device: "cpu"` (tier.py), except the gradient: reduced
segments land in swap files, and unscaling, the NaN/Inf check and clipping are applied as they are read
back (grad_swap.py). What changes is the step: the
fp32 master weights and the optimizer state live in `SwappedPartition` swap files under a per-job
`SwapDir` in `nvme_path`, one partition per flat (param group, model dtype), and each sub-group of
`sub_group_size` elements is read, stepped by a copy of the configured optimizer and written back
(offload/swapped_partition.py); Lamb and Muon, which need whole tensors, take two passes over the
sub-groups instead (nvme_per_tensor.py). Every stepper reads the gradient through `grad_reader`. The
updated master slice is written through the partition store
into what the all-gather sends from (the host flat `PartitionedParams.flat`; with `offload_param.device:
"nvme"` the parameter swap files instead: param_nvme.py, each write overlapping the next sub-group's
step), so the gather path is the CPU tier's.
That host flat is the send image, not the state: the configured optimizer never steps, and its state stays empty; the
state's host memory is the swap pool. At stage 3 the host flat is also the chunk the prefetcher's
all-gathers send from (tier.py's stage-3 note), so the same copy serves both. A skipped step never
calls the stepper, so the files are left bit for bit as they were (two slots, the stepper's note).
[Note: hyperparameters] The user's optimizer keeps its param groups, so LR schedules and
`engine.optimizer` still act on it; before every step each group's hyperparameters are copied into
the inner optimizer of that group's partitions.
"""
from __future__ import annotations

import itertools

import torch

import ops
import schemas
from offload import (AsyncFileIO, OffloadIOError, SwapBufferPool, SwapDir, SwappedPartition,
                     sub_group_buffer_elements)
from offload.param_swap import NvmeParamStore
from ops.state_layout import StateLayoutError
from .swappable import SWAPPABLE_NAMES, config_name, constructor_args, swap_problem

from .nvme_per_tensor import per_tensor_stepper
from .partition_store import HalfImageStore, TierMasterStore
from .nvme_state import install_state_dict_hooks

PATH_KEY = "zero_optimization.offload_optimizer.nvme_path"
# [Note: lanes] torch's fused CPU AdamW steps whole SIMD vectors and then a scalar tail, and the two round
# differently (fused multiply-add). A sub-group starting mid-vector would put other elements in the tail
# than the in-memory step over the whole flat does, and differ from it in the last bit (measured: 5 of
# 6 seeds at sub-group 37 or 41 elements, none at multiples of 64). So sub-groups are whole multiples of
# LANES elements (4 AVX-512 vectors of fp32), `sub_group_size` rounded up.
LANES = 64


def optimizer_problem(optimizer) -> str | None:
    """Why `optimizer` cannot step swapped sub-groups (swappable.py decides), naming the key."""
    why = swap_problem(optimizer)
    if why is None:
        return None
    return (f'zero_optimization.offload_optimizer.device: "nvme" with optimizer {config_name(optimizer)} is not '
            f'built yet ({why}); use offload_optimizer.device "cpu", or an elementwise optimizer ({SWAPPABLE_NAMES})')


def wants_nvme(zero) -> bool:
    section = zero.offload_optimizer
    return section is not None and section.device == "nvme"


def wants_half_image(zopt, zero) -> bool:
    """Stages 1-2 in fp16/bf16 training: the send image in the model dtype, the fp32 flats freed
    (partition_store.py's note: 16-bit send image). Not with `fast_init`, whose first step reads its
    first master from the flats."""
    half = any(key[1] in (torch.float16, torch.bfloat16) for key in zopt.partition.flat)
    return half and zopt.stage < 3 and not zero.offload_optimizer.fast_init


def attach_master_store(zopt, zero) -> None:
    """The partition store that knows the master is in the tier's files (partition_store.py's note:
    master in the tier), where the partition is in memory; with the parameters on NVMe their store
    takes the tier itself (param_nvme.py's `finish_param_nvme`)."""
    if wants_half_image(zopt, zero):
        zopt.partition.store = HalfImageStore(zopt.partition, zopt.nvme, zopt.tier)
    else:
        zopt.partition.store = TierMasterStore(zopt.partition, zopt.nvme)


def inner_factory(optimizer: torch.optim.Optimizer, group: dict):
    """A constructor of the same optimizer over other parameters, with `group`'s hyperparameters."""
    kind = type(optimizer)
    if isinstance(optimizer, ops.MuonWithAuxAdam):  # one half per flat (nvme_per_tensor.py)
        def make_muon(params: list) -> torch.optim.Optimizer:
            inner = kind([{"params": params, "use_muon": group["use_muon"]}], adam_w_mode=optimizer.adam_w_mode,
                         ns_dtype=optimizer.ns_dtype)
            _copy_hyper(group, inner.param_groups[0])
            return inner
        return make_muon
    # `defaults` may hold keys the constructor does not take (AdamW's decoupled_weight_decay): pass the
    # ones it takes; the group copy below sets the rest, which is what `step` reads.
    accepted = constructor_args(kind)
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}

    def make(params: list) -> torch.optim.Optimizer:
        inner = kind(params, **defaults)
        _copy_hyper(group, inner.param_groups[0])
        return inner
    return make


def _copy_hyper(src: dict, dst: dict) -> None:
    for key, value in src.items():
        if key != "params":
            dst[key] = value


class NvmeOptimizerTier:
    """The swapped step of one rank's stage-1/2/3 partition (module note)."""

    def __init__(self, zopt, zero, aio):
        section = zero.offload_optimizer
        problem = optimizer_problem(zopt.optimizer)
        if problem:
            raise schemas.ConfigError([problem])
        partition, rank = zopt.partition, zopt.comm.rank
        self.optimizer, self.partition = zopt.optimizer, partition
        self.grad_swap = None  # set by grad_swap.attach_grad_swap
        self.unrestored: dict[tuple, str] = {}  # flat key -> why its send image is not the master (step's note)
        self.failed: BaseException | None = None  # the last step's error (revert_step)
        self._marks: dict[tuple, tuple] = {}  # flat key -> its state before the last step (revert_step)
        try:
            self.swap = SwapDir.create(section.nvme_path, path_key=PATH_KEY)
        except OffloadIOError as bad_path:  # missing / unwritable nvme_path: a config mistake, said as one
            raise schemas.ConfigError([str(bad_path)]) from None
        self.io = AsyncFileIO(aio, path_key=PATH_KEY)
        sub_group = -(-max(1, int(zero.sub_group_size)) // LANES) * LANES  # the lanes note
        # a pipeline stage of parameter-free layers has no flat: its tier steps nothing, but the rank still
        # joins every step's status all-gather (partitioned.py's note: a step failed on some rank)
        elements = max((sub_group_buffer_elements(f.numel(), sub_group) for f in partition.flat.values()),
                       default=LANES)
        self.parts: dict[tuple, SwappedPartition] = {}
        try:  # whatever fails from here on, the swap directory made above goes with it (close)
            self.pool = SwapBufferPool(section.buffer_count, elements, pin_memory=section.pin_memory)
            for key, flat in partition.flat.items():
                group = self.optimizer.param_groups[key[0]]
                part = SwappedPartition(flat.numel(), inner_factory(self.optimizer, group), self.swap, self.io,
                                        self.pool, sub_group, pipeline_read=section.pipeline_read,
                                        pipeline_write=section.pipeline_write, slots=section.swap_slots,
                                        name=f"rank{rank}-group{key[0]}-{str(key[1]).removeprefix('torch.')}")
                # fast_init: nothing written before the first step (the stepper's deferred-initialisation note)
                part.initialize(lambda s, e, key=key: partition.store.read(key, s, e), deferred=section.fast_init)
                self.parts[key] = part
            self.per_tensor = per_tensor_stepper(self, zopt)  # Lamb, Muon: two passes (nvme_per_tensor.py)
            self._hooks = install_state_dict_hooks(self)  # state_dict() sees the swap files (nvme_state.py)
        except StateLayoutError as undeclared:  # state the swap files cannot hold, said at initialize
            self.close()
            raise schemas.ConfigError([f'zero_optimization.offload_optimizer.device: "nvme": {undeclared}']) from None
        except BaseException:
            self.close()
            raise

    def step(self) -> None:
        """The optimizer step over every partition, sub-group by sub-group; the host flats receive the
        updated master weights for the all-gather. Refused while a failed step's send image could not be
        put back (`_restore_send_image`): the step would start from it (the master copy) and the weights
        the last forward used were half-updated. A step that fails is undone on every flat (`revert_step`)
        and its error kept in `failed`."""
        self.failed, self._marks = None, {key: part.mark() for key, part in self.parts.items()}
        try:
            self._check_image_for_step()
            try:
                if self.per_tensor is not None:
                    self.per_tensor.step()
                    return
                for key, part in self.parts.items():
                    self.step_elementwise(key, part)
            except BaseException:
                self.revert_step()
                raise
            finally:  # the last sub-group's write-back (offload/param_swap.py's note: write-behind)
                self.partition.store.flush()
        except BaseException as err:
            self.failed = err
            raise

    def _check_image_for_step(self) -> None:
        """`check_image` before the step; a rank refusing a two-pass step still enters its collectives,
        as a rank failing inside it does, so the other ranks' step pairs up (nvme_per_tensor.py)."""
        try:
            self.check_image(self.unrestored)
        except OffloadIOError:
            if self.per_tensor is not None:
                self.per_tensor.join_as_failed()
            raise

    def revert_step(self) -> None:
        """Undo the last step on every flat: another flat's step failed, or another rank's (ZeRO-3 agrees
        on `failed`: stage3.py's note, a step failed on some rank). Each flat goes back to its state before
        the step where its files still hold it (two slots: `SwappedPartition.revert`); one that cannot (in
        place, or fast_init's first step) is `unrestored`, refused until a load. Then the send image gets
        the committed master back (`_restore_send_image`)."""
        for key, part in self.parts.items():
            if key in self._marks and not part.revert(self._marks[key]):
                self.unrestored[key] = ("the step, written in place (offload_optimizer.swap_slots 1) or by "
                                        "fast_init's first step, cannot be undone")
        self._restore_send_image()

    def check_image(self, keys) -> None:
        """Refuse to serve flat `keys`' send image while a failed step left it half-updated and putting the
        committed master back failed too (`unrestored`): the step, and every read of the weights through
        the partition store (gathers, `safe_get_*`, a state dict; partition_store.py's note: a refused
        image) raise this one error until a load replaces the image (`load_chunks`)."""
        key = next((key for key in keys if key in self.unrestored), None)
        if key is not None:
            raise OffloadIOError(f"{PATH_KEY}: a failed optimizer step left this rank's weights (param group "
                                 f"{key[0]}) half-updated in host memory, and putting the committed master back "
                                 f"failed too ({self.unrestored[key]}); load a checkpoint to go on")

    def _restore_send_image(self) -> None:
        """A step that failed halfway left the files' committed state as it was (two slots), but the
        sub-groups stepped before the failure had already updated the send image (the host flat or the
        parameter files), which the gathers, checkpoints and safe_get_* read as the master: put the
        committed master back there. The step's own error is the one raised; a flat this fails for is
        remembered (`unrestored`) until a load replaces it, and the next step refuses to run (in place,
        swap_slots 1, the master is refused until a load anyway)."""
        store = self.partition.store
        for key, part in self.parts.items():
            if not self.holds_master(key):  # fast_init's first step: the deferred master is the flat (docs)
                continue
            try:
                store.flush()
                for s, e in part.groups:
                    store.write_image(key, s, part.read_master(s, e))
                store.flush()
            except Exception as err:  # noqa: BLE001 - the step's error is what the user needs to see
                self.unrestored[key] = f"{type(err).__name__}: {err}"

    def step_elementwise(self, key: tuple, part: SwappedPartition) -> None:
        """Flat `key`'s step by the inner copy of the optimizer, sub-group by sub-group; the updated
        master goes through the partition store (the host flat, or the parameter swap files)."""
        _copy_hyper(self.optimizer.param_groups[key[0]], part.param_groups[0])
        store = self.partition.store
        if self.grad_swap is not None:  # its read-ahead follows the stepper's order (grad_swap.py's note)
            self.grad_swap.expect(key, [part.groups[k] for k in part.step_order()])
        part.step(self.grad_reader(key), lambda s, e, master: store.write_behind(key, s, master),
                  self._master_copy(key))

    def _master_copy(self, key: tuple):
        """(start, stop) -> flat `key`'s committed master from host memory, which the stepper then reads
        instead of the master's file (swapped_partition.py's note: master copy): the fp32 flats of a
        TierMasterStore (partition_store.py's note: master in the tier; not the 16-bit image), or what the
        NVMe parameter store's resident copies and kept buffers hold of fp32 files (None elsewhere)."""
        store = self.partition.store
        if isinstance(store, NvmeParamStore):  # what it holds in memory (offload/param_swap.py's master_copy)
            return lambda s, e: store.master_copy(key, s, e)
        if type(store) is not TierMasterStore or self.partition.flat[key].dtype != torch.float32:
            return None
        return lambda s, e: store.read(key, s, e)

    def grad_reader(self, key: tuple):
        """(start, stop) -> flat `key`'s unscaled, clipped fp32 gradient there: read from its swap file
        (grad_swap.py; a new tensor on each call, so a range read twice is the same bits) or a view of the
        host gradient flat (`offload_optimizer.swap_gradients` false: grad_swap.py's note, when), which
        the step unscaled and clipped in place before the stepper runs."""
        swapped = self.grad_swap
        if swapped is not None:
            return lambda s, e: swapped.step_slice(key, s, e)
        grad = self.partition.flat_grad[key]
        return lambda s, e: grad[s:e]

    def state_chunks(self, key: tuple):
        return self.parts[key].state_chunks()

    def read_master(self, key: tuple, start: int, stop: int) -> torch.Tensor:
        """Flat `key`'s fp32 master, elements [start, stop), from its swap files (a new tensor): where the
        parameter store's 16-bit files cannot give it (offload/param_swap.py's note: 16-bit files)."""
        return self.parts[key].read_master(start, stop)

    def start_read_master(self, key: tuple, out: torch.Tensor, start: int) -> list:
        """`read_master` into `out` at element `start`, the reads left in flight (their handles)."""
        return self.parts[key].start_read_master(out, start)

    def write_master(self, key: tuple, start: int, values: torch.Tensor) -> None:
        self.parts[key].write_master(start, values)

    def holds_master(self, key: tuple) -> bool:
        """Whether flat `key`'s master is in the swap files: not yet before `fast_init`'s first step (or a
        load), when it is the partition store's copy (partition_store.py's note: master in the tier)."""
        return not self.parts[key].master_deferred

    def load_chunks(self, key: tuple, chunks, keep_state: bool = False) -> None:
        """Load `key`'s partition from chunks and refresh its send image (the partition store) from them.
        Chunks without optimizer state leave none (a checkpoint saved before the first step, a state dict
        without state: the in-memory optimizer's state is replaced by the empty one); with `keep_state`
        they replace only the master and the state the files hold is kept, as a load with
        `load_optimizer_states=False` or `load_module_only` keeps the in-memory optimizer's."""
        store, part = self.partition.store, self.parts[key]
        # the load reads what it replaces through the store (checkpoint/nvme.py), which refuses a
        # half-updated image (check_image): not refused while loading, refused again if the load fails
        why = self.unrestored.pop(key, None)
        try:
            self._load_chunks(key, store, part, chunks, keep_state)
        except BaseException:
            if why is not None:
                self.unrestored[key] = why
            raise

    def _load_chunks(self, key: tuple, store, part: SwappedPartition, chunks, keep_state: bool) -> None:
        chunks = iter(chunks)
        first = next(chunks, None)
        chunks = itertools.chain([] if first is None else [first], chunks)

        def through(chunks):
            for chunk in chunks:
                store.write_image(key, chunk["start"], chunk["master"])  # the part writes the master
                yield chunk
        if keep_state and first is not None and not first["state"] and part.has_state:
            part.load_master(through(chunks))
        else:
            part.load_chunks(through(chunks))

    def close(self) -> None:
        """Delete the swap files and the job's swap directory (also done at exit by SwapDir)."""
        try:
            for hook in getattr(self, "_hooks", []):
                hook.remove()
            for part in self.parts.values():
                part.close()
            self.parts.clear()
            if self.grad_swap is not None:
                self.grad_swap.close()
            self.io.close()
        finally:
            self.swap.close()
