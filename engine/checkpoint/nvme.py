"""Checkpoints of a stage-1/2 partition whose optimizer state lives in swap files (engine/zero/nvme_tier.py).

`NvmeAdapter` is `PartitionedAdapter` (state.py) over the same fragments, with the optimizer state read
from and written to the swap files instead of `optimizer.state`: so a checkpoint saved with NVMe offload
is the one saved without it (same keys, same layout) and loads into any stage, offload setting and
world size, and the other way round.
[Note: memory at save and load] Neither direction holds a flat of optimizer state in host memory.
Save: each state kind's fragments are views of a `StreamedRows` placeholder (streamed.py), whose bytes
the writer reads from `state_chunks()` one sub-group at a time while it writes the rank file; the fp32
rows are the host flat the all-gather sends from (resident anyway, and equal to the swapped master bit
for bit: the tier copies every updated master slice into it).
[Note: async save] With `checkpoint.async_save` the state must be fixed before the save returns (the
step after next overwrites the slot the save would read), but not in memory: `freeze()` copies each
partition's current swap files, master included, into the job's swap directory (a reflink or an
in-kernel copy: offload/file_snapshot.py) on the training thread, and every placeholder, the fp32 rows'
too (the host flat changes with the next step), streams from those copies in the background writer,
sub-group by sub-group as the synchronous save does. The file's bytes are the synchronous save's; the
copies are deleted when the save is committed or fails (`release`), and by the swap directory's sweep
after a crash. Host memory: one sub-group per storage being written, whatever the model size.
Load: `write` only records where each fragment's rows are (restore.py
passes row readers, `streams_rows`); `finish_load` then feeds `load_chunks()` one sub-group at a time,
each cut from the checkpoint's memory-mapped fragments. Measured in tests/test_offload_checkpoint.py.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from offload.swapped_partition import MASTER

from .format import FP32
from .state import PartitionedAdapter
from .streamed import StreamedRows


_copies = itertools.count()  # names of snapshot copies, unique within the job's swap directory


@dataclass
class _Pending:
    """One fragment's saved rows, read on demand: `rows(kind, r0, r1)` gives rows [r0, r1) of it."""
    offset: int
    numel: int
    row_numel: int
    rows: Callable[[str, int, int], torch.Tensor]


