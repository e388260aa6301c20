"""`FrozenChunks`: this rank's padded chunk of each frozen partitioned parameter at ZeRO stage 3.

[Note: frozen chunks] Frozen parameters are not in the optimizer's flat partition (nothing steps them:
stage3_params.py), so each rank keeps its chunk of each, in the model dtype: in memory (placed by the
tier: the device, or host memory with `offload_param.device: "cpu"`), or, with `offload_param.device:
"nvme"`, in a chunk file under `nvme_path` (offload/param_swap.py's ChunkFile, in a per-job directory of
its own), read back at every use — the all-gathers, checkpoint saves and loads, GatheredParameters'
modifier writes — so a frozen base model (LoRA-style fine-tuning) holds no host memory between gathers,
as the trainable slots do not. `move_to_file` writes them one chunk at a time, and a chunk that
`zero.Init(remote_device="nvme")` left in its file is kept there until then, never read before: host
memory holds one chunk at most. They share `offload_param.max_in_cpu` with the trainable partition,
which takes it first (its slots are rewritten every step): whole frozen chunks that still fit in what
it leaves, taken in parameter order, stay in host memory and are not read back.
[Note: read ahead] As the trainable slots are (param_swap.py, `read_ahead`), a group's frozen chunks are
read ahead of its gather when the prefetcher asks (the next `buffer_count` groups of its plan), into new
host tensors that the gather then takes: at most `limit` groups' chunks are in flight or waiting, and
a write to a chunk first finishes and drops its read-ahead copy (it would be stale).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from offload.aio import OffloadIOError
from offload.chunk_file import ChunkFile, SwappedChunk
from .stage3_params import chunk_tensor


class FrozenChunks:
    def __init__(self):
        self._chunks: dict = {}  # parameter -> its chunk (a tensor) or where it is (a SwappedChunk)
        self.file: ChunkFile | None = None
        self._ahead: dict = {}  # group (tuple of parameters) -> {parameter: (tensor, read handle)}
        self.limit = 0  # groups read ahead at most (module note: read ahead)
        self.reads_ahead = 0  # chunks a gather took from a read issued ahead (tests)

    def add(self, p: torch.nn.Parameter, chunk) -> None:
        self._chunks[p] = chunk

    def __contains__(self, p) -> bool:
        return p in self._chunks

    def __len__(self) -> int:
        return len(self._chunks)

    def get(self, p) -> torch.Tensor | None:
        """`p`'s padded chunk (in memory: the chunk itself, so writes to it are kept; in a file: a new
        host tensor read from it), or None for a parameter that is not a frozen chunk here."""
        for group, reads in self._ahead.items():
            if p in reads:
                out, handle = reads.pop(p)
                if not reads:
                    del self._ahead[group]
                handle.wait()
                self.reads_ahead += 1
                return out
        chunk = self._chunks.get(p)
        return None if chunk is None else chunk_tensor(chunk)

    def read_ahead(self, params: list) -> bool:
        """Start reading the chunks of `params` (one gather group's frozen ones) into new host tensors,
        unless they are in memory, already on their way, or `limit` groups are (module note)."""
        group = tuple(p for p in params if isinstance(self._chunks[p], SwappedChunk))
        if not group or group in self._ahead or len(self._ahead) >= self.limit:
            return False
        reads = {}
        for p in group:
            chunk = self._chunks[p]
            out = torch.empty(chunk.numel, dtype=chunk.dtype, device=torch.device("cpu"))
            reads[p] = (out, self.file.io.read(self.file.path, out, chunk.offset))
        self._ahead[group] = reads
        return True

    def _drop_ahead(self, p=None) -> None:
        """Finish and forget the reads ahead (of `p` only, if given)."""
        for group in list(self._ahead):
            reads = self._ahead[group]
            for q in [q for q in reads if p is None or q is p]:
                reads.pop(q)[1].wait()
            if not reads:
                del self._ahead[group]

    def drop_reads_ahead(self) -> None:
        """Forget every read ahead, a failed one with its error (stage3_read_failures.py's note)."""
        for reads in self._ahead.values():
            for _, handle in reads.values():
                with contextlib.suppress(OffloadIOError):
                    handle.wait()
        self._ahead.clear()

    @torch.no_grad()
    def put(self, p, values: torch.Tensor) -> None:
        """New values for the first `values.numel()` elements of `p`'s chunk (all of it, or its rows without
        the padding)."""
        chunk = self._chunks[p]
        flat = values.reshape(-1)
        self._drop_ahead(p)  # a copy read before this write would be stale
        if isinstance(chunk, SwappedChunk):
            chunk.store(flat)
        else:
            chunk[:flat.numel()].copy_(flat)

    def resident_bytes(self) -> int:
        """Chunks kept in memory (read-ahead copies, transient, not counted)."""
        return sum(c.untyped_storage().nbytes() for c in self._chunks.values() if isinstance(c, torch.Tensor))

    def loaded(self, p, rows: torch.Tensor) -> None:
        """A checkpoint load wrote `rows` (a view of what `get` returned): a chunk in the file gets them."""
        if isinstance(self._chunks[p], SwappedChunk):
            self.put(p, rows)

    def move_to_file(self, make_file: Callable[[], ChunkFile], keep: int = 0) -> None:
        """Every chunk into the file `make_file()` makes (when one is needed), one at a time, except those
        that still fit in `keep` elements when their turn comes (parameter order), which stay in host
        memory (module note)."""
        for p, chunk in self._chunks.items():
            numel = chunk.numel if isinstance(chunk, SwappedChunk) else chunk.numel()
            if numel <= keep:
                keep -= numel
                self._chunks[p] = chunk_tensor(chunk)  # zero.Init's file goes when the store has copied it
                continue
            if self.file is None:
                self.file = make_file()
            self._chunks[p] = self.file.put(chunk_tensor(chunk))

    def close(self) -> None:
        """The chunk file and its directory (the engine's destroy)."""
        if self.file is not None:
            self._drop_ahead()
            self.file.close()
            self.file = None
