"""ZeRO stage 3: optimizer state, gradients and parameters partitioned across data-parallel ranks.

Memory per rank (Ψ parameters, N ranks, Adam, any precision): 16Ψ/N bytes of model state — the fp32
partition (4: the master weights; in fp32 they are the parameters), its gradient (4) and exp_avg and
exp_avg_sq (8) — plus the persistent small parameters (`param_persistence_threshold`) and padding.
No 16-bit copy of the partition is kept: an all-gather casts the fp32 chunk on the way out, which
gives the same 16-bit weights. Full parameters exist only while their unit is computing (or kept for
reuse, `max_reuse_distance`, `max_live_parameters`).
Communication per step (ZeRO paper §7): all-gather Ψ before forward, Ψ again before backward,
reduce-scatter Ψ of gradients as backward produces them (3Ψ), plus one all-gather of the persistent
parameters after the step (with NVMe offload carrying each rank's status, or only that where no parameter
is persistent: notes, a failed persistent read and a step failed on some rank) and tiny all-reduces: one per micro-step's forward (whether a rank left
the plan, whether the ranks' forwards reach the same parameters, whether a parameter read failed), one per micro-step at its end (whether to re-record the trace, with the pass's tag check:
prefetch.py's notes) and one per step (the gradient norm); three per step without accumulation. With the defaults (`max_reuse_distance` 1e9, as in DeepSpeed) a model that fits is gathered
once per pass and kept through backward: 2Ψ.

Parts: `stage3_units` (which module gathers what; hooks), `prefetch` (gather/release/prefetch by the
recorded order), `stage3_params` (chunks, placeholders, gather groups), `init` (`zero.Init`,
`GatheredParameters`), `stage3_save` (`save_16bit_model`), `gather_requests` (gathering when ranks run different units),
`stage3_read_failures` (a parameter read failing on some ranks only). Gradients reuse stage 2's fixed-order
reduce-scatter buckets into the fp32 partition gradient; the step, clipping and state reuse stage 1's.
"""
from __future__ import annotations

import ctypes
import os
import warnings

import torch
import torch.distributed as dist

from offload.aio import OffloadIOError, OffloadIOWarning
from offload.chunk_file import SwappedChunk

from ..comm import Communicator
from .arrivals import ArrivalLog
from .grad_swap import swaps_gradients
from .param_nvme import wants_param_nvme
from .param_copy import copyable_when_partitioned
from .partition import REDUCE_DEPTH, ChunkSpec, InFlight, RankMajorLayout
from .prefetch import ParamCoordinator
from .stage0 import reduction_settings
from .stage2 import ZeroStage2Optimizer
from .stage3_params import (GatherGroup, Stage3Partition, check_not_replaced, chunk_tensor, full_shape, gather_full,
                            local_chunk, padded_chunk, partition_numel, replaced_error, spec_of)
from .stage3_frozen import FrozenChunks
from .stage3_read_failures import PeerReadError, PeerStepError, ranks_named, undo_for_peers
from .stage3_units import discover_units, install_hooks, user_modules
from .partition_store import GroupSources
from .tier import copy_chunks
from .nvme_tier import wants_nvme

READ_FAILED, STEP_FAILED = 1, 2  # a rank's status in the persistent refresh (notes: a failed persistent read, step)


class HostMemoryTrimmer:
    """[Note: host memory] Each pass allocates and frees the gathered parameters and the all-gather
    buffers (the model's size, twice). glibc keeps freed blocks in its heap for reuse (its mmap
    threshold adapts upward once a large block was freed), so on CPU the RSS could creep up as the
    heap fragments. After each backward this reads the RSS (~20 µs) and calls `malloc_trim(0)` only
    when it exceeds the steady state (the highest after-backward RSS of the first WARMUP passes, when
    the heap holds the freed activations the next forward reuses) by more than `limit` (the model's
    gathered size). Trimming after every backward, as this did first, costs far more than it saves: the pages it
    returns are faulted in again by the next forward. Measured on the 25M GPT, 2 ranks, 8 steps, with
    other jobs on the machine: trim every backward 4546-5428 ms per step, peak RSS 1027-1041 MB; never
    2610-2964 ms, 1090-1137 MB (FSDP2 in the same runs: 3149-3598 ms, 1139-1176 MB). Inactive on
    accelerators, without glibc, or with DSTRAIN_KEEP_MALLOC=1."""

    WARMUP = 3

    def __init__(self, limit: int):
        self.limit, self.trims, self.calls, self.floor, self._trim = limit, 0, 0, 0, None
        if torch.cuda.is_available() or os.environ.get("DSTRAIN_KEEP_MALLOC"):
            return
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            return
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def __call__(self) -> None:
        if self._trim is None:
            return
        rss = self._rss()
        self.calls += 1
        if self.calls <= self.WARMUP:
            self.floor = max(self.floor, rss)
        elif rss > self.floor + self.limit:
            self._trim(0)
            self.trims += 1


