"""`SavedActivationProbe`: how many bytes of activations autograd holds for backward, at the peak.

    with SavedActivationProbe(model.parameters()) as probe:
        loss = model(x); loss.backward()
    probe.peak_bytes

[Note: what it counts] Every tensor autograd saves while the probe is active (saved-tensor hooks), by
storage, each storage once however many nodes save it, from when it is saved until the last node
holding it is freed; parameters (and views of them) are not activations and are left out. The
recompute of a reentrant checkpoint runs under the probe too (call backward inside it), so its
transient tensors count. What the innermost hooks hide is reported to the probe by their owners:
the saved inputs `checkpoint()` moves to CPU or partitions (their packed bytes), and the op outputs a
selective policy keeps (counted from the forward to the end of the probe: torch frees them with the
region, which the policy cannot see). The recompute inside torch's non-reentrant checkpoint keeps its
tensors itself and is not seen: at most one checkpointed region's activations at a time; the inputs it
holds for the recompute are saved tensors, and are seen (a partitioned slice, or the contiguous
buffer it lies in, by its storage).
"""
from __future__ import annotations

import contextlib
import itertools

import torch

_ACTIVE: list["SavedActivationProbe"] = []
_KEYS = itertools.count()


class _Held:
    """What the probe hands autograd to save: the tensor, and a release when autograd drops it."""

    __slots__ = ("tensor", "probe", "key")

    def __init__(self, tensor, probe, key):
        self.tensor, self.probe, self.key = tensor, probe, key

    def __del__(self):
        self.probe._release(self.key)


class SavedActivationProbe:
    def __init__(self, parameters=()):
        self._params = {p.untyped_storage().data_ptr() for p in parameters}
        self._live: dict = {}  # key -> [bytes, holders]
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor
                                                               if isinstance(held, _Held) else held)

    def __enter__(self) -> "SavedActivationProbe":
        _ACTIVE.append(self)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        _ACTIVE.remove(self)
        if not _ACTIVE:
            _KEPT.clear()

    def _hold(self, key, nbytes: int) -> None:
        entry = self._live.setdefault(key, [nbytes, 0])
        if entry[1] == 0:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[1] += 1

    def _release(self, key) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live_bytes -= entry[0]
            del self._live[key]

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self._params or storage.nbytes() == 0:
            return tensor
        key = (tensor.device, storage.data_ptr())
        self._hold(key, storage.nbytes())
        return _Held(tensor, self, key)


def probing() -> bool:
    """Whether a probe is active (what to report would be counted)."""
    return bool(_ACTIVE)


def report_held(nbytes: int) -> object | None:
    """Tell the active probes that `nbytes` are held for backward; they are released when the returned
    token is garbage-collected (keep it with what you hold). None when no probe is active."""
    if not _ACTIVE:
        return None
    tokens = []
    for probe in _ACTIVE:
        key = ("reported", next(_KEYS))
        probe._hold(key, nbytes)
        tokens.append(_Held(None, probe, key))
    return tokens


@contextlib.contextmanager
def no_probe():
    """Nothing reported to the probes inside (for what they will see as saved tensors themselves)."""
    active = _ACTIVE[:]
    _ACTIVE.clear()
    try:
        yield
    finally:
        _ACTIVE.extend(active)


_KEPT: list = []  # tokens of what selective policies keep, dropped when the last probe exits


def report_kept(nbytes: int) -> None:
    """A selective policy kept an op's output of `nbytes` (counted until the probe exits)."""
    token = report_held(nbytes)
    if token is not None:
        _KEPT.append(token)