class NvmeAdapter(PartitionedAdapter):
    streams_rows = True  # restore.py: row readers instead of row tensors (module note)

    def __init__(self, zopt, rank: int, world: int):
        super().__init__(zopt, rank, world)
        self.nvme = zopt.nvme
        self._streams: dict[tuple, StreamedRows] = {}  # (flat key, kind) -> placeholder, this save
        self._scalars: dict[tuple, dict] = {}
        self._pending: dict[tuple, list[_Pending]] = {}
        self._loaded_kinds: dict[tuple, set] = {}
        self._frozen: dict[tuple, object] = {}  # flat key -> FrozenState, this async save (module note)

    def row_kinds(self) -> set[str]:
        """The per-element state kinds: the configured optimizer holds no state, so its layout names
        none (state_layout.py); the swapped keys are the stepper's own."""
        return {k for part in self.nvme.parts.values() for k in part.state_keys}

    # -- save --------------------------------------------------------------------------------------
    def freeze(self) -> None:
        """This save reads copies of the swap files taken now, not the live files (module note: async)."""
        swap = self.nvme.swap
        try:
            for key, part in self.nvme.parts.items():
                n = next(_copies)
                self._frozen[key] = part.frozen(lambda kind, n=n, name=part.name: swap.file(f"ckpt{n}.{name}.{kind}.swp"),
                                                path_key="zero_optimization.offload_optimizer.nvme_path")
        except BaseException:
            self.release()()
            raise

    def release(self) -> Callable[[], None]:
        """Deletes this save's copies when called (after the commit, by the writer)."""
        frozen = list(self._frozen.values())

        def remove_copies() -> None:
            for state in frozen:
                state.close()
        return remove_copies

    def _first_chunk(self, key) -> dict:
        """Sub-group 0's chunk: which state kinds exist yet, and the per-step scalars (equal in every
        sub-group: Adam's step)."""
        if key in self._frozen:
            frozen = self._frozen[key]
            return {"kinds": [k for k in frozen.kinds if k != MASTER], "scalars": frozen.scalars}
        if key not in self._scalars:
            chunk = next(iter(self.nvme.state_chunks(key)))
            self._scalars[key] = {"kinds": sorted(chunk["state"]), "scalars": chunk["scalars"]}
        return self._scalars[key]

    def _produce(self, key, kind: str):
        if key in self._frozen:
            frozen = self._frozen[key]
            return lambda a, b: frozen.rows(MASTER if kind == FP32 else kind, a, b)

        def produce(a: int, b: int):
            for chunk in self.nvme.state_chunks(key):
                s, e = chunk["start"], chunk["end"]
                if e <= a:
                    continue
                if s >= b:
                    return
                rows = chunk["master"] if kind == FP32 else chunk["state"][kind]
                yield rows[max(a, s) - s:min(b, e) - s]
        return produce

    def _placeholder(self, key, kind: str) -> StreamedRows:
        if (key, kind) not in self._streams:
            frags = [f for f in self.part.fragments.values() if f.key == key and f.numel]
            start = min(f.offset for f in frags)
            stop = max(f.offset + f.numel for f in frags)
            self._streams[key, kind] = StreamedRows.over(start, stop, self._produce(key, kind))
        return self._streams[key, kind]

    def read(self, p, kinds: set[str]) -> dict:
        frag = self.part.fragments[p]
        first = self._first_chunk(frag.key)
        # the fp32 rows stream too when they are not in memory: frozen copies (async), or the NVMe
        # parameter store's files (each read would be a new tensor, all held until the write); and from the
        # committed master while a failed step left the host flat half-updated (nvme_tier.py: unrestored)
        streamed = (frag.key in self._frozen or frag.key in self.nvme.unrestored
                    or not getattr(self.part.store, "master_in_memory", True))
        tensors = {} if streamed else {
            FP32: self.part.store.read(frag.key, frag.offset, frag.offset + frag.numel).view(frag.shape)}
        for kind in ([FP32] if streamed else []) + first["kinds"]:
            stream = self._placeholder(frag.key, kind)
            lo = frag.offset - stream.start
            tensors[kind] = stream.placeholder[lo:lo + frag.numel].view(frag.shape)
        for kind, value in first["scalars"].items():
            tensors[kind] = value.clone() if torch.is_tensor(value) else value
        return tensors

    def streams(self) -> list[StreamedRows]:
        """This save's placeholders (snapshot.py hands them to the writer); the next save starts afresh."""
        out = list(self._streams.values())
        self._streams, self._scalars, self._frozen = {}, {}, {}
        return out

    # -- load --------------------------------------------------------------------------------------
    def begin_load(self, load_state: bool) -> None:
        self._load_state = load_state
        self._pending = {key: [] for key in self.part.flat}
        self._scalars, self._loaded_kinds = {}, {key: set() for key in self.part.flat}

    @torch.no_grad()
    def write(self, p, readers: dict, load_state: bool) -> None:
        """Record where `p`'s rows are; `readers[kind]` is `rows(r0, r1)` for row kinds, the value for
        scalars (restore.py, `streams_rows`). Nothing is read here."""
        frag = self.part.fragments[p]
        self._pending[frag.key].append(_Pending(frag.offset, frag.numel, frag.spec.row_numel,
                                                lambda kind, r0, r1: readers[kind](r0, r1)))
        for kind, value in readers.items():
            if kind == FP32 or not load_state:
                continue
            if callable(value):
                self._loaded_kinds[frag.key].add(kind)
            else:
                self._scalars.setdefault(frag.key, {}).setdefault(kind, value.clone() if torch.is_tensor(value)
                                                                  else value)

    def _chunks(self, key):
        """`load_chunks` input for flat `key`, one target sub-group at a time (module note)."""
        part, store = self.nvme.parts[key], self.part.store
        kinds = sorted(self._loaded_kinds[key]) if self._load_state else []
        missing = sorted(set(part.state_keys) - set(kinds)) if kinds else []
        if missing:
            raise ValueError(f"the checkpoint has optimizer state {kinds} but not {missing}, which the "
                             "NVMe-offloaded optimizer needs; load with load_optimizer_states=False")
        pending = sorted(self._pending[key], key=lambda f: f.offset)
        first = 0  # fragments before it end before the current sub-group (both ascending)
        for s, e in part.groups:
            # The host store's read is a view, filled in place; the NVMe store's a copy, which
            # load_chunks writes back through the store (nvme_tier.py).
            master = store.read(key, s, e)
            state = {kind: torch.zeros(e - s, dtype=torch.float32, device="cpu") for kind in part.state_keys} \
                if kinds else {}
            while first < len(pending) and pending[first].offset + pending[first].numel <= s:
                first += 1
            for i in range(first, len(pending)):
                frag = pending[i]
                if frag.offset >= e:
                    break
                a, b = max(s, frag.offset), min(e, frag.offset + frag.numel)
                if a >= b:  # an empty fragment (a rank holding no rows of that parameter)
                    continue
                lo, hi = a - frag.offset, b - frag.offset  # elements of the fragment
                r0, r1 = lo // frag.row_numel, -(-hi // frag.row_numel)
                cut = slice(lo - r0 * frag.row_numel, hi - r0 * frag.row_numel)
                master[a - s:b - s].copy_(frag.rows(FP32, r0, r1).reshape(-1)[cut])
                for kind in state:
                    state[kind][a - s:b - s].copy_(frag.rows(kind, r0, r1).reshape(-1)[cut])
            yield {"start": s, "end": e, "master": master, "state": state,
                   "scalars": self._scalars.get(key, {}) if kinds else {}}

    def finish_load(self) -> None:
        """The loaded rows go into the swap files and the host flats, sub-group by sub-group; the
        configured optimizer keeps no state (nvme_tier.py's note). A load that leaves the optimizer state
        alone (load_optimizer_states=False, load_module_only) replaces the master only and keeps the state
        the files hold, as the in-memory optimizer keeps its own; a load of a checkpoint saved before the
        first step replaces the state with none, as without offload."""
        for key in self.part.flat:
            self.nvme.load_chunks(key, self._chunks(key), keep_state=not self._load_state)
        self._pending = {}
