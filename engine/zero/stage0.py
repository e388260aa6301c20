"""ZeRO stage 0: plain data parallelism. Every rank holds all parameters, gradients and optimizer
state; gradients are all-reduced in buckets as backward produces them (or right after it).
With fp16/bf16 the optimizer steps fp32 master copies (`MasterWeights`)."""
from __future__ import annotations

import torch

from ops import PowerSGD
from offload.huge_pages import adopt_state

from ..comm import Communicator
from ..precision import DTYPES, NonFiniteGuard
from .arrivals import ArrivalLog, is_dense
from .buckets import Bucket, GradientBuckets
from .master import MasterWeights


class GradientScaling:
    """DeepSpeed's pre/post division around the all-reduce (`engine.allreduce_bucket`).

    postscale (default): grad *= 1/predivide before, *= predivide/world after — keeps fp16 sums in range
    while dividing once. prescale_gradients: grad *= 1/world before, nothing after.
    """

    def __init__(self, world_size: int, prescale: bool, predivide: float):
        if prescale:
            self.before, self.after = 1.0 / world_size, 1.0
        else:
            self.before, self.after = 1.0 / predivide, predivide / world_size


def reduction_settings(world_size: int, gradient_clipping: float, prescale_gradients: bool,
                       gradient_predivide_factor: float, communication_data_type: str | None):
    """(clip bound, GradientScaling, dtype on the wire or None): the reduction knobs every stage reads."""
    comm_dtype = DTYPES[communication_data_type] if communication_data_type else None
    return (float(gradient_clipping or 0.0),
            GradientScaling(world_size, prescale_gradients, gradient_predivide_factor), comm_dtype)


def global_norm(buffers: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """L2 norm over flat fp32 buffers, on `device`: one reduction per buffer, one host sync for the caller."""
    norms = [torch.linalg.vector_norm(b, dtype=torch.float32).to(device) for b in buffers if b.numel()]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), device=device)


