"""Collecting what a checkpoint holds from a live engine (training thread, all ranks together).

`take_snapshot` returns a `writer.Snapshot`: this rank's fragments (views for a synchronous save,
CPU copies for an async one), its RNG states, and on rank 0 the metadata and the engine state.
[Note: packing] torch.save writes a tensor's whole storage, once per storage. So a rank's fragments are
`pack`ed before saving: fragments adjacent in memory (a ZeRO 1-3 rank's fragments are consecutive
slices of its flat fp32 partition and of each optimizer-state flat) form one run, and each run becomes
one storage that covers just that run. The file then holds a few large records and only the bytes the
fragments cover (at stage 0 a fragment is 1/world of its parameter's storage: saving the view wrote
the whole parameter on every rank). For a synchronous save a run is a zero-copy view of the live
memory (a storage slice); for an async save it is one copy into the rank's `Arena`, buffers reused from
save to save (one memcpy per run, no page faults on fresh allocations: the training thread's whole
share of an async save). The file's layout is unchanged: a dict of tensors, here views of a few storages.
[Note: accelerators] On a GPU the arena is pinned host memory and the copies are non-blocking, so the
training thread only enqueues them: they are ordered before the next step's kernels on the same stream
(which therefore cannot change what is copied), and the writer thread waits for the recorded event
(`Snapshot.ready`) before it reads the arena. No host sync on the training thread.
"""
from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..precision import precision_name
from ..tensor_parallel.layers import is_partitioned
from . import format as fmt
from . import tensor_shards
from .placement import coordinates, merge_tables, model_degree
from .rank_state import save_rank_state
from .resume_checks import optimizer_record, warn_if_mid_window_save, window_record
from .state import FP32, MODULE, adapter_for, rng_state, row_kinds, rows_of
from .writer import Snapshot, new_nonce


class Arena:
    """Host buffers an async save's snapshot is copied into, one per dtype, kept for the next save (one
    save is in flight at a time, and the next waits for it before it packs: api.py)."""

    def __init__(self, pin: bool | None = None):
        self._bufs: dict[torch.dtype, torch.Tensor] = {}
        self.pin = torch.cuda.is_available() if pin is None else pin  # module note: accelerators

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buf = self._bufs.get(dtype)
        if buf is None or buf.numel() < numel:
            self._bufs.pop(dtype, None)  # the old buffer goes before the larger one comes
            buf = self._bufs[dtype] = torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self.pin)
        return buf[:numel]


def _exact(run: torch.Tensor) -> torch.Tensor:
    """`run` (contiguous, 1-D) over a storage of exactly its bytes: a slice of its storage, no copy (the
    slice keeps the whole storage alive)."""
    size = run.element_size()
    start = run.storage_offset() * size
    storage = run.untyped_storage()
    if start == 0 and storage.nbytes() == run.numel() * size:
        return run
    return torch.empty(0, dtype=run.dtype, device=run.device).set_(
        storage[start:start + run.numel() * size], 0, (run.numel(),))


@dataclass
class _Run:
    """Tensors adjacent in one storage: element offsets [start, stop) of it, the members' indices, and
    how many elements inside the run no member covers (`gaps`) or some member does (`covered`)."""
    member: torch.Tensor
    start: int
    stop: int
    indices: list[int]
    gaps: int = 0
    covered: int = 0

    def take(self, i: int, start: int, stop: int) -> bool:
        """Adds tensor `i` ([start, stop), at or after this run's start) if the gap it leaves stays
        under 1/8 of what the run covers (a flat's padding slots); False if it starts a new run."""
        gap = max(0, start - self.stop)
        if 8 * (self.gaps + gap) > self.covered + stop - start + 4096:
            return False
        self.stop, self.gaps, self.covered = max(self.stop, stop), self.gaps + gap, self.covered + stop - start
        self.indices.append(i)
        return True


