"""Named RNG streams for model-parallel code (Megatron's `CudaRNGStatesTracker`, DeepSpeed's
`get_cuda_rng_tracker`), on whichever device the job runs: CUDA's generator when there is one,
otherwise the CPU's. `checkpoint()` saves and restores every tracked stream around a recompute, so
dropout drawn inside `tracker.fork()` is the same in the recompute as in the forward.
"""
from __future__ import annotations

import contextlib

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states; `fork(name)` runs a block on that stream and keeps where it got to."""

    def __init__(self):
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()  # as DeepSpeed's: two streams on one seed would draw the same numbers

    def reset(self) -> None:
        self.states = {}
        self.seeds = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists; call reset() first")
        if seed in self.seeds:
            raise ValueError(f"RNG seed {seed} is used by another stream already; give stream {name!r} its own seed")
        self.seeds.add(seed)
        saved = _get_state()
        if torch.cuda.is_available():
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state()
        _set_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise KeyError(f"RNG stream {name!r} was never added; call model_parallel_cuda_manual_seed(seed)")
        saved = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(saved)


def device_rng_states(devices) -> list[torch.Tensor]:
    """The default generator's state on each accelerator device of `devices` (host-side: no sync)."""
    return [torch.get_device_module(d).get_rng_state(d) for d in devices]


def set_device_rng_states(devices, states) -> None:
    for device, state in zip(devices, states):
        torch.get_device_module(device).set_rng_state(state, device)


_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Megatron's seeding: the default stream gets `seed` (the same on every tensor-parallel rank: the
    dropout of replicated activations must agree), the tracked model-parallel stream gets
    `seed + 2718 + tensor-parallel rank` (dropout inside a partitioned layer must differ)."""
    from .settings import model_parallel_info
    _, tp_rank, _ = model_parallel_info()
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)
