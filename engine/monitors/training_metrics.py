"""`TrainingMetrics`: what the engine measures at each optimizer step for the monitors and the log line
(loss, lr, loss scale, grad norm, elapsed times, throughput, TFLOPS, MFU/HFU, peak memory, skipped
steps), and the FLOPs profile at `flops_profiler.profile_step`.

FLOPs are counted once, on rank 0, during the first forward pass of the counted step (the profile step,
or the first step this process runs: after a resume that is not step 1): the model is the same every
step, so FLOPs per sample are too. Nothing is counted, and no host sync is added, when no monitor, no
log line and no profiler asks for it.
"""
from __future__ import annotations

import contextlib
import resource
import time

import torch

from schemas import ConfigError

from ..dist import global_rank as dist_global_rank
from ..profiling import ModuleProfile, peak_flops_per_device
from ..profiling.mfu import Utilisation, utilisation
from ..profiling.model_profile import output_file_problem, write_profile
from ..profiling.report import duration, profile_text, si
from .master import any_monitor_enabled, build_monitors

# DeepSpeed's tag for each timer of `wall_clock_breakdown` (monitor docs: Train/Samples/elapsed_time_ms_*).
TIMER_TAGS = {"forward": "forward", "backward": "backward", "allreduce": "backward_allreduce", "step": "step"}


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class TrainingMetrics:
    def __init__(self, config, comm, module: torch.nn.Module):
        # Global rank 0, not the data-parallel rank: with pipeline or tensor parallelism several
        # processes are data-parallel rank 0.
        global_rank = dist_global_rank()
        self.monitor = build_monitors(config, global_rank)
        # Every rank joins the loss all-reduce, so every rank reads the config, not `monitor.enabled`.
        self._reduce_loss = any_monitor_enabled(config)
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self.train_loss: float | None = None
        self.profiler_cfg = config.flops_profiler
        problem = output_file_problem(self.profiler_cfg.output_file) if self.profiler_cfg.enabled else None
        if problem and global_rank == 0:  # the rank that writes it, as the monitors' output paths
            raise ConfigError([problem])
        self.peak_tflops = config.mfu.peak_tflops
        self.comm, self.module = comm, module
        self.train_batch_size = config.train_batch_size
        wanted = self.monitor.enabled or bool(config.steps_per_print) or self.profiler_cfg.enabled
        # The counted step is fixed at this process's first forward (`_first_forward`): a resumed run
        # starts past step 1, and past a profile step it has already run.
        self.count_step: int | None = None
        self._count = wanted and global_rank == 0
        self.fwd_flops_per_sample: float | None = None
        self.tokens_per_sample: int | None = None
        self._profile: ModuleProfile | None = None
        self._peak: tuple[float | None, str] | None = None
        self._last_step_end = time.perf_counter()
        self.samples_per_s: float | None = None
        self.util: Utilisation | None = None

    # -- forward ----------------------------------------------------------------------------------
    def forward_context(self, global_step: int, args, kwargs=None) -> contextlib.AbstractContextManager:
        """A ModuleProfile around the first forward of the counted step; otherwise nothing. The batch
        is the first tensor of the call: of `args`, else of `kwargs` in the order they were passed
        (`eng(x=x, y=y)` counts as `eng(x, y)`)."""
        if self.count_step is None:
            self._first_forward(global_step + 1)
        if not self._count or global_step + 1 != self.count_step or self._profile is not None:
            return contextlib.nullcontext()
        first = next((a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)), None)
        self._batch = first.shape[0] if first is not None and first.ndim else None
        if first is not None and first.ndim >= 2 and not first.is_floating_point():
            self.tokens_per_sample = int(first.shape[1])  # (batch, sequence) token ids
        self._profile = ModuleProfile(self.module)
        return self._profile

    def _first_forward(self, step: int) -> None:
        """FLOPs are counted at the profile step if this process runs it, else at its first step;
        the first step's time starts here, not at initialisation (a checkpoint load is no step)."""
        cfg = self.profiler_cfg
        self._profiling = cfg.enabled and cfg.profile_step >= step
        self.count_step = cfg.profile_step if self._profiling else step
        self._last_step_end = time.perf_counter()

    def record_loss(self, loss: torch.Tensor) -> None:
        """Add a micro-batch's (unscaled) loss to this step's sum, on its device: no host sync here."""
        if self._reduce_loss:
            loss = loss.detach().float().reshape(1)
            self._loss_sum = loss.clone() if self._loss_sum is None else self._loss_sum + loss
            self._loss_count += 1

    def drop_window(self) -> None:
        """A step that raised: its window's losses are not the next step's (training on must report what
        a run without that batch reports)."""
        self._loss_sum, self._loss_count = None, 0

    def _step_train_loss(self) -> float | None:
        """`Train/Samples/train_loss`: the mean micro-batch loss of this step over every data-parallel
        rank (one scalar all-reduce per step, only while a monitor is configured)."""
        if self._loss_sum is None:
            return None
        total = self._loss_sum / (self._loss_count * self.comm.world_size)
        self.comm.all_reduce(total)
        self._loss_sum, self._loss_count = None, 0
        return float(total)

    # -- step -------------------------------------------------------------------------------------
    def after_step(self, eng, step_timers_ms: dict[str, float]) -> None:
        self.train_loss = self._step_train_loss() if self._reduce_loss else None
        now = time.perf_counter()
        step_s, self._last_step_end = now - self._last_step_end, now
        self.samples_per_s = self.train_batch_size / max(step_s, 1e-9)
        if self._profile is not None and self.fwd_flops_per_sample is None and self._batch:
            self.fwd_flops_per_sample = self._profile.total_flops / self._batch
            if self._profiling:
                self._print_profile(eng, step_s, step_timers_ms)
        if self.fwd_flops_per_sample is not None:
            peak, _ = self.peak()
            per_device = self.samples_per_s / self.comm.world_size
            self.util = utilisation(self.fwd_flops_per_sample, per_device, peak, self.profiler_cfg.recompute_fwd_factor)
        if self.monitor.enabled:
            self.monitor.write_events(self.events(eng, step_timers_ms))

    def peak(self) -> tuple[float | None, str]:
        if self._peak is None:
            self._peak = peak_flops_per_device(self.comm.device, self.peak_tflops)
        return self._peak

    def events(self, eng, step_timers_ms: dict[str, float]) -> list[tuple[str, float, int]]:
        x = eng.global_samples
        out = []
        if self.train_loss is not None:
            out.append(("Train/Samples/train_loss", self.train_loss, x))
        lr = eng.get_lr()
        if lr:
            out.append(("Train/Samples/lr", lr[0], x))
        guard = getattr(eng.zero_optimizer, "guard", None)
        if guard is not None and guard.precision == "fp16":
            out.append(("Train/Samples/loss_scale", guard.scaler.loss_scale, x))
        norm = eng.get_global_grad_norm()
        if norm is not None:
            out.append(("Train/Samples/grad_norm", float(norm), x))
        for name, ms in step_timers_ms.items():
            out.append((f"Train/Samples/elapsed_time_ms_{TIMER_TAGS.get(name, name)}", ms, x))
        out.append(("Train/Samples/samples_per_sec", self.samples_per_s, x))
        if self.tokens_per_sample:
            out.append(("Train/Samples/tokens_per_sec", self.samples_per_s * self.tokens_per_sample, x))
        if self.util is not None:
            out.append(("Train/Samples/TFLOPS", self.util.tflops, x))
            if self.util.mfu is not None:
                out += [("Train/Samples/MFU", self.util.mfu, x), ("Train/Samples/HFU", self.util.hfu, x)]
        out.append(("Train/Samples/peak_memory_MB", peak_memory_mb(self.comm.device), x))
        out.append(("Train/Samples/skipped_steps", eng.skipped_steps, x))
        return out

    def log_suffix(self) -> str:
        """Throughput and utilisation for the periodic log line."""
        parts = []
        if self.tokens_per_sample and self.samples_per_s:
            parts.append(f"{self.samples_per_s * self.tokens_per_sample:,.0f} tokens/s")
        if self.util is not None:
            parts.append(f"{self.util.tflops:.3g} TFLOPS")
            if self.util.mfu is not None:
                parts.append(f"MFU {100 * self.util.mfu:.1f}% HFU {100 * self.util.hfu:.1f}%")
        return "".join(f" | {p}" for p in parts)

    def _print_profile(self, eng, step_s: float, timers_ms: dict[str, float]) -> None:
        prof, cfg = self._profile, self.profiler_cfg
        fwd = prof.total_flops
        peak, peak_source = self.peak()
        summary = [("profile at step", str(self.count_step)), ("world size", str(self.comm.world_size)),
                   ("micro-batch per rank", str(self._batch)), ("params per rank", si(prof.total_params)),
                   ("fwd FLOPs per rank (micro-batch)", si(fwd)), ("fwd MACs per rank", si(fwd / 2)),
                   ("fwd+bwd FLOPs (3 x fwd)", si(3 * fwd)),
                   ("with recomputation (3 + recompute_fwd_factor) x fwd", si((3 + cfg.recompute_fwd_factor) * fwd)),
                   ("fwd latency (profiled)", duration(prof.forward_latency_s))]
        summary += [(f"{name} latency", f"{ms:.2f} ms") for name, ms in timers_ms.items()]
        summary += [("iteration latency", duration(step_s)),
                    ("samples/second", f"{self.train_batch_size / step_s:.2f}"),
                    ("peak per device", f"{si(peak, 'FLOPS') if peak else 'unknown'} ({peak_source})")]
        text = profile_text(prof, summary, cfg.module_depth, cfg.top_modules, cfg.detailed)
        write_profile(text, cfg.output_file)
