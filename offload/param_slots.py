"""Where a gather group's parameter slots are (`Slots`), and the pool buffers given back with a group's
slots still in them (`KeptBuffers`): the NVMe parameter store's bookkeeping (offload/param_swap.py's
notes: bounded host memory, kept buffers)."""
from __future__ import annotations

from bisect import bisect_right, insort
from typing import Callable

import torch


class ResidentSpans:
    """Per flat, the element ranges the resident copies hold, sorted by start (param_swap.py's note:
    write-back): a group's runs are added as it becomes resident, never removed until `clear`."""

    def __init__(self) -> None:
        self._spans: dict = {}  # flat key -> [(start, stop, resident view)]

    def add(self, slots: "Slots", resident: torch.Tensor) -> None:
        for key, start, stop, at in slots.runs:
            insort(self._spans.setdefault(key, []), (start, stop, resident[at:at + stop - start]),
                   key=lambda span: span[0])

    def parts(self, key, start: int, stop: int) -> list[tuple[int, int, torch.Tensor]]:
        """(a, b, view): the resident elements [a, b) of flat `key` within [start, stop), in order."""
        spans = self._spans.get(key, ())
        out = []
        for s, e, view in spans[max(0, bisect_right(spans, start, key=lambda span: span[0]) - 1):]:
            if s >= stop:
                break
            a, b = max(s, start), min(e, stop)
            if a < b:
                out.append((a, b, view[a - s:b - s]))
        return out

    def clear(self) -> None:
        self._spans.clear()


class Slots:
    """Where a group's parameter slots are in the files: coalesced runs, and each slot's place in a buffer."""

    def __init__(self, fragments: dict, params: list):
        self.runs: list[list] = []  # [key, start, stop, buffer offset]
        self.places: list[tuple[int, int]] = []  # (buffer offset, padded) per parameter
        at = 0
        for p in params:
            frag = fragments[p]
            last = self.runs[-1] if self.runs else None
            if last is not None and last[0] == frag.key and last[2] == frag.offset:
                last[2] += frag.padded
            else:
                self.runs.append([frag.key, frag.offset, frag.offset + frag.padded, at])
            self.places.append((at, frag.padded))
            at += frag.padded
        self.numel = at

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        return [buf[a:a + n] for a, n in self.places]


class KeptBuffers:
    """The pool's free buffers that still hold a group's slots (offload/pool.py's note: kept contents; the
    `Slots` object is the tag). Only the store's thread acquires from its pool, so a buffer found kept
    stays so while `update` writes into it."""

    def __init__(self, pool):
        self.pool = pool
        self._layouts: dict[Slots, None] = {}  # given back with their bytes; the pool may have handed some out

    def release(self, buf: torch.Tensor, slots: Slots | None = None) -> None:
        """`buf` back to the pool, with `slots`' bytes in it (else its bytes are nobody's)."""
        self.pool.release(buf, slots)
        if slots is not None:
            self._layouts[slots] = None

    def claim(self, slots: Slots) -> torch.Tensor | None:
        """The buffer still holding `slots`, taken from the pool, or None."""
        kept = self.pool.claim([slots])
        if kept is None:
            return None
        self._layouts.pop(slots, None)
        return kept[0]

    def parts(self, key, start: int, stop: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(a, b, view, buffer): the elements [a, b) of flat `key` within [start, stop) a kept buffer holds."""
        out = []
        for slots in list(self._layouts):
            buf = self.pool.kept(slots)
            if buf is None:  # handed out since: its bytes are someone else's
                del self._layouts[slots]
                continue
            for k, s, e, at in slots.runs:
                a, b = max(s, start), min(e, stop)
                if k == key and a < b:
                    out.append((a, b, buf[at + a - s:at + b - s], buf))
        return out

    def update(self, key, start: int, values: torch.Tensor, before_write: Callable[[torch.Tensor], None]) -> None:
        """Write `values` (elements from `start` of flat `key`) into the kept buffers they cover;
        `before_write(buf)` first (a device copy may still be reading it)."""
        for a, b, view, buf in self.parts(key, start, start + values.numel()):
            before_write(buf)
            view.copy_(values[a - start:b - start])

    def clear(self) -> None:
        self._layouts.clear()


def assembled(parts: list, start: int, stop: int) -> torch.Tensor | None:
    """Elements [start, stop) from (a, b, view) parts (host tensors), or None where they leave a gap."""
    parts, at = sorted(parts, key=lambda part: part[0]), start
    for a, b, _ in parts:
        if a > at:
            return None
        at = max(at, b)
    if at < stop or not parts:
        return None
    out = torch.empty(stop - start, dtype=parts[0][2].dtype, device=torch.device("cpu"))
    for a, b, view in parts:
        out[a - start:b - start].copy_(view)
    return out