def clip_(buffers: list[torch.Tensor], total_norm: float, max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_'s rule: scale by max_norm/(norm+1e-6) when that is below 1."""
    coef = clip_coefficient(total_norm, max_norm)
    if coef is not None:
        for b in buffers:
            b.mul_(coef)


def clip_coefficient(total_norm: float, max_norm: float) -> float | None:
    """The factor clip_ scales by, or None when it leaves the gradients alone."""
    coef = max_norm / (total_norm + 1e-6)
    return coef if coef < 1.0 else None


def checked_step(zopt, buffers: list[torch.Tensor], norm: float, step_number: int) -> bool:
    """What every stage does once the global norm is known: record it, let the guard decide (NaN/Inf,
    loss scale), clip and step the optimizer. Returns whether the step was applied."""
    zopt.last_grad_norm = norm
    applied = zopt.guard.check(norm, step_number)
    if applied:
        if zopt.clip > 0:
            clip_(buffers, norm, zopt.clip)
        nvme = getattr(zopt, "nvme", None)  # offload_optimizer.device "nvme": the swapped step (nvme_tier.py)
        (nvme or zopt.optimizer).step()
        if nvme is None:
            adopt_state(zopt.optimizer)  # state made by this (first) step onto huge pages (huge_pages.py)
    return applied


class DataParallelOptimizer:
    """Owns the gradients of `optimizer`'s parameters and the boundary step for stage 0."""

    stage = 0
    norm_reduce = None  # a pipeline's: this stage's norm² → the world's (engine/pipe/reduction.py)
    counted_elsewhere = ()  # parameters another model-parallel rank counts in the norm (tensor_parallel/norm.py)

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Communicator, guard: NonFiniteGuard, *,
                 bucket_numel: int, overlap_comm: bool, gradient_clipping: float,
                 prescale_gradients: bool = False, gradient_predivide_factor: float = 1.0,
                 communication_data_type: str | None = None, grad_accum_dtype: str | None = None,
                 ignore_unused_parameters: bool = True, param_names: dict | None = None):
        self.optimizer = optimizer
        self.comm = comm
        self.guard = guard
        self.clip, self.scaling, self.comm_dtype = reduction_settings(
            comm.world_size, gradient_clipping, prescale_gradients, gradient_predivide_factor, communication_data_type)
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        for p in self.params:
            if not is_dense(p):  # a strided slice: its gradient view must share its layout (buckets.py)
                p.data = p.data.contiguous()
        self.arrivals = ArrivalLog(param_names)
        self.ignore_unused = ignore_unused_parameters
        # [Note: optimizers that communicate themselves] A 1-bit optimizer (ops.CompressedOptimizer)
        # averages its momentum itself once warm-up ends. Before each boundary backward it says whether
        # the coming step needs averaged gradients; when not, the buckets are left local (no double
        # communication) and only the grad norm's square crosses the wire, so all ranks agree on skips.
        self.self_communicating = getattr(optimizer, "communicates_itself", False)
        if self.self_communicating and optimizer.comm is None:
            optimizer.comm = comm
        self.engine_all_reduce = True
        self.powersgd = None  # ops.PowerSGD: the bucket reducer when `gradient_compression` is set
        self.buckets = GradientBuckets(self.params, bucket_numel, self._reduce_bucket, overlap=overlap_comm,
                                       grad_dtype=DTYPES[grad_accum_dtype] if grad_accum_dtype else None,
                                       arrivals=self.arrivals)
        needs_master = any(p.dtype != torch.float32 for p in self.params)
        self.master = MasterWeights(optimizer, self.buckets) if needs_master else None
        self.last_grad_norm: float | None = None

    @property
    def reductions_keep_state(self) -> bool:
        """Whether a gradient reduction leaves state for later steps (PowerSGD's error feedback and warm-start
        Q): a batch that is dropped must then be known before its reductions run (pipe/stage_failure.py)."""
        return self.powersgd is not None

    def enable_gradient_compression(self, cfg) -> None:
        """PowerSGD (`gradient_compression`, dstrain's key) replaces the exact all-reduce after start_step."""
        self.powersgd = PowerSGD(self.comm, rank=cfg.rank, start_step=cfg.start_step)

    def _reduce_bucket(self, bucket: Bucket):
        if not self.engine_all_reduce:
            return None, None  # the optimizer averages (compressed) itself this step
        if self.powersgd is not None and self.powersgd.compressing:
            # PowerSGD returns the mean; pre/post division would give the same mean, so it is not applied.
            self.powersgd.reduce_(bucket.index, bucket.buffer, [p.shape for p in bucket.params])
            return None, None
        return self._all_reduce_bucket(bucket)

    def _all_reduce_bucket(self, bucket: Bucket):
        buf = bucket.buffer
        send = buf if self.comm_dtype in (None, buf.dtype) else buf.to(self.comm_dtype)
        if self.scaling.before != 1.0:
            send.mul_(self.scaling.before)
        work = self.comm.all_reduce(send, async_op=True)

        def finish() -> None:
            if send is not buf:
                buf.copy_(send)
            if self.scaling.after != 1.0:
                buf.mul_(self.scaling.after)
        return work, finish

    # -- backward ------------------------------------------------------------------------------
    def before_backward(self, boundary: bool) -> None:
        if boundary:
            self.engine_all_reduce = not self.self_communicating or self.optimizer.needs_gradient_all_reduce()
            self.buckets.arm()
        else:
            self.buckets.attach()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        if self.buckets.armed:
            self.arrivals.before_reducing_backward(loss)
        scale = self.guard.scaler.loss_scale
        (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)

    def after_backward(self) -> None:
        self.buckets.flush_and_wait()

    def reduce_accumulated(self) -> None:
        """All-reduce what backward passes run outside this optimizer accumulated (a pipeline's)."""
        self.before_backward(True)
        self.after_backward()

    def with_accumulated_grad(self, param: torch.nn.Parameter, use) -> None:
        """`use(grad)` on `param`'s gradient accumulated since the last reduction, in place (partitioned.py's
        method of the same name): its view of the bucket flat, which a gradient of a wider accumulation
        dtype reaches through the hook, not `.grad`."""
        self.buckets.attach()  # a `.grad` a user's zero_grad replaced is copied into its view
        use(self.buckets.views[param])

    # -- the boundary step ---------------------------------------------------------------------
    def _grad_buffers(self) -> list[torch.Tensor]:
        if self.master is not None:
            self.master.load_grads(1.0 / self.guard.scaler.loss_scale)
            return self.master.grad_buffers()
        return list(self.buckets.flat.values())

    def step(self, step_number: int = 0) -> bool:
        """Unscale, check, clip and apply the optimizer. Returns whether the step was applied."""
        self.arrivals.check_unused(self.params, self.ignore_unused)
        buffers = self._grad_buffers()
        if not self.engine_all_reduce:
            norm = self._rms_local_norm(buffers)
        elif self.norm_reduce is not None:
            square = global_norm(buffers, self.comm.device).square() - self._square_counted_elsewhere()
            norm = float(self.norm_reduce(square).sqrt())
        else:
            norm = float(global_norm(buffers, self.comm.device))
        applied = checked_step(self, buffers, norm, step_number)
        if applied and self.master is not None:
            self.master.copy_to_model()
        if self.powersgd is not None:
            self.powersgd.finish_step()
        self.zero_grad()
        return applied

    def _square_counted_elsewhere(self) -> torch.Tensor:
        """norm² of the reduced, unscaled gradients of `counted_elsewhere` (their `.grad` views the buckets)."""
        square = self.comm.zeros()
        inv_scale = 1.0 / self.guard.scaler.loss_scale
        for p in self.counted_elsewhere:
            if p.grad is not None:
                square += (p.grad.detach().float() * inv_scale).square().sum().to(square.device)
        return square

    def _rms_local_norm(self, buffers: list[torch.Tensor]) -> float:
        """Gradients left local: √(mean over ranks of local norm²), the same value on every rank (a
        non-finite gradient anywhere makes it non-finite everywhere). One float on the wire."""
        square = global_norm(buffers, self.comm.device).square().reshape(1)
        self.comm.all_reduce(square)
        return float((square / self.comm.world_size).sqrt())

    def zero_grad(self) -> None:
        self.arrivals.end_window()
        self.buckets.zero()
        if self.master is not None:
            for g in self.master.grad_buffers():
                g.zero_()

    def log_suffix(self) -> str:
        return f" | loss scale {self.guard.scaler.loss_scale:g}" if self.guard.precision == "fp16" else ""

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "guard": self.guard.state_dict(),
                "master": [m.detach().clone() for m in self.master.master_params] if self.master else None,
                "powersgd": self.powersgd.state_dict() if self.powersgd is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.guard.load_state_dict(state["guard"])
        if self.powersgd is not None and state.get("powersgd") is not None:
            self.powersgd.load_state_dict(state["powersgd"])
        if self.master is not None and state.get("master") is not None:
            with torch.no_grad():
                for m, saved in zip(self.master.master_params, state["master"]):
                    m.copy_(saved)
            self.master.copy_to_model()
