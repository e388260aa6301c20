"""ZeRO stage 3 parameter storage: per-rank chunks, gather groups, and the placeholder protocol.

[Note: where a parameter lives] A stage-3 parameter `p` keeps its full shape in `p.ds_shape`. Between
uses `p.data` is an empty placeholder (`placeholder`: shape (0, *ds_shape[1:])); this rank's chunk
lives in the fp32 flat partition (trainable parameters: it is the master weight) or in
`frozen_chunks` (frozen parameters, model dtype).
Parameters of at most `param_persistence_threshold` elements stay full on every rank ("persistent")
and are refreshed from the master after each step.
[Note: full storage] Each partitioned parameter owns one full-size tensor whose storage is resized to
0 bytes when released and back when gathered (FSDP2's trick). Autograd may have saved that tensor or a
view of it in forward; because the storage object is the same, the view sees the re-gathered values in
backward and holds no memory in between. `p.data` is pointed at it only while gathered.
[Note: tags] Every all-gather carries two trailing elements per rank naming the group (id // 256,
id % 256: exact in fp16, bf16 and fp32), so ranks that gather different groups of the same size find
out at once and say which modules, instead of mixing weights silently. A rank whose parameter read
failed (NVMe) sends its tag marked failed instead (stage3_read_failures.py's note).
"""
from __future__ import annotations

import torch

from offload.huge_pages import flat_empty
from offload.aio import OffloadIOError
from offload.chunk_file import SwappedChunk
from .stage3_read_failures import failed_tag
from .partition import ChunkSpec, Fragment, PartitionedParams, RankMajorLayout
from .tier import copy_chunks

TAG = 2  # trailing elements per rank in every all-gather


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(p, "ds_shape", p.shape))


