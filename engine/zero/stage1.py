"""ZeRO stage 1: optimizer state (and fp32 master weights) partitioned across data-parallel ranks.

Memory per rank (Ψ parameters, N ranks, Adam): model weights and full gradients as stage 0, plus
12Ψ/N bytes of fp32 master weights, exp_avg and exp_avg_sq (padding aside; partition.py).
Communication per step: gradients are reduce-scattered once, at the accumulation boundary, into the
rank's partition (Ψ), and the updated partitions are all-gathered back into the model (Ψ): the 2Ψ of
stage 0's all-reduce (ZeRO paper §7). Accumulation micro-steps communicate nothing.

`PartitionedZeroOptimizer` holds everything stages 1 and 2 share (partition, norm, clipping, the
optimizer step, all-gather, state, the `safe_get_full_*` queries); the stages differ only in how
gradients reach the fp32 partition gradient: here through stage 0's flat `GradientBuckets`.

[Note: reduce-scatter on gloo] Measured here (2 ranks, 20 MB): all_reduce 25 ms, reduce_scatter 40-44
ms (list and tensor forms alike), all_gather 20-26 ms. Gloo's reduce-scatter is no cheaper than its
all-reduce, so all-reduce + slice would be faster on this backend; we still reduce-scatter because it
is the op with half the bytes on every other backend (NCCL) and it keeps stages 0-2 at the same 2Ψ
volume. `zero_optimization.reduce_scatter: false` selects all-reduce + slice.
"""
from __future__ import annotations

import torch

from ..comm import Communicator
from ..precision import DTYPES, NonFiniteGuard
from .buckets import Bucket, GradientBuckets
from .partition import InFlight, PartitionedParams, RankMajorLayout
from .stage0 import clip_, reduction_settings


