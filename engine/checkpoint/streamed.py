"""A rank file whose optimizer state is streamed from swap files while it is written (NVMe offload).

[Note: streamed torch.save] The checkpoint format is one `torch.save` per rank (format.py), and
torch.save writes each storage from memory in one piece. With NVMe offload the optimizer state is in
swap files, and assembling it in host memory for the save would be exactly the memory the offload
exists to avoid. So the save runs in two passes, the file's bytes unchanged:
1. `torch.save` under `torch.serialization.skip_data()` into a `_Skeleton`: the zip's headers, the
   pickle and the central directory are recorded; where a storage's bytes go torch only seeks ahead
   (a hole of exactly `storage.nbytes()` bytes). The streamed state is a `StreamedRows` placeholder:
   a CPU tensor whose memory is allocated but never touched (so never resident) and never read.
2. The skeleton is replayed into the real file (`HashingFile`, hashed while written) in file order;
   each hole is filled from memory, or for a placeholder from its producer, which reads the swap files
   one sub-group at a time (`SwappedPartition.state_chunks`). Host memory: one sub-group's chunk.
Holes come in the order torch first meets each storage while pickling (its storage keys "0", "1", ...);
`_storage_order` walks the object in the order the pickler does (a dict's items in order, a list's or
tuple's elements, a tensor's storage at the tensor, a storage met again not counted again) to learn
that order, without importing pickle (tests/test_checkpoint_security.py: library code never does);
the hole count and sizes must match it (else the save fails rather than write a wrong file: an object
of another kind holding a tensor would add a hole the walk does not know). The zip's CRC-32 fields of the data
records are 0 (as with `torch.serialization.set_crc32_options(False)`); torch.load does not check
them, and the manifest's sha256 covers every byte.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Callable, Iterator

import torch


@dataclass
class StreamedRows:
    """Flat elements [start, stop) of one state kind of one flat; `produce(a, b)` yields fp32 CPU tensors
    that together are elements [a, b), in order. `placeholder` stands for them in the snapshot."""

    start: int
    stop: int
    produce: Callable[[int, int], Iterator[torch.Tensor]]
    placeholder: torch.Tensor

    @classmethod
    def over(cls, start: int, stop: int, produce) -> "StreamedRows":
        # Allocated, never written or read here (module note): the allocator maps untouched pages.
        return cls(start, stop, produce, torch.empty(stop - start, dtype=torch.float32, device="cpu"))

    def contains(self, storage: torch.UntypedStorage) -> bool:
        base = self.placeholder.untyped_storage()
        return base.data_ptr() <= storage.data_ptr() < base.data_ptr() + base.nbytes()

    def bytes_of(self, storage: torch.UntypedStorage) -> Iterator[torch.Tensor]:
        """The bytes `storage` (a slice of the placeholder, as pack() makes) stands for."""
        offset = storage.data_ptr() - self.placeholder.untyped_storage().data_ptr()
        a = self.start + offset // 4
        return self.produce(a, a + storage.nbytes() // 4)


class _Skeleton:
    """A write-only, seek-forward file that records what torch.save writes: bytes, and holes where it
    seeks over a storage's bytes (skip_data)."""

    def __init__(self):
        self.pieces: list[bytes | int] = []  # bytes written, or the size of a hole
        self.pos = 0

    def write(self, data) -> int:
        data = bytes(data)
        self.pieces.append(data)
        self.pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = self.pos + offset if whence == io.SEEK_CUR else offset
        if whence not in (io.SEEK_SET, io.SEEK_CUR) or target < self.pos:
            raise OSError("a streamed checkpoint file is written front to back; torch.save seeked back")
        if target > self.pos:
            self.pieces.append(target - self.pos)
        self.pos = target
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


def _storage_order(obj) -> list[torch.UntypedStorage]:
    """The storages of `obj` in the order torch.save first meets them while pickling (module note)."""
    seen: dict[int, torch.UntypedStorage] = {}

    def walk(value) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen.setdefault(storage._cdata, storage)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(k)
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(obj)
    return list(seen.values())


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().view(torch.uint8).numpy()).cast("B")


def _storage_bytes(storage: torch.UntypedStorage) -> memoryview:
    if storage.device.type != "cpu":  # as torch.save does: the bytes go through host memory
        storage = storage.cpu()
    return _as_bytes(torch.empty(0, dtype=torch.uint8, device="cpu").set_(storage))


def save_streamed(obj, f, streams: list[StreamedRows]) -> None:
    """torch.save(obj, f) with the bytes of every placeholder in `streams` read from its producer
    (module note); `f` is written front to back and not closed."""
    skeleton = _Skeleton()
    with torch.serialization.skip_data():
        torch.save(obj, skeleton)
        order = [s for s in _storage_order(obj) if s.nbytes()]  # an empty storage leaves no hole
    holes = [p for p in skeleton.pieces if isinstance(p, int)]
    if holes != [s.nbytes() for s in order]:
        raise RuntimeError(f"streamed checkpoint: torch.save left holes of {holes[:6]} bytes, the storages "
                           f"are {[s.nbytes() for s in order][:6]}; this torch version pickles differently")
    storages = iter(order)
    for piece in skeleton.pieces:
        if isinstance(piece, bytes):
            f.write(piece)
            continue
        storage = next(storages)
        source = next((s for s in streams if s.contains(storage)), None)
        if source is None:
            f.write(_storage_bytes(storage))
            continue
        written = 0
        for part in source.bytes_of(storage):
            f.write(_as_bytes(part))
            written += part.numel() * 4
        if written != piece:
            raise RuntimeError(f"streamed checkpoint: the swap files gave {written} bytes for a record of {piece}")
