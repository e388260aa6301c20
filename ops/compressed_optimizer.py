"""What the 1-bit optimizers share: a communicator, one compressed all-reduce over all momenta, the
engine protocol, and checkpoints that keep the error buffers.

[Note: optimizers that communicate themselves] After warm-up a 1-bit optimizer averages its momentum
itself (compressed), so the engine must not also all-reduce the gradients (double communication,
and the wrong quantity). The engine asks `needs_gradient_all_reduce()` before each boundary backward:
True means "the coming step uses averaged gradients", False means "leave the gradients local".
Stage 0 binds its `Communicator` to `comm` when the optimizer has none (`engine/zero/stage0.py`).

[Note: checkpoints] `state_dict()` adds a "compression" entry with this rank's worker and server
errors and the phase counters; every rank saves its own (dstrain checkpoints are per rank). Loading at
the same world size and parameter count restores them, so a resumed run continues bit for bit;
otherwise they restart at zero, which DeepSpeed always does (it saves rank 0's errors only and
resets them on load). See docs/compression.md.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .moments import evaluate_closure
from .onebit import CompressedAllReduce


def host_copy(obj):
    """`obj` with every tensor copied to host memory (nested dicts and lists kept)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return obj


class _LocalComm:
    """A world of one: the compressed average of one rank is its own value (no wire, no error)."""

    world_size, rank = 1, 0


class CompressedOptimizer(torch.optim.Optimizer):
    """Base of OneBitAdam, ZeroOneAdam and OneBitLamb (not an optimizer by itself)."""

    communicates_itself = True
    _counters: tuple[str, ...] = ()  # attribute names saved with the errors

    def __init__(self, params, defaults: dict, comm=None, block_size: int = 256):
        super().__init__(params, defaults)
        self.comm = comm
        self.block_size = block_size
        self.step_count = 0  # optimizer steps taken (skipped fp16 steps do not count)
        self._compressor: CompressedAllReduce | None = None
        self._pending_errors: dict | None = None

    # -- communication ------------------------------------------------------------------------
    def _communicator(self):
        if self.comm is not None:
            return self.comm
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(f"{type(self).__name__} communicates its momentum itself and needs a communicator: "
                               "use it through engine.initialize() with zero_optimization.stage 0, or pass comm=")
        return _LocalComm()

    def compressed_average_(self, tensors: list[torch.Tensor]) -> None:
        """Replace `tensors` (one per parameter, fixed order) by their compressed average over ranks,
        all in one flat buffer: one all_to_all and one all_gather of signs, the same of scales."""
        self.compressed_average(tensors, into=tensors)

    def compressed_average(self, tensors: list[torch.Tensor], factors: list[torch.Tensor] | None = None,
                           into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The compressed average of tensors[i] (·factors[i]), written into `into` when given, else as
        views into the compressor's buffer, valid until its next call. In a world of one: the values."""
        comm = self._communicator()
        if comm.world_size == 1:
            values = tensors if factors is None else torch._foreach_mul(tensors, factors)
            if into is not None and values is not into:
                torch._foreach_copy_(into, values)
            return values if into is None else into
        numel = sum(t.numel() for t in tensors)
        if self._compressor is None or self._compressor.numel != numel:
            self._compressor = CompressedAllReduce(numel, comm, self.block_size, tensors[0].device)
            if self._pending_errors is not None:
                self._compressor.load_state_dict(self._pending_errors)
                self._pending_errors = None
        return self._compressor.average(tensors, factors, into)

    def reset_errors(self) -> None:
        """Zero the error feedback (when the compressed quantity changes meaning, e.g. 0/1 Adam)."""
        if self._compressor is not None:
            self._compressor.reset()
        self._pending_errors = None

    def needs_gradient_all_reduce(self) -> bool:  # pragma: no cover - every subclass overrides
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        self.step_count += 1
        self._update()
        return loss

    def _update(self) -> None:  # pragma: no cover - every subclass overrides
        """This step's update; `self.step_count` is already the number of this step (1-based)."""
        raise NotImplementedError

    # -- checkpoints ---------------------------------------------------------------------------
    def _compression_state(self) -> dict:
        errors = self._compressor.state_dict() if self._compressor is not None else self._pending_errors
        return {"errors": errors, "counters": {k: getattr(self, k) for k in self._counters}}

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["compression"] = self._compression_state()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        saved = state_dict.pop("compression", None)
        super().load_state_dict(state_dict)
        self._load_compression(saved)

    def rank_state(self) -> dict:
        """This rank's part of a file checkpoint (engine/checkpoint/rank_state.py): counters and errors,
        copied to host memory (an async save writes them after the next step has changed the originals)."""
        return {"compression": host_copy(self._compression_state())}

    def load_rank_state(self, saved: dict, same_world: bool) -> None:
        self._load_compression(saved["compression"])  # (errors of another world size: warned, zeroed)

    def _load_compression(self, saved: dict | None) -> None:
        self._compressor = None
        self._pending_errors = None
        if saved is None:
            return
        for key, value in saved["counters"].items():
            setattr(self, key, value)
        errors = saved["errors"]
        if errors is not None:
            world = self._communicator().world_size
            if errors["world_size"] != world:
                warnings.warn(f"{type(self).__name__}: the checkpoint's compression errors were saved at world size "
                              f"{errors['world_size']}, now {world}; they restart at zero", stacklevel=3)
            else:
                self._pending_errors = errors  # restored when the compressor is built for the same layout