def placeholder(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The empty tensor a partitioned parameter holds between uses: no element, but the full shape's
    number of dimensions and trailing sizes. Code that reads `p.dim()` while a model is built
    (nn.Transformer's `if p.dim() > 1: xavier_uniform_(p)`, nanoGPT's weight-decay groups) or a fan-in
    (`nn.Linear.reset_parameters`) then sees the real parameter's; a [0] placeholder made that loop skip
    every partitioned weight silently. Dim 0 is 0: code reading `p.shape[0]` or `p.numel()` of a
    placeholder still gets 0 (docs/zero3.md)."""
    return torch.empty((0, *shape[1:]) if len(shape) else (0,), dtype=dtype, device=device)


def replaced_error(p: torch.nn.Parameter, when: str, was: tuple | None = None) -> str:
    """[Note: resized in the block] A partitioned parameter whose data was replaced by a tensor of another
    shape (transformers' `resize_token_embeddings` assigns `weight.data` the new embedding; outside
    DeepSpeed it reads the old size from the placeholder, 0 rows, and fills the new rows with the mean of
    none: NaN) cannot keep its partition. Inside `GatheredParameters(..., modifier_rank=0)` on a module
    built in `Init` and not yet given to `engine.initialize`, the new tensor is partitioned at its new
    shape on exit (rank 0's values); anywhere else the replacement is refused with this message."""
    return (f"ZeRO-3: a parameter of shape {tuple(was or full_shape(p))} was given data of shape "
            f"{tuple(p.shape)} {when} (transformers' resize_token_embeddings does this); resize it before "
            "engine.initialize, with its full weights gathered on every rank: with engine.zero.GatheredParameters("
            "[model.get_input_embeddings().weight, *model.get_output_embeddings().parameters()], modifier_rank=0): "
            "model.resize_token_embeddings(n)")


def check_not_replaced(p: torch.nn.Parameter, name: str) -> None:
    """`engine.initialize` of a module built in `zero.Init`: each partitioned parameter still holds its
    placeholder (note: resized in the block)."""
    if hasattr(p, "_z3_chunk") and p.numel() and tuple(p.shape) != full_shape(p):
        raise RuntimeError(replaced_error(p, f"({name}) after engine.zero.Init partitioned it, outside "
                                             "GatheredParameters(..., modifier_rank=0)"))


def spec_of(shape: tuple[int, ...], world: int) -> ChunkSpec:
    rows = shape[0] if len(shape) else 1
    numel = 1
    for s in shape:
        numel *= s
    return ChunkSpec(rows, numel // rows if rows else 0, -(-rows // world))


def partition_numel(optimizer, world: int) -> int:
    """Elements of a rank's fp32 partition (its trainable parameters' padded chunks), before it is built."""
    return sum(spec_of(full_shape(p), world).padded for g in optimizer.param_groups for p in g["params"]
               if p.requires_grad)


def padded_chunk(full: torch.Tensor, spec: ChunkSpec, rank: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """This rank's dim-0 chunk of `full` as a new 1-D tensor of `spec.padded` elements (zero padding)."""
    start, stop = spec.row_range(rank)
    out = torch.zeros(spec.padded, dtype=dtype or full.dtype, device=full.device)
    n = (stop - start) * spec.row_numel
    out[:n].copy_(full.detach().reshape(-1)[start * spec.row_numel:start * spec.row_numel + n])
    return out


def chunk_tensor(chunk) -> torch.Tensor:
    """A `zero.Init` chunk as a tensor: read back from its file with remote_device "nvme"."""
    return chunk.load() if isinstance(chunk, SwappedChunk) else chunk


def local_chunk(p: torch.nn.Parameter, spec: ChunkSpec, rank: int) -> torch.Tensor:
    """The padded 1-D chunk of `p` this rank keeps: from `zero.Init` if it partitioned `p`, else cut."""
    chunk = getattr(p, "_z3_chunk", None)
    if chunk is None:
        return padded_chunk(p.data, spec, rank)
    chunk = chunk_tensor(chunk)
    if chunk.numel() != spec.padded:  # Init cut it for another group than the data axis stage 3 uses
        raise ValueError(f"engine.zero.Init partitioned a parameter of shape {tuple(full_shape(p))} into chunks of "
                         f"{chunk.numel()} elements, but stage 3 partitions it into chunks of {spec.padded} over the "
                         "data axis: give zero.Init data_parallel_group= that axis (its default once the topology is "
                         "set, engine.topology.set_current, before the model is built)")
    return chunk


def gather_full(comm, spec: ChunkSpec, chunk: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Collective: the full tensor of one parameter from every rank's padded `chunk` (dtype of `chunk`)."""
    layout = RankMajorLayout([None], [spec], comm.world_size)
    out = torch.empty(layout.numel, dtype=chunk.dtype, device=chunk.device)
    comm.all_gather(out, chunk.contiguous())
    full = torch.empty(shape, dtype=chunk.dtype, device=chunk.device)
    layout.unpack(out, [full])
    return full


class Stage3Partition(PartitionedParams):
    """`PartitionedParams` built from chunks instead of full tensors, so that parameters `zero.Init`
    already partitioned (placeholders with `_z3_chunk`) never exist in full."""

    def __init__(self, *args, grads_swapped: bool = False, params_swapped: bool = False, **kwargs):
        self.swapped_init: dict[tuple, list] = {}  # key -> [(offset, chunk)] the NVMe store copies (below)
        self.grads_swapped = grads_swapped  # grad_swap.py: no host gradient partition
        self.params_swapped = params_swapped  # offload_param "nvme": the flat is never filled here
        super().__init__(*args, **kwargs)

    def _build_flat(self, key) -> None:
        offset, chunks = 0, []
        for p in self.members[key]:
            shape = full_shape(p)
            spec = spec_of(shape, self.world)
            start, stop = spec.row_range(self.rank)
            self.fragments[p] = Fragment(key, offset, spec.numel_of(self.rank), spec.padded,
                                         (stop - start,) + shape[1:], spec)
            chunk = getattr(p, "_z3_chunk", None)
            if not isinstance(chunk, SwappedChunk):
                chunk = CutChunk(p, spec, self.rank) if self.params_swapped else local_chunk(p, spec, self.rank)
            chunks.append((offset, chunk))
            offset += spec.padded
        if self.params_swapped or any(isinstance(c, SwappedChunk) for _, c in chunks):
            # zero.Init(remote_device="nvme")'s chunks stay in their file, a model built in memory stays
            # there, until the NVMe parameter store copies them into its own files one parameter at a
            # time (param_nvme.py); the flat is allocated but never written here, so its pages are not
            # touched: no rank fills a partition-sized host buffer at any time.
            self.swapped_init[key] = chunks
            self._set_flat(key, torch.empty(offset, dtype=torch.float32, device=self.members[key][0].device))
            return
        parts = [c.float() for _, c in chunks]  # a key exists only with a member
        flat = flat_empty(sum(t.numel() for t in parts), torch.float32, parts[0].device)  # huge pages on a host
        self._set_flat(key, torch.cat(parts, out=flat))


class CutChunk:
    """This rank's padded chunk of a parameter held in memory (a full tensor, or zero.Init's in-memory
    chunk), cut only when the NVMe parameter store copies it (`load()`, as `SwappedChunk.load`)."""

    def __init__(self, p: torch.nn.Parameter, spec: ChunkSpec, rank: int):
        self.chunk = getattr(p, "_z3_chunk", None)
        self.full = p.data if self.chunk is None else None  # the tensor itself: release() repoints p.data
        self.spec, self.rank = spec, rank

    @property
    def dtype(self) -> torch.dtype:
        return self.full.dtype if self.full is not None else self.chunk.dtype

    def load(self) -> torch.Tensor:
        return chunk_tensor(self.chunk) if self.chunk is not None else padded_chunk(self.full, self.spec, self.rank)


class GatherGroup:
    """Partitioned parameters gathered and released together (the parameters a unit module owns).

    `sources` gives parameter i's padded chunk on this rank (an fp32 master slot read through the
    partition store, or a frozen chunk: partition_store.GroupSources);
    `fulls[i]` its full-size tensor (see the module note). `gathered` says whether `p.data` is full.
    """

    def __init__(self, gid: int, name: str, params: list, sources: list, world: int, rank: int):
        self.gid, self.name, self.params, self.sources = gid, name, params, sources
        self.world, self.rank = world, rank
        self.dtype = params[0].dtype
        specs = [spec_of(full_shape(p), world) for p in params]
        self.layout = RankMajorLayout(params + [None], specs + [ChunkSpec(world, TAG, 1)], world)
        self.numel = sum(s.rows * s.row_numel for s in specs)
        self.device = params[0].device
        self.placeholders = [placeholder(full_shape(p), self.dtype, params[0].device) for p in params]
        self.fulls = [torch.empty(full_shape(p), dtype=self.dtype, device=params[0].device) for p in params]
        self.nbytes = [f.untyped_storage().nbytes() for f in self.fulls]
        for f in self.fulls:
            f.untyped_storage().resize_(0)
        self.gathered = False
        self.tag = torch.tensor([gid // 256, gid % 256], dtype=self.dtype, device=self.device)

    def send_buffer(self, on_read_error=None) -> torch.Tensor:
        """This rank's segment: every chunk (cast to the model dtype) and the tag. Where reading the chunks
        fails (NVMe) and `on_read_error` is given, zeros and the tag marked failed, and
        `on_read_error(self, err)` (stage3_read_failures.py's note); else the error is raised."""
        send = torch.empty(self.layout.segment, dtype=self.dtype, device=self.device)
        try:
            copy_chunks(self.layout.segment_slots(send), self.sources.open() + [self.tag])
        except OffloadIOError as err:
            if on_read_error is None:
                raise
            send.zero_()
            send[-TAG:].copy_(failed_tag(self.gid, self.dtype, self.device))
            on_read_error(self, err)
        finally:
            self.sources.close()  # NVMe: the pool buffer goes back (copy_chunks is done with it)
        return send

    def output_buffer(self) -> torch.Tensor:
        return torch.empty(self.layout.numel, dtype=self.dtype, device=self.device)

    def tag_ids(self, out: torch.Tensor) -> torch.Tensor:
        """The group id each rank sent, from a finished all-gather's output: a new int64 tensor on its
        device (no host read, and no view that would keep `out` alive)."""
        tags = out.view(self.world, self.layout.segment)[:, -TAG:].long()
        return tags[:, 0] * 256 + tags[:, 1]

    def tags_of(self, out: torch.Tensor) -> list[int]:
        """`tag_ids` read to the host (a sync on accelerators: outside hot paths only)."""
        return self.tag_ids(out).tolist()

    @torch.no_grad()
    def unpack(self, out: torch.Tensor) -> None:
        """Fill the full tensors from a finished all-gather and point the parameters at them."""
        for f, n in zip(self.fulls, self.nbytes):
            if f.untyped_storage().nbytes() != n:
                f.untyped_storage().resize_(n)
        if not self.gathered:
            for p, empty in zip(self.params, self.placeholders):
                if p.shape != empty.shape:  # replaced while released (note: resized in the block)
                    raise RuntimeError(replaced_error(p, f"in module '{self.name}' after engine.initialize "
                                                         "partitioned it"))
        self.layout.unpack(out, self.fulls)
        for p, f in zip(self.params, self.fulls):
            p.data = f
        self.gathered = True

    def release(self) -> None:
        for p, f, empty in zip(self.params, self.fulls, self.placeholders):
            p.data = empty
            f.untyped_storage().resize_(0)
        self.gathered = False

    @torch.no_grad()
    def store(self, rank_full: list[torch.Tensor]) -> None:
        """Write this rank's chunks of the given full tensors back into the sources (modifier edits)."""
        for i, (p, full) in enumerate(zip(self.params, rank_full)):
            self.sources.write(i, padded_chunk(full, spec_of(full_shape(p), self.world), self.rank))