def _runs(tensors: list[torch.Tensor]) -> list[_Run]:
    """Runs of tensors adjacent in one storage (`_Run`), in storage order within each storage."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype, t.untyped_storage().data_ptr()), []).append(i)
    runs: list[_Run] = []
    for members in groups.values():
        members.sort(key=lambda i: tensors[i].storage_offset())
        current = None
        for i in members:
            start = tensors[i].storage_offset()
            stop = start + tensors[i].numel()
            if current is None or not current.take(i, start, stop):
                current = _Run(tensors[i], start, stop, [i], covered=stop - start)
                runs.append(current)
    return runs


def pack(tensors: dict, arena: Arena | None = None) -> dict:
    """The same tensors as views of one storage per run (module note: packing): zero-copy views of the
    live memory without `arena`, copies in `arena` (on the CPU) with it. Non-tensors pass through."""
    out = dict(tensors)
    keys = []
    for key, t in tensors.items():
        if isinstance(t, torch.Tensor):
            if t.numel() and t.is_contiguous():
                keys.append(key)
            else:  # empty or strided (a rare buffer): a copy of its own
                out[key] = t.detach().to("cpu", copy=True)
    views = [tensors[k].detach() for k in keys]
    runs = _runs(views)
    if arena is not None:
        need: dict[torch.dtype, int] = {}
        for run in runs:
            need[run.member.dtype] = need.get(run.member.dtype, 0) + run.stop - run.start
        bufs = {dtype: _exact(arena.take(dtype, n)) for dtype, n in need.items()}
        used = dict.fromkeys(need, 0)
    for run in runs:
        dtype, n = run.member.dtype, run.stop - run.start
        live = run.member.as_strided((n,), (1,), run.start)
        if arena is None:
            base = _exact(live)
        else:
            base = bufs[dtype][used[dtype]:used[dtype] + n]
            base.copy_(live, non_blocking=base.is_pinned())  # module note: accelerators
            used[dtype] += n
        for i in run.indices:
            offset = views[i].storage_offset() - run.start
            out[keys[i]] = base[offset:offset + views[i].numel()].view(views[i].shape)
    return out


def module_entries(module: torch.nn.Module, trainable: dict[int, str]):
    """(entries, aliases): state_dict tensors that are not trainable parameters (frozen parameters,
    buffers) by key, and every key that names a tensor already seen under another name (tied weights)."""
    entries, aliases, seen = {}, {}, dict(trainable)
    for key, t in module.state_dict(keep_vars=True).items():
        name = seen.get(id(t))
        if name is not None:
            if name != key:
                aliases[key] = name
            continue
        seen[id(t)] = key
        entries[key] = t
    return entries, aliases


def _fragments(eng, adapter, names: dict[int, str], model_rank: int):
    """This rank's tensors ("name::kind" -> tensor) and index (name -> [start, stop, {kind: class}]).
    A replicated parameter is written by model coordinate 0 only (tensor_shards.py's note)."""
    tensors, index = {}, {}
    if adapter is None:
        return tensors, index
    kinds = adapter.row_kinds() if hasattr(adapter, "row_kinds") else row_kinds(eng.zero_optimizer.optimizer)
    for p in adapter.params():
        name = names[id(p)]
        if model_rank != 0 and not is_partitioned(p):
            continue
        start, stop = adapter.save_rows(p)
        if stop <= start:
            continue
        classes = {}
        for kind, value in adapter.read(p, kinds).items():
            tensors[fmt.tensor_key(name, kind)] = value
            classes[kind] = "rows" if kind == FP32 or kind in kinds else "scalar"
        index[name] = [start, stop, classes]
    return tensors, index


def _entry_fragments(adapter, entries: dict, rank: int, tensors: dict, index: dict) -> None:
    """Frozen parameters and buffers as "module" fragments: whole from rank 0, or, where the stage
    partitions them (stage 3's frozen chunks), each rank's own rows."""
    for key, t in entries.items():
        held = adapter.entry_rows(t) if adapter else None
        if held is None and rank != 0:
            continue
        start, stop, rows = held if held is not None else (0, rows_of(t).shape[0], rows_of(t))
        if stop > start:
            tensors[fmt.tensor_key(key, MODULE)] = rows
            index[key] = [start, stop, {MODULE: "rows"}]


def _engine_state(eng, client_state) -> dict:
    zopt, loader = eng.zero_optimizer, eng.training_dataloader
    groups = [{k: v for k, v in g.items() if k != "params"} for g in eng.optimizer.param_groups] if eng.optimizer else []
    return {
        "counters": counters(eng),
        "lr_scheduler": eng.lr_scheduler.state_dict() if eng.lr_scheduler is not None else None,
        "guard": zopt.guard.state_dict() if zopt is not None else None,
        "param_groups": groups,
        "data_sampler": None if loader is None else {
            **loader.state_dict(), "world_size": eng.comm.world_size,
            "micro_batch": eng.config.train_micro_batch_size_per_gpu},
        "client_state": client_state or {},
        "window": window_record(eng),  # resume_checks.py
    }


def counters(eng) -> dict:
    return {k: getattr(eng, k) for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps")}


def loadable_problem(obj, what: str) -> str | None:
    """Why `obj` could not be loaded back (it would need code execution to unpickle: weights_only), or
    None. Asked at save, not at load."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any refusal means the checkpoint could not be loaded
        lines = str(e).splitlines()
        reason = next((line for line in lines if "Unsupported global" in line), lines[0] if lines else "")
        reason = re.sub(r"\x1b\[[0-9;]*m", "", reason).strip()  # torch's text has terminal colour codes
        return (f"{what} holds objects a weights_only load refuses; keep it to tensors, numbers, strings, "
                f"lists and dicts ({reason})")
    return None


def _described(eng, adapter, index: dict, trainable: dict, entries: dict, degree: int) -> dict:
    """name -> [full shape, dtype, trainable, tensor-parallel layout or None] for the tensors this rank
    lists (placement.py's table; a shard's full shape: tensor_shards.py)."""
    named = dict(eng.module.named_parameters())
    out = {}
    for name in index:
        t = named.get(name, entries.get(name))
        shape = adapter.shape(t) if adapter else t.shape  # stage 3: not the placeholder's
        layout = tensor_shards.shard_entry(t, degree)
        if layout is not None:
            shape = tensor_shards.full_shape(t)
        out[name] = [list(shape), str(t.dtype).replace("torch.", ""), name in trainable.values(), layout]
    return out


def _metadata(eng, tag, gathered: list[dict], world: int) -> dict:
    params, aliases, keys = merge_tables(gathered)
    coords = [list(table["coord"]) for table in gathered]
    return {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "tag": tag,
            "world_size": world, "data_parallel_size": eng.comm.world_size,
            "pipe_parallel_size": 1 + max(c[0] for c in coords), "model_parallel_size": 1 + max(c[2] for c in coords),
            "coordinates": coords,  # global rank r's [pipe, data, model] (placement.py's note)
            "zero_stage": getattr(eng.zero_optimizer, "stage", 0),
            "precision": precision_name(eng.config), "counters": counters(eng),
            "optimizer": optimizer_record(eng),  # resume_checks.py
            "params": params, "aliases": aliases, "state_dict_keys": keys,
            "config": fmt.redact_secrets(eng.config.to_dict())}  # a world-readable file (format.py's note)


def take_snapshot(eng, save_dir: Path, tag: str, client_state, save_latest: bool, keep_last,
                  arena: Arena | None = None, tag_validation: str = "Warn", world_comm=None) -> Snapshot:
    """This rank's share of a save; with `arena` (async) its tensors are copies in the arena, else
    views of the live state (module note: packing). `world_comm` spans every process (the writer's
    group; placement.py's note): files are named by global rank; rows are cut by data-parallel rank."""
    world_comm = world_comm if world_comm is not None else eng.comm
    adapter = adapter_for(eng.zero_optimizer, eng.comm.rank, eng.comm.world_size)
    release = None
    if arena is not None and hasattr(adapter, "freeze"):  # NVMe state: file copies, not memory (nvme.py)
        adapter.freeze()
        release = adapter.release()
    try:
        return _snapshot(eng, adapter, save_dir, tag, client_state, save_latest, keep_last, arena,
                         tag_validation, world_comm, release)
    except BaseException:
        if release is not None:
            release()
        raise


def _snapshot(eng, adapter, save_dir, tag, client_state, save_latest, keep_last, arena, tag_validation,
              world_comm, release) -> Snapshot:
    comm = eng.comm
    rank, world = world_comm.rank, world_comm.world_size
    names = {id(p): n for n, p in eng.module.named_parameters()}
    trainable = {id(p): names[id(p)] for p in adapter.params()} if adapter else {}
    coord, degree = coordinates(eng), model_degree(eng)
    tensors, index = _fragments(eng, adapter, names, coord.model)
    streams = adapter.streams() if hasattr(adapter, "streams") else []  # NVMe state: streamed.py's note
    entries, aliases = module_entries(eng.module, trainable)
    # buffers and frozen tensors are replicated over the model axis, written by model coordinate 0, but
    # each model coordinate writes its own frozen tensor-parallel shards (tensor_shards.py's note)
    written = entries if coord.model == 0 else {k: t for k, t in entries.items() if is_partitioned(t)}
    _entry_fragments(adapter, written, comm.rank, tensors, index)  # data rank 0 of each stage
    tensors = _pack_around(tensors, streams, arena)
    ready = _copies_enqueued(tensors) if arena is not None else None
    nonce = new_nonce() if rank == 0 else None
    table = {"coord": list(coord), "index": index,
             "described": _described(eng, adapter, index, trainable, entries, degree),
             "aliases": aliases, "keys": list(eng.module.state_dict().keys())}
    # Refused on rank 0 (which writes it), raised on every rank: the others would write and then wait in
    # the commit's exchange for a rank 0 that left the save (a job that caught the error hung).
    problem = loadable_problem(client_state or {}, "client_state") if rank == 0 else None
    gathered = world_comm.all_gather_object(((tag, nonce, problem), table))
    if gathered[0][0][2] is not None:
        raise TypeError(gathered[0][0][2])
    _validate_tags([g[0][0] for g in gathered], tag_validation)
    tag = gathered[0][0][0]  # rank 0's, the committer's: each rank's own put its file in another directory
    warn_if_mid_window_save(eng, tag)
    snap = Snapshot(Path(save_dir), tag, gathered[0][0][1], rank,
                    {"format": fmt.FORMAT_NAME, "rank": rank, "world_size": world, "tag": tag,
                     "coord": table["coord"], "tensors": tensors, "rng": rng_state(),
                     "optimizer": save_rank_state(eng)},
                    save_latest=save_latest, keep_last=keep_last, ready=ready, streams=streams,
                    release=release,
                    nbytes=sum(t.numel() * t.element_size() for t in tensors.values() if isinstance(t, torch.Tensor)))
    if rank == 0:
        snap.engine_state = _engine_state(eng, client_state)
        snap.metadata = _metadata(eng, tag, [g[1] for g in gathered], world)
    return snap


def _pack_around(tensors: dict, streams: list, arena: Arena | None) -> dict:
    """`pack`; for an async save with streamed state (NVMe, nvme.py's note: async save) its
    placeholders stay zero-copy views, their bytes read by the writer from the snapshot copies, and
    the rest (per-step scalars, buffers: small) is copied storage by storage rather than into the
    arena, so the file is byte for byte the synchronous save's (same storages, same order)."""
    streamed = {k for k, t in tensors.items()
                if isinstance(t, torch.Tensor) and any(s.contains(t.untyped_storage()) for s in streams)}
    if arena is None or not streamed:
        return pack(tensors, arena)
    out, copies = pack(tensors), {}
    for k, t in out.items():
        if k in streamed or not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in copies:
            copy = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu")
            copy.untyped_storage().copy_(storage)  # from an accelerator too: a blocking copy, small
            copies[storage.data_ptr()] = copy.untyped_storage()
        out[k] = torch.empty(0, dtype=t.dtype, device="cpu").set_(copies[storage.data_ptr()], t.storage_offset(),
                                                                  t.shape, t.stride())
    return out


def _copies_enqueued(tensors: dict):
    """An event after the arena copies when any came from an accelerator (module note), else None."""
    if torch.cuda.is_available() and any(isinstance(t, torch.Tensor) and t.is_pinned() for t in tensors.values()):
        event = torch.cuda.Event()
        event.record()
        return event
    return None


def _validate_tags(tags: list[str], policy: str) -> None:
    """checkpoint.tag_validation (DeepSpeed): ranks saving under different tags is a bug in the caller."""
    if policy == "Ignore" or len(set(tags)) == 1:
        return
    msg = f"ranks disagree on the checkpoint tag: {sorted(set(tags))} (checkpoint.tag_validation)"
    if policy == "Fail":
        raise ValueError(msg)
    import warnings
    warnings.warn(f"{msg}; every rank saves under rank 0's tag {tags[0]!r}", stacklevel=3)