def _gather_communicator(comm: Communicator) -> Communicator:
    """A second process group for parameter all-gathers (prefetch.py's note), counted with `comm`."""
    if comm.world_size == 1 or not dist.is_initialized():
        return comm
    from ..topology import current  # the data axis of the grid, not range(world) (DESIGN decision 11)
    gather = Communicator(current().duplicate("data") if comm.group is not None else dist.new_group(
        dist.get_process_group_ranks(dist.group.WORLD)))
    gather.stats = comm.stats
    return gather


class ZeroStage3Optimizer(ZeroStage2Optimizer):
    stage = 3

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Communicator, guard, module: torch.nn.Module, zero,
                 *, overlap_comm: bool, gradient_clipping: float, prescale_gradients: bool = False,
                 gradient_predivide_factor: float = 1.0, communication_data_type: str | None = None,
                 grad_accum_dtype: str | None = None, ignore_unused_parameters: bool = True,
                 param_names: dict | None = None, tier=None):
        for name, p in module.named_parameters():
            check_not_replaced(p, name)  # a zero.Init chunk of another shape (stage3_params.py's note: resized)
        self.optimizer, self.comm, self.guard, self.module = optimizer, comm, guard, module
        self.clip, self.scaling, self.comm_dtype = reduction_settings(
            comm.world_size, gradient_clipping, prescale_gradients, gradient_predivide_factor, communication_data_type)
        self.use_reduce_scatter, self.use_all_gather, self.overlap = zero.reduce_scatter, True, overlap_comm
        self.inflight = InFlight(depth=REDUCE_DEPTH)
        self.last_grad_norm: float | None = None
        self.arrivals, self.ignore_unused = ArrivalLog(param_names), ignore_unused_parameters
        self._init_tier(tier)
        self.partition = Stage3Partition(optimizer, comm.world_size, comm.rank, self.tier,
                                         grads_swapped=swaps_gradients(zero, optimizer,
                                                                       partition_numel(optimizer, comm.world_size)),
                                         params_swapped=wants_param_nvme(zero))
        units = discover_units(module)
        self.persistent = self._choose_persistent(units, zero)
        self.frozen_chunks = FrozenChunks()  # stage3_frozen.py's note
        groups = self._build_groups(units)
        self._persistent_shapes = [(p, tuple(p.shape)) for p in self.persistent]  # see backward
        group_of = {p: g for g in groups for p in g.params}
        hooks = user_modules(module, units, group_of)
        self.coordinator = ParamCoordinator(
            units, hooks, groups, _gather_communicator(comm), prefetch_numel=int(zero.prefetch_bucket_size),
            max_live_numel=int(zero.max_live_parameters), max_reuse_distance=int(zero.max_reuse_distance),
            agree_comm=comm)
        self._hooks = []
        for u in units:
            self._hooks += install_hooks(u.module, u.index, self.coordinator)
        for k, (_, m, _) in enumerate(hooks):
            self._hooks += install_hooks(m, len(units) + k, self.coordinator)
        # Gradient buckets in reverse unit order, the order backward produces them (stage2.py).
        trainable = set(self.partition.fragments)
        self.params = [p for u in units for p in u.owned if p in trainable]
        self.coordinator.reach_index = {p: i for i, p in enumerate(self.params)}  # prefetch.py: reductions wait
        self._init_gradients(max(1, int(zero.reduce_bucket_size)), grad_accum_dtype)
        for g in groups:
            g.release()
        self._statuses = wants_param_nvme(zero) or wants_nvme(zero)  # note: a failed persistent read
        self._persistent_layouts = self._persistent_runs(self._statuses)
        self._stale: tuple | None = None  # a persistent refresh that failed on some rank (see _refresh_persistent)
        self.coordinator.before_pass = self._retry_refresh
        self._trim = HostMemoryTrimmer(limit=sum(g.numel * g.fulls[0].element_size() for g in groups if g.fulls))
        for p in module.parameters():
            p._z3_owner = self  # GatheredParameters finds the stage through it
            copyable_when_partitioned(p)  # a deepcopy is refused (param_copy.py's note)
            if hasattr(p, "_z3_chunk"):
                del p._z3_chunk  # copied into the flat partition (or frozen_chunks)

    # -- construction -----------------------------------------------------------------------------
    @staticmethod
    def _choose_persistent(units, zero) -> set:
        """Small parameters stay whole (`param_persistence_threshold`), up to `model_persistence_threshold`
        elements in total."""
        persistent, total = set(), 0
        for u in units:
            for p in u.owned:
                n = torch.Size(full_shape(p)).numel()
                if n <= zero.param_persistence_threshold and total + n <= zero.model_persistence_threshold:
                    persistent.add(p)
                    total += n
        return persistent

    def _keep_frozen(self, p: torch.nn.Parameter) -> None:
        """Keep this rank's padded chunk of frozen `p`, in the model dtype (trainable ones are master slots,
        read through the partition store). A chunk zero.Init put in its file stays there until the NVMe
        store moves it (stage3_frozen.py's note)."""
        spec = spec_of(full_shape(p), self.comm.world_size)
        init = getattr(p, "_z3_chunk", None)
        if (self.partition.params_swapped and isinstance(init, SwappedChunk) and init.dtype == p.dtype
                and init.numel == spec.padded):
            self.frozen_chunks.add(p, init)
        else:
            self.frozen_chunks.add(p, self.tier.place(local_chunk(p, spec, self.comm.rank).to(p.dtype)))

    def _build_groups(self, units) -> list[GatherGroup]:
        groups = []
        world, rank = self.comm.world_size, self.comm.rank
        for u in units:
            by_dtype: dict = {}
            for p in u.owned:
                if p in self.persistent:
                    if tuple(p.shape) != full_shape(p):  # partitioned by zero.Init: make it whole
                        self._materialize(p)
                    continue
                by_dtype.setdefault(p.dtype, []).append(p)
            for dtype, params in by_dtype.items():
                name = u.name if len(by_dtype) == 1 else f"{u.name}[{dtype}]"
                for p in params:
                    if p not in self.partition.fragments and p not in self.frozen_chunks:
                        self._keep_frozen(p)
                sources = GroupSources(self.partition, params, self.frozen_chunks)
                g = GatherGroup(len(groups), name, params, sources, world, rank)
                u.groups.append(g)
                groups.append(g)
                for p in params:
                    p.ds_shape = torch.Size(full_shape(p))
        return groups

    def _materialize(self, p: torch.nn.Parameter) -> None:
        """A persistent parameter that zero.Init partitioned: all-gather it once."""
        spec = spec_of(full_shape(p), self.comm.world_size)
        chunk = chunk_tensor(p._z3_chunk).to(device=self.comm.device, dtype=p.dtype)
        p.data = gather_full(self.comm, spec, chunk, full_shape(p))

    def _persistent_runs(self, status: bool) -> list[tuple[list, RankMajorLayout]]:
        """One all-gather per dtype; with parameters or the optimizer on NVMe each rank's segment ends with
        a status element (`_refresh_persistent`, `step`), gathered alone where no parameter is persistent."""
        by_dtype: dict = {}
        for p in self.params:
            if p in self.persistent:
                by_dtype.setdefault(p.dtype, []).append(p)
        world = self.comm.world_size
        return [(ps, RankMajorLayout(ps + [None] * status, [self.partition.fragments[p].spec for p in ps]
                                     + [ChunkSpec(world, 1, 1)] * status, world))
                for ps in list(by_dtype.values()) or [[]] * status]

    # -- backward and step ------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        for p, shape in self._persistent_shapes:  # whole, so nothing else sees a resize (stage3_params.py's note)
            if tuple(p.shape) != shape:
                raise RuntimeError(replaced_error(p, "after engine.initialize partitioned it", was=shape))
        try:
            try:
                super().backward(loss, retain_graph=retain_graph)
            finally:
                self.coordinator.end_pass()
                self._trim()
        except BaseException as err:
            if err is self.coordinator.failures.raised:  # a parameter read failed on some rank: the window's
                self._drop_window()  # gradients hold the failed pass's (stage3_read_failures.py's note)
            raise

    def _drop_window(self) -> None:
        """Forget every gradient of this accumulation window: reductions in flight land first."""
        self.inflight.drain()
        self._reset_buckets()
        self.zero_grad()

    def _backward_anchors(self) -> list:
        return self.coordinator.backward_anchors()

    def _reductions_wait_for_backward(self) -> bool:
        return self.coordinator.defer_reductions  # prefetch.py's note: reductions wait

    def _reduce_remaining(self) -> None:
        self.coordinator.before_reduction()  # owe the other ranks no gather while waiting on them
        super()._reduce_remaining()

    @torch.no_grad()
    def _gather_params(self) -> None:
        """After the step: gathered copies are stale (released); persistent parameters are refreshed."""
        self.coordinator.release_all()
        self.partition.store.master_updated()  # a step or a load changed the in-memory master (NVMe: to its files)
        self._refresh_persistent()

    def step(self, step_number: int = 0) -> bool:
        """[Note: a step failed on some rank] With the optimizer on NVMe one rank's step can fail alone (a
        swap file's read or write). Raised right there, it left the other ranks in the persistent
        refresh's all-gather after their step until the process group's timeout, their step applied and
        the failing rank's not. So the failing rank joins that refresh anyway, sending zeros and status
        STEP_FAILED (with no persistent parameter the statuses are all it gathers), every rank reads the
        statuses (read anyway: `_refresh_persistent`), the ranks that applied the step undo it
        (nvme_tier.py's `revert_step`: two slots go back bit for bit; in place, the next step is refused
        until a load, as on the failing rank), and every rank raises from this step: the failing rank its
        own error, the others PeerStepError naming it. Nothing stays gathered, and every rank drops the
        window's gradients, as after a failed read (stage3_read_failures.py's note): training on equals a
        run without the batch."""
        try:
            return super().step(step_number)
        except BaseException as err:
            failed_here = self.nvme is not None and err is self.nvme.failed
            if not failed_here and not isinstance(err, PeerStepError):
                raise
            if failed_here:
                self.coordinator.release_all()
                if self.step_status_comm is None:  # else agreed already (partitioned.py's _agrees_after_step)
                    self._refresh_persistent(step_failed=True)
            self._drop_window()
            raise

    @torch.no_grad()
    def _refresh_persistent(self, step_failed: bool = False) -> None:
        """The persistent parameters from the master. [Note: a failed persistent read] With parameters on
        NVMe a rank's read of its slots can fail alone (stage3_read_failures.py's note): it sends zeros
        and status READ_FAILED instead of leaving the others in the all-gather. Every rank reads the
        statuses (one host read per step, parameters or the optimizer on NVMe only), keeps the values of a
        dtype some rank failed to read from before (the step is applied: the master has it) and tries
        again before the next pass (`_retry_refresh`): a failure that passes costs nothing, one that
        stays is raised there, on every rank, naming every rank that failed (a rank that failed raises its
        own error). `step_failed`: this rank's step failed (note: a step failed on some rank)."""
        outs, mine, world = [], None, self.comm.world_size
        for params, layout in self._persistent_layouts:
            send = self.comm.empty(layout.segment, dtype=params[0].dtype if params else torch.float32)
            slots, status = layout.segment_slots(send), STEP_FAILED if step_failed else 0
            try:
                if not status:
                    ok = [self.comm.zeros(1, dtype=send.dtype)] * self._statuses
                    copy_chunks(slots, (self.partition.store.persistent_slots(params) if params else []) + ok)
            except OffloadIOError as err:
                if not self._statuses:
                    raise
                status, mine = READ_FAILED, mine or err
                warnings.warn(f"ZeRO-3: reading the persistent parameters failed ({err}); every rank keeps them "
                              "from before this step and reads them again before the next pass", OffloadIOWarning)
            if status:
                send.zero_()
                send[-1:].fill_(status)
            out = self.comm.empty(layout.numel, dtype=send.dtype)
            self.comm.all_gather(out, send)
            outs.append(out)
        statuses = (torch.stack([o.view(world, -1)[:, -1].float() for o in outs]).tolist() if self._statuses
                    else [[0] * world for _ in outs])
        failed = sorted({r for row in statuses for r, s in enumerate(row) if s == STEP_FAILED})
        if failed:
            if not step_failed:
                raise undo_for_peers(self.nvme, 3, failed)
            return
        for (params, layout), out, row in zip(self._persistent_layouts, outs, statuses):
            if params and not any(row):
                layout.unpack(out, [p.data for p in params])
        failed = sorted({r for row in statuses for r, s in enumerate(row) if s == READ_FAILED})
        self._stale = (mine, failed) if failed else None

    def _retry_refresh(self) -> None:
        """Before a pass (the coordinator's `before_pass`): refresh the persistent parameters a failed read
        left from before the last step (note: a failed persistent read); raise where it fails again."""
        if self._stale is None:
            return
        self._refresh_persistent()
        if self._stale is not None:
            mine, ranks = self._stale
            raise mine if mine is not None else PeerReadError(
                f"ZeRO-3: {ranks_named(ranks)} failed to read its persistent parameters (zero_optimization."
                "stage3_param_persistence_threshold) from its NVMe parameter files after the last step, and again "
                "now (that rank's own error names the file): the step was applied, but every rank keeps these "
                "parameters from before it, so this forward did not run. Try again, or load a checkpoint")

    def release_gather_group(self) -> None:
        """`Engine.destroy`: the parameter all-gathers' own process group is destroyed; gathers (if any
        follow) use the reduction group. A forward that raised left its pass open: the wrapper that
        anchors reentrant regions (anchors.py) goes too."""
        self.coordinator.anchors.close()
        gather = self.coordinator.comm
        if gather is not self.comm and gather.group is not None:
            dist.destroy_process_group(gather.group)
            self.coordinator.comm = self.comm

    def refresh_after_load(self) -> None:
        """Added for checkpoint loading (engine/checkpoint/stage3.py), which writes the fp32 partition and
        frozen chunks directly: drop gathered copies, re-gather persistent parameters, as after a step."""
        self._gather_params()

    @torch.no_grad()
    def store_param(self, p: torch.nn.Parameter) -> None:
        """GatheredParameters(modifier_rank=...): keep this rank's chunk of `p`'s new full value."""
        if p in self.persistent and p not in self.partition.fragments:
            return  # a frozen persistent parameter is its full value
        chunk = padded_chunk(p.data, spec_of(full_shape(p), self.comm.world_size), self.comm.rank)
        if p in self.partition.fragments:
            key, start, _ = self._slot_range(p)
            self.partition.store.write(key, start, chunk.to(torch.float32))
        else:
            self.frozen_chunks.put(p, chunk)

    def persistent_groups(self) -> list[list]:
        """The persistent parameters refreshed after each step, one list per all-gather."""
        return [params for params, _ in self._persistent_layouts if params]

    def _slot_range(self, p: torch.nn.Parameter) -> tuple:
        """(flat key, start, stop) of `p`'s padded slot, for `partition.store`."""
        frag = self.partition.fragments[p]
        return frag.key, frag.offset, frag.offset + frag.padded

    # -- queries ------------------------------------------------------------------------------------
    def _gather_slot(self, param: torch.nn.Parameter, slot: torch.Tensor) -> torch.Tensor:
        """Stage 1's query with the full shape (`param.shape` is the placeholder's between uses)."""
        frag = self.partition.fragments[param]
        return gather_full(self.comm, frag.spec, slot.float().to(self.comm.device), full_shape(param))

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for model state, from the tensors themselves (tests, benchmarks)."""
        def nbytes(ts):
            return sum(t.untyped_storage().nbytes() for t in {id(t): t for t in ts}.values())
        opt_state = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        params = list(self.module.parameters())
        return {"partition": nbytes(self.partition.flat.values()),  # 0 bytes when the store swapped it out
                "partition_grad": nbytes(g for g in self.partition.flat_grad.values() if not g.is_meta),
                "optimizer_state": nbytes(opt_state), "frozen_chunks": self.frozen_chunks.resident_bytes(),
                "module_params": nbytes([p.data for p in params]),
                "module_grads": nbytes([p.grad for p in params if p.grad is not None])}
