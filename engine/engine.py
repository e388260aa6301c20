"""`Engine`: the object a training loop talks to. It runs forward, backward and step, and delegates:
gradient reduction, precision and the optimizer step to the ZeRO optimizer of the configured stage,
schedules to the LR scheduler, logging to `monitor`. It holds no config accessors: components get
their typed config sections when `initialize()` builds them.
"""
from __future__ import annotations

import contextlib
import gc

import torch

from . import heartbeat
from .batch_size import set_train_batch_size, set_train_micro_batch_size
from .compile import compile_module
from .offload_states import OffloadedStates
from .dist import global_rank
from .monitor import StepLogger, Timers
from .checkpoint.restore import restore_counters
from .zero import release_storage
from .monitors.training_metrics import TrainingMetrics


class Engine(torch.nn.Module):
    """Wraps the user's module; `initialize()` builds it. Public names follow DeepSpeed's engine."""

    def __init__(self, module: torch.nn.Module, zero_optimizer, lr_scheduler, dataloader, config, comm):
        super().__init__()
        self.module = module
        self.zero_optimizer = zero_optimizer
        self.optimizer = zero_optimizer.optimizer if zero_optimizer is not None else None
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = dataloader
        self.config = config
        self.comm = comm
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._boundary_override: bool | None = None
        self._in_no_sync = False
        self._last_loss: torch.Tensor | None = None
        self._offloaded = OffloadedStates(self)  # engine.offload_states() (offload_states.py)
        # frozen when the optimizer's partitions and buckets were built (_check_still_frozen)
        self._frozen_at_build = [p for p in module.parameters() if not p.requires_grad]
        self._trained: frozenset | None = None  # the parameters the ZeRO optimizer trains (zero_grad)
        # fp16.auto_cast (DeepSpeed): floating-point inputs are cast to the fp16 weights' dtype.
        self._cast_inputs = torch.float16 if config.fp16.enabled and config.fp16.auto_cast else None
        # The FLOPs profiler reports the breakdown too, as DeepSpeed's turns wall_clock_breakdown on.
        self.timers = Timers(config.wall_clock_breakdown or config.flops_profiler.enabled, comm.device)
        # Global rank 0, as the monitors: with pipeline or tensor parallelism several processes are
        # data-parallel rank 0, and each printed the step line (the output grew with the model degree).
        self.logger = StepLogger(config.steps_per_print, global_rank(), config.train_batch_size)
        self.metrics = TrainingMetrics(config, comm, module)  # engine/monitors: monitors, MFU, profiler
        self.monitor = self.metrics.monitor  # DeepSpeed's `engine.monitor.write_events([...])`

    # [Note: window start] Setting `micro_steps` (here, a checkpoint's restore_counters) starts an
    # accumulation window there, and so does a batch-size change (batch_size.py): the boundary is
    # counted from the window's start, not from micro-step 0, so a new gradient_accumulation_steps
    # gives whole windows of the new size whatever the micro-steps before it.
    @property
    def micro_steps(self) -> int:
        return self._micro_steps

    @micro_steps.setter
    def micro_steps(self, value: int) -> None:
        self._micro_steps = self._window_start = value

    def start_window(self) -> None:
        self._window_start = self._micro_steps

    def micro_steps_in_window(self) -> int:
        """Micro-steps taken in the current accumulation window (0 at a boundary)."""
        return (self._micro_steps - self._window_start) % self.config.gradient_accumulation_steps

    @property
    def device(self) -> torch.device:
        """Where the model and every collective's buffers live (DeepSpeed's `engine.device`)."""
        return self.comm.device

    # -- the training loop -------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._offloaded.require_for_forward()
        self.timers.start("forward")
        if self._cast_inputs is not None:
            args, kwargs = _cast_floating((args, kwargs), self._cast_inputs)
        with self.metrics.forward_context(self.global_steps, args, kwargs):
            out = self.module(*args, **kwargs)
        self.timers.stop("forward")
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backpropagate `loss / gradient_accumulation_steps`; at the boundary, reduce gradients."""
        self._require_optimizer("backward")
        boundary = self.is_gradient_accumulation_boundary() and not self._in_no_sync
        self.zero_optimizer.before_backward(boundary)
        gas = self.config.gradient_accumulation_steps
        scaled = loss / gas if scale_wrt_gas and gas > 1 else loss
        self.timers.start("backward")
        self.zero_optimizer.backward(scaled, retain_graph=retain_graph)
        self.timers.stop("backward")
        if boundary:
            self.timers.start("allreduce")
            self.zero_optimizer.after_backward()
            self.timers.stop("allreduce")
        self._last_loss = loss.detach()
        self.metrics.record_loss(self._last_loss)
        return loss

    def step(self) -> None:
        """Call after every micro-batch; acts only at the gradient-accumulation boundary."""
        self._require_optimizer("step")
        if self._in_no_sync:
            raise RuntimeError("engine.step() was called inside engine.no_sync(); leave the context first")
        if self.is_gradient_accumulation_boundary():
            try:
                self._boundary_step()
            except BaseException:
                self._drop_window()
                raise
        self._micro_steps += 1
        self._boundary_override = None

    def _drop_window(self) -> None:
        """A boundary step that raised (a client optimizer's check, a swap file that failed on some rank)
        drops its window, so that training on is a run without that batch: the window's gradients go and
        the next micro-step starts a new window (before, it ended the window the failed step had ended,
        stepping on one micro-batch's gradient added to the failed window's)."""
        self._micro_steps -= self.micro_steps_in_window()
        self._boundary_override = None
        self.zero_optimizer.zero_grad()

    def _boundary_step(self) -> None:
        """The optimizer step at an accumulation boundary, the LR schedule, counters, log, saving."""
        self._check_still_frozen()
        self.timers.start("step")
        try:
            self._step_applied = self.zero_optimizer.step(self.global_steps + 1)
        except BaseException:  # nothing counted: the window's losses and times go with it
            self.metrics.drop_window()
            self.timers.step_totals_and_reset()
            raise
        finally:
            self.timers.stop("step")
        if self._step_applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            self.skipped_steps += 1
        self.global_steps += 1
        self.global_samples += self.config.train_batch_size
        heartbeat.beat(self.global_steps)
        self.metrics.after_step(self, self.timers.step_totals_and_reset())
        self._maybe_log()
        if self.config.checkpoint.save_interval:  # periodic saving (engine/checkpoint)
            self.checkpoint_io.after_step()

    def _check_still_frozen(self) -> None:
        """A parameter frozen at initialize() has no place in the ZeRO partitions or gradient buckets,
        which are built once: unfrozen later, stage 0 stepped it with each rank's own gradient (the
        ranks drift apart) and stages 1-3 never (both silently). Said instead, naming it."""
        thawed = [p for p in self._frozen_at_build if p.requires_grad]
        if thawed:
            names = {id(p): n for n, p in self.module.named_parameters()}
            listed = ", ".join(names.get(id(p), "?") for p in thawed[:3]) + (" ..." if len(thawed) > 3 else "")
            raise RuntimeError(f"parameter {listed} was frozen (requires_grad=False) when engine.initialize() built "
                               "the optimizer and is trainable now; dstrain partitions and buckets the trainable "
                               "parameters once, there: unfreeze before initialize() (a frozen stretch can keep "
                               "lr 0 in a param group of its own), or build a new engine after unfreezing")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The gradients of the parameters the engine trains are the engine's: it zeroes them after each
        optimizer step, and within an accumulation window they hold the window so far, at every stage
        (a torch habit's `zero_grad()` after each `step()` call dropped the window's earlier micro-steps
        where they still sat in `.grad`: stage 1, and stage 0 with set_to_none=False). Other parameters
        are zeroed as `nn.Module.zero_grad` does."""
        if self._trained is None:  # fixed at initialize(), as the partitions and buckets are
            self._trained = frozenset(self.zero_optimizer.params) if self.zero_optimizer is not None else frozenset()
        for p in self.module.parameters():
            if p.grad is None or p in self._trained:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()

    def _maybe_log(self) -> None:
        if not self.logger.due(self.global_steps):
            return
        loss = float(self._last_loss) if self._last_loss is not None else None
        breakdown = self.timers.means_and_reset() if self.timers.enabled else None
        self.logger.log(self.global_steps, loss, self.get_lr(), self.skipped_steps, breakdown,
                        self.zero_optimizer.log_suffix() + self.metrics.log_suffix())

    def log_scalars(self, scalars: dict[str, float], step: int | None = None) -> None:
        """Write user scalars `{tag: value}` to the configured monitors (rank 0 only; a no-op without
        monitors), at `step` or the engine's x-axis, global samples."""
        at = self.global_samples if step is None else step
        self.monitor.write_events([(tag, value, at) for tag, value in scalars.items()])

    def _require_optimizer(self, what: str) -> None:
        if self.zero_optimizer is None:
            raise RuntimeError(f"engine.{what}() needs an optimizer: set \"optimizer\" in the config "
                               "or pass optimizer= to engine.initialize()")
        self._offloaded.require(what)  # backward, step, a pipeline's train_batch read every state

    # -- accumulation ---------------------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return self.micro_steps_in_window() + 1 == self.config.gradient_accumulation_steps

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary for the current micro-step (DeepSpeed's name and meaning)."""
        self._boundary_override = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside skip gradient reduction; step() inside is an error."""
        previous, self._in_no_sync = self._in_no_sync, True
        try:
            yield
        finally:
            self._in_no_sync = previous

    # -- queries --------------------------------------------------------------------------------
    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_global_grad_norm(self) -> float | None:
        return self.zero_optimizer.last_grad_norm if self.zero_optimizer is not None else None

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """New global batch: gradient_accumulation_steps changes, the micro-batch stays (batch_size.py)."""
        set_train_batch_size(self, train_batch_size)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """New micro-batch: gradient_accumulation_steps stays, train_batch_size follows (batch_size.py)."""
        set_train_micro_batch_size(self, micro_batch_size)

    # -- compilation (engine/compile.py) ------------------------------------------------------------
    def compile(self, backend: str = "inductor", compile_kwargs: dict | None = None, schedule=None,
                compiled_autograd_enabled: bool = False) -> None:
        """Compile the module in place with torch.compile (DeepSpeed's `engine.compile`; engine/compile.py)."""
        compile_module(self, backend, compile_kwargs, schedule, compiled_autograd_enabled)

    @property
    def is_compiled(self) -> bool:
        return getattr(self, "_compiled", False)

    # -- memory between phases (RLHF, evaluation) --------------------------------------------------
    def empty_partition_cache(self) -> None:
        """ZeRO-3: release every gathered parameter, back to this rank's partition (a no-op at other
        stages, as in DeepSpeed). A forward in training mode with grad enabled keeps its parameters gathered
        for a backward (an evaluation or generation forward in that mode, a loss computed only to be logged):
        released here, not at the next forward. A backward that does follow gathers them again (the same
        gradients, bit for bit). Groups a `GatheredParameters` block holds stay; unlike DeepSpeed, persistent
        parameters (below `stage3_param_persistence_threshold`) stay full, as they are between every step."""
        coordinator = getattr(self.zero_optimizer, "coordinator", None)  # only stage 3 has one
        if coordinator is None:
            return
        coordinator.end_pass()  # what the next forward does to a pass without backward (zero/prefetch.py)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the released blocks back to the device, as DeepSpeed does

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> dict[str, int]:
        """Move ZeRO-1/2/3 states (`include`: OffloadStateTypeEnum values; None: all) off the accelerator to
        host memory (DeepSpeed's call; engine/offload_states.py). Returns the bytes moved per state."""
        return self._offloaded.offload(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> dict[str, int]:
        """Bring back what `offload_states` moved, bit for bit. Returns the bytes moved per state."""
        return self._offloaded.reload(non_blocking)

    # -- checkpoints (engine/checkpoint; docs/checkpoints.md) ------------------------------------
    @property
    def checkpoint_io(self):
        """The engine's save/load `Checkpointing` (built on first use: it owns the checkpoint process
        group). Not `checkpointing`: that name is activation checkpointing (`engine.checkpointing`)."""
        if getattr(self, "_checkpoint_io", None) is None:
            from .checkpoint import Checkpointing
            self._checkpoint_io = Checkpointing(self)
        return self._checkpoint_io

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True) -> bool:
        """Call on every rank. Each rank writes its shards; the tag (default `global_step{N}`) becomes
        visible, and `latest` names it, only once every rank finished. Returns True."""
        self._offloaded.require("save_checkpoint")
        return self.checkpoint_io.save(save_dir, tag, client_state, save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False):
        """Call on every rank, at any world size and ZeRO stage. Returns (path, client_state), or
        (None, None) with a warning when there is no checkpoint to load."""
        self._offloaded.require("load_checkpoint")
        loaded = self.checkpoint_io.load(load_dir, tag, load_module_strict, load_optimizer_states,
                                         load_lr_scheduler_states, load_module_only)
        # The step log's rate counts from the load's end: restore_counters rebased it mid-load, so the
        # first line after a resume counted the rest of the load (verification, RNG, the ranks' wait)
        # as training time; on a loaded machine that halved the logged samples/s.
        self.logger.rebase(self.global_steps)
        return loaded

    def wait_for_checkpoint(self) -> None:
        """Block until an async save (`checkpoint.async_save`) is committed; re-raise its error."""
        if getattr(self, "_checkpoint_io", None) is not None:
            self._checkpoint_io.wait()

    def destroy(self) -> None:
        """The end of training (DeepSpeed's `engine.destroy()`): waits for an async checkpoint save,
        removes the gradient hooks, destroys the process groups this engine created (the checkpoint
        group, stage 3's gather group) and lets gloo's worker threads finish (engine/teardown.py).
        The default process group stays: `torch.distributed.destroy_process_group()` is the user's."""
        self.wait_for_checkpoint()
        self.monitor.close()
        zopt = self.zero_optimizer
        if zopt is not None:
            for hook in getattr(zopt, "_hooks", []) + getattr(getattr(zopt, "buckets", None), "_hooks", []):
                hook.remove()
            if hasattr(zopt, "release_gather_group"):
                zopt.release_gather_group()
            release_storage(zopt)  # swap files and their directories
        if getattr(self, "_checkpoint_io", None) is not None:
            self._checkpoint_io.writer.close()
        gc.collect()  # the groups' last references: their worker threads are joined
        from .teardown import release_collective_threads
        release_collective_threads()

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Call on every rank: rank 0 writes the full model state dict in the model's dtype (gathered at
        ZeRO stage 3 when `stage3_gather_16bit_weights_on_model_save`; engine/zero/stage3_save.py)."""
        from .zero.stage3_save import save_16bit_model
        self._offloaded.require("save_16bit_model")
        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    # -- state ----------------------------------------------------------------------------------
    def training_state_dict(self) -> dict:
        """Everything a resumed run needs besides the data: module, optimizer wrapper, schedule, counters."""
        self._offloaded.require("training_state_dict")
        return {
            "module": self.module.state_dict(),
            "zero_optimizer": self.zero_optimizer.state_dict() if self.zero_optimizer else None,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "counters": {"global_steps": self.global_steps, "global_samples": self.global_samples,
                         "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps},
        }

    def load_training_state_dict(self, state: dict, strict: bool = True) -> None:
        self._offloaded.require("load_training_state_dict")
        self.module.load_state_dict(state["module"], strict=strict)
        if self.zero_optimizer is not None and state.get("zero_optimizer") is not None:
            self.zero_optimizer.load_state_dict(state["zero_optimizer"])
        if self.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        restore_counters(self, state["counters"])  # a new window and log baseline too (restore.py)


def _cast_floating(obj, dtype: torch.dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floating(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floating(v, dtype) for k, v in obj.items()}
    return obj