class PartitionedZeroOptimizer:
    """Shared machinery of ZeRO stages 1 and 2; subclasses feed `self.partition.flat_grad`."""

    stage = -1

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Communicator, guard: NonFiniteGuard, *,
                 reduce_bucket_numel: int, allgather_bucket_numel: int, overlap_comm: bool,
                 gradient_clipping: float, prescale_gradients: bool = False,
                 gradient_predivide_factor: float = 1.0, communication_data_type: str | None = None,
                 grad_accum_dtype: str | None = None, reduce_scatter: bool = True,
                 allgather_partitions: bool = True):
        self.optimizer = optimizer
        self.comm = comm
        self.guard = guard
        self.clip, self.scaling, self.comm_dtype = reduction_settings(
            comm.world_size, gradient_clipping, prescale_gradients, gradient_predivide_factor, communication_data_type)
        self.use_reduce_scatter = reduce_scatter
        self.use_all_gather = allgather_partitions
        self.overlap = overlap_comm
        self.partition = PartitionedParams(optimizer, comm.world_size, comm.rank)
        self.params = self.partition.params()
        self.gather_runs = self.partition.gather_runs(max(1, int(allgather_bucket_numel)))
        self.inflight = InFlight(depth=2)
        self.last_grad_norm: float | None = None
        self._init_gradients(max(1, int(reduce_bucket_numel)), grad_accum_dtype)

    def _init_gradients(self, bucket_numel: int, grad_accum_dtype: str | None) -> None:
        raise NotImplementedError

    # -- gradient reduction into the partition -------------------------------------------------
    def _layout(self, params: list[torch.nn.Parameter]) -> tuple[RankMajorLayout, list[torch.Tensor]]:
        """The rank-major layout of a gradient bucket and the fp32 partition-gradient slots it fills."""
        layout = RankMajorLayout(params, [self.partition.fragments[p].spec for p in params], self.comm.world_size)
        return layout, [self.partition.slot(p, self.partition.flat_grad) for p in params]

    def _start_reduce(self, layout: RankMajorLayout, send: torch.Tensor, targets: list[torch.Tensor],
                      accumulate: bool) -> None:
        """Reduce the packed `send` buffer; this rank's segment lands (averaged, fp32) in `targets`."""
        if self.scaling.before != 1.0:
            send.mul_(self.scaling.before)
        if self.use_reduce_scatter:
            out = torch.empty(layout.segment, dtype=send.dtype, device=send.device)
            work = self.comm.reduce_scatter(out, send, async_op=True)
        else:
            work = self.comm.all_reduce(send, async_op=True)
            out = send.view(self.comm.world_size, layout.segment)[self.comm.rank]

        def finish() -> None:
            seg = out.float() if out.dtype != torch.float32 else out
            if self.scaling.after != 1.0:
                seg.mul_(self.scaling.after)
            slots = layout.segment_slots(seg)
            if accumulate:
                torch._foreach_add_(targets, slots)
            else:
                torch._foreach_copy_(targets, slots)
        self.inflight.push(work, finish)

    # -- backward (subclasses) ------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        scale = self.guard.scaler.loss_scale
        (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)

    # -- the boundary step ---------------------------------------------------------------------
    def _grad_buffers(self) -> list[torch.Tensor]:
        return list(self.partition.flat_grad.values())

    def _global_norm(self, buffers: list[torch.Tensor]) -> float:
        """One all-reduce of the local sum of squares: every rank gets the same norm, and a NaN/Inf on
        any rank makes it non-finite everywhere (precision.py's note)."""
        sq = torch.zeros((), dtype=torch.float32)
        for b in buffers:
            if b.numel():
                sq += torch.linalg.vector_norm(b, dtype=torch.float32).square()
        self.comm.all_reduce(sq)
        return float(sq.sqrt())

    def step(self, step_number: int = 0) -> bool:
        """Unscale, check, clip, step this rank's partition, all-gather. Returns whether applied."""
        buffers = self._grad_buffers()
        inv_scale = 1.0 / self.guard.scaler.loss_scale
        if inv_scale != 1.0:
            for b in buffers:
                b.mul_(inv_scale)
        norm = self._global_norm(buffers)
        self.last_grad_norm = norm
        applied = self.guard.check(norm, step_number)
        if applied:
            if self.clip > 0:
                clip_(buffers, norm, self.clip)
            self.optimizer.step()
            self._gather_params()
        self.zero_grad()
        return applied

    @torch.no_grad()
    def _gather_params(self) -> None:
        """Updated master partitions → every rank's full model parameters, in all-gather buckets."""
        world, rank = self.comm.world_size, self.comm.rank
        gather = InFlight(depth=2)
        for key, start, stop, layout in self.gather_runs:
            send = self.partition.flat[key].detach()[start:stop].to(key[1])
            out = torch.empty(layout.numel, dtype=key[1], device=send.device)
            if self.use_all_gather:
                work = self.comm.all_gather(out, send, async_op=True)
            else:  # allgather_partitions: false — one broadcast per owning rank, as DeepSpeed does
                work = None
                for r, part in enumerate(out.view(world, layout.segment)):
                    if r == rank:
                        part.copy_(send)
                    self.comm.broadcast(part, src=r)
            gather.push(work, lambda out=out, layout=layout: layout.unpack(out, [p.detach() for p in layout.params]))
        gather.drain()

    def zero_grad(self) -> None:
        for g in self.partition.flat_grad.values():
            g.zero_()

    def log_suffix(self) -> str:
        return f" | loss scale {self.guard.scaler.loss_scale:g}" if self.guard.precision == "fp16" else ""

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "guard": self.guard.state_dict(),
                "world_size": self.comm.world_size,
                "master": [f.detach().clone() for f in self.partition.flat.values()]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("world_size", self.comm.world_size) != self.comm.world_size:
            raise ValueError(f"this ZeRO-{self.stage} state was saved by {state['world_size']} ranks, this run has "
                             f"{self.comm.world_size}; resharding is done by checkpoint loading, not here")
        self.optimizer.load_state_dict(state["optimizer"])
        self.guard.load_state_dict(state["guard"])
        with torch.no_grad():
            for flat, saved in zip(self.partition.flat.values(), state["master"]):
                flat.copy_(saved)
        self._gather_params()

    # -- full tensors from the fragments (engine.utils.safe_get_full_*) -----------------------------
    def _gather_full(self, param: torch.nn.Parameter, flat: torch.Tensor) -> torch.Tensor:
        """Collective: the full fp32 tensor of `param` from every rank's slot in `flat`."""
        frag = self.partition.fragments[param]
        layout = RankMajorLayout([param], [frag.spec], self.comm.world_size)
        send = flat.detach()[frag.offset:frag.offset + frag.padded].float().contiguous()
        out = torch.empty(layout.numel, dtype=torch.float32, device=send.device)
        self.comm.all_gather(out, send)
        full = torch.empty(param.shape, dtype=torch.float32, device=send.device)
        layout.unpack(out, [full])
        return full

    def owns(self, param: torch.nn.Parameter) -> bool:
        return param in self.partition.fragments

    def full_fp32_param(self, param: torch.nn.Parameter) -> torch.Tensor:
        return self._gather_full(param, self.partition.flat[self.partition.fragments[param].key])

    def full_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The reduced, averaged, unscaled gradient (valid between backward at the boundary and step)."""
        grad = self._gather_full(param, self.partition.flat_grad[self.partition.fragments[param].key])
        return grad / self.guard.scaler.loss_scale

    def full_optimizer_state(self, param: torch.nn.Parameter, name: str):
        flat = self.partition.flat[self.partition.fragments[param].key]
        value = self.optimizer.state.get(flat, {}).get(name)
        if isinstance(value, torch.Tensor) and value.shape == flat.shape:
            return self._gather_full(param, value)
        # Per-tensor state (e.g. Adam's step) or absent; a copy, since the optimizer updates it in place.
        return value.clone() if isinstance(value, torch.Tensor) else value


class ZeroStage1Optimizer(PartitionedZeroOptimizer):
    """Stage 1: full gradients accumulate locally (stage 0's buckets); reduce-scatter at the boundary."""

    stage = 1

    def _init_gradients(self, bucket_numel: int, grad_accum_dtype: str | None) -> None:
        self.buckets = GradientBuckets(self.params, bucket_numel, self._reduce_bucket, overlap=self.overlap,
                                       grad_dtype=DTYPES[grad_accum_dtype] if grad_accum_dtype else None)
        self._layouts: dict[int, tuple] = {}

    def _reduce_bucket(self, bucket: Bucket):
        if bucket.index not in self._layouts:
            self._layouts[bucket.index] = self._layout(bucket.params)
        layout, targets = self._layouts[bucket.index]
        send = torch.empty(layout.numel, dtype=self.comm_dtype or bucket.dtype, device=bucket.buffer.device)
        layout.pack([self.buckets.views[p] for p in bucket.params], send)
        self._start_reduce(layout, send, targets, accumulate=False)
        return None, None  # waited by self.inflight (bounded), not by the buckets

    def before_backward(self, boundary: bool) -> None:
        if boundary:
            self.buckets.arm()
        else:
            self.buckets.attach()

    def after_backward(self) -> None:
        self.buckets.flush_and_wait()
        self.inflight.drain()

    def zero_grad(self) -> None:
        super().zero_grad()
        self.buckets.zero()
