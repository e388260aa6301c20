"""What ZeRO stages 1 and 2 share: the fp32 partition and its optimizer, gradient buckets reduced
(reduce-scatter) from post-accumulate-grad hooks straight into the partition gradient, global-norm
clipping, the step, the all-gather back into the model, state, and the `safe_get_full_*` queries.
The stages differ only in *when* a backward reduces (`reduce_every_micro_step`): stage 2 on every
micro-step, stage 1 at the accumulation boundary only (stage1.py, stage2.py).

[Note: reduce-scatter on gloo] Measured here (2 ranks, 20 MB): all_reduce 25 ms, reduce_scatter 40-44
ms (list and tensor forms alike), all_gather 20-26 ms. Gloo's reduce-scatter is no cheaper than its
all-reduce, so all-reduce + slice would be faster on this backend; we still reduce-scatter because it
is the op with half the bytes on every other backend (NCCL) and it keeps stages 0-2 at the same 2Ψ
volume. `zero_optimization.reduce_scatter: false` selects all-reduce + slice.
[Note: bucket order] Buckets have a fixed composition (reverse registration order, the order backward
roughly produces gradients) and bucket k is launched only after buckets 0..k-1, whatever order the
hooks fire in, so every rank issues the same collectives in the same order. After backward the
buckets whose parameters got no gradient in it are launched with what those accumulated in earlier
micro-steps (stage 1: a head used only in micro-step 0) or zeros, so no rank waits for a hook that
never fires. A bucket whose parameter got its gradient in pieces waits for the end of backward
(arrivals.py's note). Within a bucket, parameters keep their flat-partition order, so when they are
neighbours in one flat the rank's segment of the reduce-scatter *is* a slice of the partition
gradient and the collective writes there directly (no staging buffer, no copy) whenever nothing is
accumulated into it yet.
[Note: freeing] A parameter's gradient is packed into its bucket's rank-major send buffer in the
post-accumulate-grad hook of a reducing backward, and `.grad` is dropped right there; the send buffer
is dropped when its reduce-scatter finished. So no full-size gradient buffer exists at any time: at
most REDUCE_DEPTH buckets (`reduce_bucket_size`) are in flight (partition.py). Without
`overlap_comm` each bucket is reduced synchronously in the hook.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..comm import Communicator
from ..precision import DTYPES, NonFiniteGuard
from .anchors import backward_from
from .fragment_access import FragmentAccess
from .arrivals import ArrivalLog
from .grad_swap import norm_ranges
from .partition import REDUCE_DEPTH, InFlight, PartitionedParams, RankMajorLayout, land_slots, split_runs
from .tier import HostGradients, PartitionTier
from .stage0 import checked_step, reduction_settings
from .stage3_read_failures import PeerStepError, undo_for_peers


# [Note: gather bucket cap] `allgather_bucket_size` bounds the elements gathered at a time; dstrain
# gathers at most 2^22 (16 MB in fp32) even when it allows more (DeepSpeed's default is 5e8). Measured
# on the 25M GPT, 2 ranks, gloo: one 100 MB bucket 188 ms, 8e6 91 ms, 4e6 83 ms, 2e6 79 ms per step:
# a buffer the size of the model is faulted in afresh on every step, buckets this size are reused
# from the allocator's free lists, and the unpack of one bucket overlaps the next one's transfer.
GATHER_BUCKET_CAP = 1 << 22


@dataclass
class _Bucket:
    index: int
    layout: RankMajorLayout
    targets: list[torch.Tensor]  # the partition-gradient slots of its parameters
    direct: torch.Tensor | None  # the same slots as one slice, when they are neighbours (module note)
    send_dtype: torch.dtype
    send: torch.Tensor | None = None
    pending: int = 0
    launched: bool = False
    deferred: bool = False  # waits for the end of backward (arrivals.py's note)
    packed: set = field(default_factory=set)
    device: torch.device = None  # the collectives' device: send buffers live there, not with the targets,
    # which are host slots under CPU offload (tier.py) or in swap files (grad_swap.py); NCCL takes no host tensor



class PartitionedZeroOptimizer(FragmentAccess):
    """Shared machinery of ZeRO stages 1 and 2 (module docstring)."""

    stage = -1
    reduce_every_micro_step = True
    norm_reduce = None  # a pipeline's: this stage's norm² → the world's (engine/pipe/reduction.py)
    step_status_comm = None  # a pipeline's world: every stage hears of a failed step (engine/pipe/stage_failure.py)
    counted_elsewhere = ()  # parameters another model-parallel rank counts in the norm (tensor_parallel/norm.py)
    reductions_keep_state = False  # exact reductions: nothing of a dropped batch outlives it (stage0.py's property)

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Communicator, guard: NonFiniteGuard, *,
                 reduce_bucket_numel: int, allgather_bucket_numel: int, overlap_comm: bool,
                 gradient_clipping: float, prescale_gradients: bool = False,
                 gradient_predivide_factor: float = 1.0, communication_data_type: str | None = None,
                 grad_accum_dtype: str | None = None, reduce_scatter: bool = True,
                 allgather_partitions: bool = True, ignore_unused_parameters: bool = True,
                 param_names: dict | None = None, tier: PartitionTier | None = None, grads_swapped: bool = False):
        self.optimizer = optimizer
        self.comm = comm
        self.guard = guard
        self.clip, self.scaling, self.comm_dtype = reduction_settings(
            comm.world_size, gradient_clipping, prescale_gradients, gradient_predivide_factor, communication_data_type)
        self.use_reduce_scatter = reduce_scatter
        self.use_all_gather = allgather_partitions
        self.overlap = overlap_comm
        self._init_tier(tier)
        self.partition = PartitionedParams(optimizer, comm.world_size, comm.rank, self.tier, grads_swapped=grads_swapped)
        self.params = self.partition.params()
        self.gather_runs = self.partition.gather_runs(max(1, min(int(allgather_bucket_numel), GATHER_BUCKET_CAP)))
        self.inflight = InFlight(depth=REDUCE_DEPTH)
        self.last_grad_norm: float | None = None
        self.arrivals, self.ignore_unused = ArrivalLog(param_names), ignore_unused_parameters
        self._init_gradients(max(1, int(reduce_bucket_numel)), grad_accum_dtype)

    def _init_tier(self, tier: PartitionTier | None) -> None:
        """Where the partition lives (tier.py); staged gradient copies wait in `host_grads`."""
        self.tier = tier if tier is not None else PartitionTier.on_device(self.comm.device)
        self.host_grads = HostGradients(self.tier) if self.tier.staged else None
        self.nvme = None  # offload_optimizer.device "nvme": set by build_zero_optimizer (nvme_tier.py)
        self.grad_swap = None  # with it: the gradient partition in swap files (grad_swap.py)

    # -- gradient buckets (module notes: bucket order, freeing) -----------------------------------
    def _init_gradients(self, bucket_numel: int, grad_accum_dtype: str | None) -> None:
        accum = DTYPES[grad_accum_dtype] if grad_accum_dtype else None
        if self.reduce_every_micro_step and accum not in (None, torch.float32):
            raise ValueError(f"data_types.grad_accum_dtype: {grad_accum_dtype!r} is not supported with "
                             f"zero_optimization.stage {self.stage}: gradient partitions always accumulate in "
                             'fp32; remove the key or use "fp32"')
        # Between reductions (stage 1's accumulation micro-steps) full gradients accumulate in `.grad`,
        # or, when grad_accum_dtype is wider than the parameter, in a side tensor of that dtype.
        self._accum_dtype = accum
        self._accum: dict[torch.nn.Parameter, torch.Tensor] = {}
        world = self.comm.world_size
        by_dtype: dict[torch.dtype, list] = {}
        for p in reversed(self.params):
            by_dtype.setdefault(p.dtype, []).append(p)
        order = {p: i for i, p in enumerate(self.params)}
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[torch.nn.Parameter, _Bucket] = {}
        for dtype, plist in by_dtype.items():
            sizes = [world * self.partition.fragments[p].padded for p in plist]
            for run in split_runs(plist, sizes, bucket_numel):
                params = sorted((plist[i] for i in run), key=order.__getitem__)
                layout, targets = self._layout(params)
                # Gradients accumulated in a wider dtype are reduced in it, as stage 0 does.
                wire = self.comm_dtype or (accum if accum is not None and not self.reduce_every_micro_step else dtype)
                bucket = _Bucket(len(self.buckets), layout, targets, self._direct_slice(params), wire,
                                 device=self.comm.device)
                self.buckets.append(bucket)
                for p in params:
                    self._bucket_of[p] = bucket
        self._position = {p: i for b in self.buckets for i, p in enumerate(b.layout.params)}
        self._buckets_cover_partition = sum(b.layout.segment for b in self.buckets) == sum(
            g.numel() for g in self.partition.flat_grad.values())
        self._armed = False
        self._reduced_since_step = False
        self._micro_steps = 0
        self._reset_buckets()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

    def _layout(self, params: list[torch.nn.Parameter]) -> tuple[RankMajorLayout, list[torch.Tensor]]:
        """The rank-major layout of a gradient bucket and the fp32 partition-gradient slots it fills."""
        layout = RankMajorLayout(params, [self.partition.fragments[p].spec for p in params], self.comm.world_size)
        return layout, [self.partition.slot(p, self.partition.flat_grad) for p in params]

    def _direct_slice(self, params: list[torch.nn.Parameter]) -> torch.Tensor | None:
        """The partition-gradient slice equal to this rank's segment of `params`, if they are neighbours."""
        if self.tier.staged or self.partition.grads_swapped:  # on the host, or in swap files
            return None
        frags = [self.partition.fragments[p] for p in params]
        for a, b in zip(frags, frags[1:]):
            if b.key != a.key or b.offset != a.offset + a.padded:
                return None
        grad = self.partition.flat_grad[frags[0].key]
        return grad.detach()[frags[0].offset:frags[-1].offset + frags[-1].padded]

    def _reset_buckets(self) -> None:
        self._next_launch = 0
        for b in self.buckets:
            b.send, b.pending, b.launched = None, len(b.layout.params), False
            b.packed.clear()

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        grad = param.grad
        repeat = self.arrivals.arrive(param, reducing=self._armed)
        if not self._armed:  # an accumulation micro-step of stage 1: the gradient stays
            if param in self._accum or (self._accum_dtype is not None and grad.dtype != self._accum_dtype):
                self._hold(param)
            return
        bucket = self._bucket_of[param]
        if param in bucket.packed:  # another piece of a gradient packed already (arrivals.py's note)
            if bucket.launched:
                raise self.arrivals.late_gradient(self.stage, param)
            bucket.layout.pack_one(self._position[param], grad, bucket.send, accumulate=True)
            param.grad = None
            bucket.deferred = True
            return
        if self.arrivals.discovering or bucket.deferred or self._reductions_wait_for_backward():  # packed at launch
            self._hold(param)  # (arrivals.py's note; stage 3: prefetch.py's note on reductions that wait)
            bucket.deferred |= repeat
            return
        self._pack(bucket, param, self._take_grad(param))
        bucket.pending -= 1
        while self._next_launch < len(self.buckets):
            nxt = self.buckets[self._next_launch]
            if nxt.pending > 0 or nxt.deferred:
                break
            self._launch(nxt)

    def _backward_anchors(self) -> list:
        """(gradient edge, zero gradient) pairs that backward runs from together with the loss (stage 3)."""
        return []

    def _reductions_wait_for_backward(self) -> bool:
        """Launch no bucket before this backward ends? (stage 3, when the ranks' paths differ)"""
        return False

    def _hold(self, param: torch.nn.Parameter) -> None:
        """Keep `param`'s gradient aside (in the accumulation dtype, if one is set) and drop `.grad`, so
        later pieces arrive in a fresh `.grad` and every hook sees only its own piece."""
        grad, acc = param.grad, self._accum.get(param)
        if acc is None:
            wide = self._accum_dtype is not None and grad.dtype != self._accum_dtype
            self._accum[param] = grad.to(self._accum_dtype) if wide else grad
        else:
            acc.add_(grad)
            self._accum[param] = acc  # a swapped store (grad_swap.HeldGradients) writes it back
        param.grad = None

    def _take_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """Everything `param` accumulated since the last reduction: held pieces and `.grad` (a parameter
        used in earlier micro-steps of stage 1 but not at the boundary still has its gradient here)."""
        grad, held = param.grad, self._accum.pop(param, None)
        param.grad = None
        if held is None:
            return grad
        return held.add_(grad) if grad is not None else held

    def with_accumulated_grad(self, param: torch.nn.Parameter, use) -> None:
        """`use(grad)` on `param`'s gradient accumulated since the last reduction, which may change it in
        place (a pipeline's sum of a tied weight over its tie group, engine/pipe/reduction.py): `.grad` and
        any held piece together, in the accumulation dtype where one is set (a wider one keeps it out of
        `.grad`), zeros where none arrived; kept aside, where the reduction takes it from."""
        grad = self._take_grad(param)
        if grad is None:
            grad = torch.zeros(param.shape, dtype=self._accum_dtype or param.dtype, device=param.device)
        use(grad)
        self._accum[param] = grad  # _take_grad finds it at the launch (a swapped store writes it back)

    def _pack(self, bucket: _Bucket, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        if bucket.send is None:  # every slot is written: packed (padding zeroed) or zeroed at launch
            bucket.send = torch.empty(bucket.layout.numel, dtype=bucket.send_dtype, device=bucket.device)
        bucket.layout.pack_one(self._position[param], grad, bucket.send)
        bucket.packed.add(param)

    def _launch(self, bucket: _Bucket) -> None:
        for i, p in enumerate(bucket.layout.params):
            if p in bucket.packed:
                continue
            grad = self._take_grad(p)
            if grad is not None:
                self._pack(bucket, p, grad)
            elif bucket.send is None:  # no parameter of this bucket got a gradient yet: zeros
                bucket.send = torch.zeros(bucket.layout.numel, dtype=bucket.send_dtype, device=bucket.device)
            else:  # this one got none: zeros in its slots
                bucket.layout.zero_one(i, bucket.send)
        bucket.launched = True
        self._next_launch = bucket.index + 1
        self._start_reduce(bucket, accumulate=self._reduced_since_step)
        bucket.send = None  # the in-flight reduction holds the only reference
        if not self.overlap:
            self.inflight.drain()

    def _start_reduce(self, bucket: _Bucket, accumulate: bool) -> None:
        """Reduce the packed send buffer; this rank's segment lands (averaged, fp32) in the partition gradient."""
        layout, send = bucket.layout, bucket.send
        if self.scaling.before != 1.0:
            send.mul_(self.scaling.before)
        direct = bucket.direct if not accumulate and send.dtype == torch.float32 else None
        if self.use_reduce_scatter:
            out = direct if direct is not None else torch.empty(layout.segment, dtype=send.dtype, device=send.device)
            work = self.comm.reduce_scatter(out, send, async_op=True)
        else:
            work = self.comm.all_reduce(send, async_op=True)
            out = send.view(self.comm.world_size, layout.segment)[self.comm.rank]

        def finish() -> None:
            if self.host_grads is not None:  # to the host partition (tier.py's note)
                self.host_grads.arrive(bucket.targets, layout, out, accumulate, self.scaling.after)
                return
            seg = out.float() if out.dtype != torch.float32 else out
            if self.scaling.after != 1.0:
                seg.mul_(self.scaling.after)
            if seg is direct:
                return
            land_slots(bucket.targets, layout.segment_slots(seg), accumulate)
        self.inflight.push(work, finish)

    # -- backward -----------------------------------------------------------------------------------
    def before_backward(self, boundary: bool) -> None:
        self._armed = self.reduce_every_micro_step or boundary
        if self._micro_steps == 0:
            for p in self.params:  # first micro-step of a window: drop what a user's zero_grad left behind
                p.grad = None

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward; in a reducing backward every remaining bucket is then reduced into the partition."""
        anchors = self._backward_anchors()  # stage 3 anchors every unit (anchors.py)
        if self._armed:
            self.arrivals.before_reducing_backward(loss, [edge.node for edge, _ in anchors])
        scale = self.guard.scaler.loss_scale
        loss = loss * scale if scale != 1.0 else loss
        backward_from(loss, anchors, retain_graph)
        self._micro_steps += 1
        if self._armed:
            self._reduce_remaining()

    def reduce_accumulated(self) -> None:
        """Reduce what backward passes run outside this optimizer left in `.grad` (a pipeline schedule's
        micro-batches), once: the tail of a reducing backward."""
        self._armed = True
        self._reduce_remaining()

    def _reduce_remaining(self) -> None:
        for bucket in self.buckets[self._next_launch:]:
            self._launch(bucket)
        self.inflight.drain()
        if self.host_grads is not None:
            self.host_grads.land()
        if self.grad_swap is not None:
            self.grad_swap.flush()
        self._reset_buckets()
        self._reduced_since_step = True
        self._armed = False
        self.arrivals.end_pass()

    def after_backward(self) -> None:
        pass  # backward() already reduced

    def gradient_bytes(self) -> int:
        """Bytes of gradient this rank holds: full gradients still in `.grad` or side tensors, and the fp32
        partition."""
        held = sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        held += sum(t.numel() * t.element_size() for t in self._accum.values())  # swapped: none
        return held + self.partition.num_bytes()["master_grad"]

    # -- the boundary step ---------------------------------------------------------------------
    def _grad_buffers(self) -> list[torch.Tensor]:
        """The in-memory partition gradients (none when they are swapped: grad_swap.py)."""
        return [] if self.grad_swap is not None else list(self.partition.flat_grad.values())

    def _global_norm(self, buffers: list[torch.Tensor]) -> float:
        """One all-reduce of the local sum of squares: every rank gets the same norm, and a NaN/Inf on
        any rank makes it non-finite everywhere (precision.py's note)."""
        sq = self.comm.zeros()  # on the collective's device (comm.py's note), not torch's default
        for b in buffers:  # in NORM_CHUNK ranges, as the swapped gradient is read (grad_swap.py's note)
            for s, e in norm_ranges(b.numel()) if b.numel() else ():
                sq += torch.linalg.vector_norm(b[s:e], dtype=torch.float32).square().to(sq.device)
        if self.grad_swap is not None:
            self.grad_swap.add_squares(sq)
        for p in self.counted_elsewhere:  # this rank's fragment of it, left out before the data sum
            slot = (self.grad_swap.slot(self.partition.fragments[p], unscaled=True) if self.grad_swap is not None
                    else self.partition.slot(p, self.partition.flat_grad))
            sq -= slot.float().square().sum().to(sq.device)
        self.comm.all_reduce(sq)
        if self.norm_reduce is not None:
            sq = self.norm_reduce(sq)
        return float(sq.sqrt())

    def step(self, step_number: int = 0) -> bool:
        """Unscale, check, clip, step this rank's partition, all-gather. Returns whether applied."""
        if self.nvme is None:
            return self._step(step_number)
        # The loss-scale check counts the step as clean before it runs (fp16: with loss_scale_window n the
        # scale grew a step early after a failure); a step undone on every rank (note: a step failed on
        # some rank) leaves the guard, the scaler and the reported norm as before it. A few scalars.
        guard, norm = self.guard.state_dict(), self.last_grad_norm
        try:
            return self._step(step_number)
        except BaseException as err:
            if err is self.nvme.failed or isinstance(err, PeerStepError):
                self.guard.load_state_dict(guard)
                self.last_grad_norm = norm
            raise

    def _step(self, step_number: int) -> bool:
        self.arrivals.check_unused(self.params, self.ignore_unused)
        buffers = self._grad_buffers()
        if not self._reduced_since_step:  # a step without a reducing backward: no gradient
            for b in buffers:
                b.zero_()
            if self.grad_swap is not None:
                self.grad_swap.zero()
        inv_scale = 1.0 / self.guard.scaler.loss_scale
        if inv_scale != 1.0:
            for b in buffers:
                b.mul_(inv_scale)
        if self.grad_swap is not None:  # applied as each range is read (grad_swap.py's note)
            self.grad_swap.unscale = inv_scale
        norm = self._global_norm(buffers)
        if self.grad_swap is not None:
            self.grad_swap.clip_to(norm, self.clip)
        try:
            applied = checked_step(self, buffers, norm, step_number)
        except BaseException as err:
            if not self._agrees_after_step() or err is not self.nvme.failed:
                raise
            self._agree_on_step(failed=2 if isinstance(err, PeerStepError) else 1)  # 2: a peer's (Lamb's pass 1)
            raise
        if applied:
            if self._agrees_after_step():
                self._agree_on_step(failed=0)
            self._gather_params()
        self.zero_grad()
        return applied

    def _agrees_after_step(self) -> bool:
        """Whether the ranks agree on the step's outcome right after it (note: a step failed on some rank):
        stage 3 agrees in its persistent refresh instead (stage3.py's note), over its data group, unless a
        pipeline's other stages must hear of it too (`step_status_comm`)."""
        return self.nvme is not None and (self.stage != 3 or self.step_status_comm is not None)

    def _agree_on_step(self, failed: int) -> None:
        """[Note: a step failed on some rank] With the optimizer on NVMe one rank's step can fail alone (a
        swap file's read or write; nvme_tier.py undoes it on that rank). Raised right there, it left the
        other ranks in the parameter all-gather after their step until the process group's timeout. So
        before that all-gather every rank gathers one status element (one tiny all-gather per step, NVMe
        offload only: no existing collective comes after the step and before the gather): where some rank
        failed, the ranks that applied the step undo it (nvme_tier.py's `revert_step`: two slots go back
        bit for bit; in place, the next step is refused until a load), nobody gathers, every rank drops the
        window's gradients and raises: the failing rank its own error, the others PeerStepError naming it.
        Training on equals a run without the batch. Under a pipeline the status is gathered over the world
        (`step_status_comm`: engine/pipe/stage_failure.py's note, a step failing on one stage), where the
        ranks that only heard of a failure inside the step (Lamb's first pass: nvme_per_tensor.py) send 2,
        so that the other stages name the rank that failed (`failed`: 0, 1 this rank's own, 2 a peer's)."""
        comm = self.comm if self.step_status_comm is None else self.step_status_comm
        send = comm.zeros(1, dtype=torch.int32)
        send.fill_(failed)
        out = comm.empty(comm.world_size, dtype=torch.int32)
        comm.all_gather(out, send)
        statuses = out.tolist()  # one host read per step (NVMe offload only)
        if not any(statuses):
            return
        self.zero_grad()  # the window's gradients, on every rank
        if failed:
            return  # the caller raises this rank's own error
        ranks = [r for r, s in enumerate(statuses) if s == 1] or [r for r, s in enumerate(statuses) if s]
        raise undo_for_peers(self.nvme, self.stage, ranks)

    @torch.no_grad()
    def _gather_params(self) -> None:
        """Updated master partitions → every rank's full model parameters, in all-gather buckets of at
        most GATHER_BUCKET_CAP elements (its note), two in flight."""
        gather = InFlight(depth=2)
        for key, start, stop, layout in self.gather_runs:
            send = self.tier.to_device(self.partition.store.read_image(key, start, stop), key[1])
            out = torch.empty(layout.numel, dtype=key[1], device=send.device)
            gather.push(self._gather_into(out, send),
                        lambda out=out, layout=layout: layout.unpack(out, [p.detach() for p in layout.params]))
        gather.drain()

    def _gather_into(self, out: torch.Tensor, send: torch.Tensor):
        """Start gathering every rank's `send` into `out` (rank-major); returns the work or None."""
        if self.use_all_gather:
            return self.comm.all_gather(out, send, async_op=True)
        # allgather_partitions: false — one broadcast per owning rank, as DeepSpeed does
        for r, part in enumerate(out.view(self.comm.world_size, -1)):
            if r == self.comm.rank:
                part.copy_(send)
            self.comm.broadcast(part, src=r)
        return None

    def zero_grad(self) -> None:
        if not self._buckets_cover_partition:  # else the first reduction overwrites every slot
            for g in self._grad_buffers():
                g.zero_()
            if self.grad_swap is not None:
                self.grad_swap.zero()
        for p in self.params:
            p.grad = None
        self._accum.clear()
        self.arrivals.end_window()
        self._reduced_since_step = False
        self._micro_steps = 0

    def log_suffix(self) -> str:
        return f" | loss scale {self.guard.scaler.loss_scale:g}" if self.guard.precision == "fp16" else ""

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "guard": self.guard.state_dict(),
                "world_size": self.comm.world_size,
                "master": [self.partition.store.read(k, 0, f.numel()).clone() for k, f in self.partition.flat.items()]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("world_size", self.comm.world_size) != self.comm.world_size:
            raise ValueError(f"this ZeRO-{self.stage} state was saved by {state['world_size']} ranks, this run has "
                             f"{self.comm.world_size}; resharding is done by checkpoint loading, not here")
        with torch.no_grad():  # before the optimizer's state: NVMe offload writes both to its swap files
            for key, saved in zip(self.partition.flat, state["master"]):
                self.partition.store.write(key, 0, saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.guard.load_state_dict(state["guard"])
        self._gather_params()
