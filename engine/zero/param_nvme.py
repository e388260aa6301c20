"""`offload_param.device: "nvme"` at ZeRO stage 3: the partition store swapped for swap files.

[Note: param nvme] `attach_param_nvme` runs once the stage-3 optimizer is built (its partition in host
memory, tier.py's stage-3 note) and before the NVMe optimizer tier, if any: it writes the partition
into per-rank swap files under a per-job directory of `offload_param.nvme_path`
(offload/param_swap.py; the frozen parameters' chunks into a chunk file of their own,
stage3_frozen.py), makes that the partition's store (partition_store.py's note: every reader
goes through it) and tells the coordinator how many groups to read ahead of their gathers (the pool's
buffers; each as large as the largest group's slots, at most `buffer_size`, which is refused when
smaller than that); where the partition is larger than `max_in_cpu` (host memory is the limit) it bounds
the heap (offload/host_heap.py). `finish_param_nvme` runs after the optimizer tier: with the optimizer on NVMe too, the master
now lives in the optimizer's files and the flats' host bytes are dropped (with 16-bit parameter files
the store reads and writes the master there: param_swap.py's note, 16-bit files).
"""
from __future__ import annotations

import torch

import schemas
from offload import AsyncFileIO, OffloadIOError, SwapBufferPool, SwapDir
from offload.host_heap import bound_heap_retention
from offload.chunk_file import ChunkFile
from offload.param_swap import NvmeParamStore
from .nvme_tier import wants_nvme
from .stage3_params import partition_numel

PATH_KEY = "zero_optimization.offload_param.nvme_path"


def wants_param_nvme(zero) -> bool:
    section = zero.offload_param
    return zero.stage == 3 and section is not None and section.device == "nvme"


def host_memory_is_the_limit(zero, partition_numel: int) -> bool:
    """Parameters on NVMe whose partition (`partition_numel` elements of slots) does not all stay
    resident under `offload_param.max_in_cpu`: ZeRO-Infinity where host memory is what runs out. Then
    the heap is bounded (offload/host_heap.py) and, unless the config says, the gradient partition is
    swapped too (grad_swap.py's note: when); a partition that fits the resident budget needs neither."""
    return wants_param_nvme(zero) and partition_numel > zero.offload_param.max_in_cpu


def _group_numels(zopt) -> list[tuple[str, int]]:
    fragments = zopt.partition.fragments
    return [(g.name, sum(fragments[p].padded for p in g.params if p in fragments)) for g in zopt.coordinator.groups]


def _file_dtype(zopt, zero) -> torch.dtype:
    """What the parameter files hold (offload/param_swap.py's note: 16-bit files): the model dtype where
    it is 16-bit, the same for every flat, every chunk the partition starts from is in it (so the master
    read back from the files is exact) and the fp32 master is kept elsewhere for good: in host memory
    (the optimizer on the host) or in the NVMe optimizer's files, written before the first step (with
    `fast_init` the tier reads its first master from these files: fp32 then); fp32 otherwise."""
    dtypes = {key[1] for key in zopt.partition.flat}  # a flat per (param group, model dtype)
    if (wants_nvme(zero) and zero.offload_optimizer.fast_init) or len(dtypes) != 1:
        return torch.float32
    (dtype,) = dtypes
    chunks = getattr(zopt.partition, "swapped_init", {}).values()
    if dtype not in (torch.float16, torch.bfloat16) or any(c.dtype != dtype for cs in chunks for _, c in cs):
        return torch.float32
    return dtype


def _swap_dir(section) -> SwapDir:
    try:
        return SwapDir.create(section.nvme_path, path_key=PATH_KEY)
    except OffloadIOError as bad_path:  # missing / unwritable nvme_path: a config mistake, said as one
        raise schemas.ConfigError([str(bad_path)]) from None


def attach_param_nvme(zopt, zero, aio) -> NvmeParamStore:
    section = zero.offload_param
    largest = max(_group_numels(zopt), key=lambda t: t[1], default=("", 0))
    if largest[1] > section.buffer_size:
        raise schemas.ConfigError([f"zero_optimization.offload_param.buffer_size: {section.buffer_size} elements "
                                   f"cannot hold module '{largest[0]}' ({largest[1]} elements of this rank's "
                                   f"partition are gathered together); raise it to at least {largest[1]}"])
    if section.buffer_count < 1:
        raise schemas.ConfigError(["zero_optimization.offload_param.buffer_count: must be at least 1"])
    if host_memory_is_the_limit(zero, partition_numel(zopt.optimizer, zopt.comm.world_size)):  # as grads_swapped
        bound_heap_retention()  # where the bound pays (offload/host_heap.py's notes)
    if len(zopt.frozen_chunks):  # before the store closes zero.Init's file (stage3_frozen.py's note)
        left = int(section.max_in_cpu) - partition_numel(zopt.optimizer, zopt.comm.world_size)  # trainable first
        zopt.frozen_chunks.move_to_file(lambda: ChunkFile(_swap_dir(section), AsyncFileIO(aio, path_key=PATH_KEY),
                                                          name=f"rank{zopt.comm.rank}", kind="frozen"),
                                        keep=max(0, left))
    swap, io = _swap_dir(section), None
    try:
        io = AsyncFileIO(aio, path_key=PATH_KEY)
        dtype = _file_dtype(zopt, zero)
        pool = SwapBufferPool(section.buffer_count, max(1, largest[1]), dtype=dtype, pin_memory=section.pin_memory,
                              count_key="zero_optimization.offload_param.buffer_count")
        store = NvmeParamStore(zopt.partition, swap, io, pool, int(section.max_in_cpu), name=f"rank{zopt.comm.rank}",
                               dtype=dtype)
    except BaseException:
        if io is not None:  # its worker threads and the swap files' descriptors (the partition's writes)
            io.close()
        swap.close()
        zopt.frozen_chunks.close()
        raise
    zopt.partition.store = store
    zopt.coordinator.read_ahead_groups = section.buffer_count
    zopt.frozen_chunks.limit = section.buffer_count  # frozen chunks read ahead as far (stage3_frozen.py)
    for params in zopt.persistent_groups():  # resident from the start where max_in_cpu has room for them
        store.persistent_slots(params)
    return store


def init_chunk_file(cfg, rank: int) -> ChunkFile:
    """`zero.Init(remote_device="nvme")`'s file, in a per-job directory of the config's
    `offload_param.nvme_path` (DeepSpeed's Init reads the same key)."""
    if cfg is None or not wants_param_nvme(cfg.zero_optimization):
        raise schemas.ConfigError(['engine.zero.Init(remote_device="nvme") needs config_dict_or_path (or config) '
                                   'with zero_optimization.stage 3 and zero_optimization.offload_param.device '
                                   '"nvme" with its nvme_path; pass that config, or use remote_device "cpu"'])
    bound_heap_retention()
    try:
        swap = SwapDir.create(cfg.zero_optimization.offload_param.nvme_path, path_key=PATH_KEY)
    except OffloadIOError as bad_path:
        raise schemas.ConfigError([str(bad_path)]) from None
    return ChunkFile(swap, AsyncFileIO(cfg.aio, path_key=PATH_KEY), name=f"rank{rank}")


def refuse_unconsumed_init_chunks(zopt, zero) -> None:
    """Chunks zero.Init put on NVMe need the NVMe parameter store to read them (stage3_params.py)."""
    if zopt.partition.swapped_init and not wants_param_nvme(zero):
        raise schemas.ConfigError(['the model was built with engine.zero.Init(remote_device="nvme"), but '
                                   'zero_optimization.offload_param.device is not "nvme" in the config given to '
                                   'initialize(); set it (with its nvme_path), or build with remote_device "cpu"'])


def finish_param_nvme(zopt) -> None:
    """After the optimizer tier is built: with NVMe optimizer offload the master is in its files; else
    the optimizer steps the host flat, which must hold it (read back when zero.Init left it unwritten)."""
    if zopt.nvme is not None:
        zopt.partition.store.drop_host_master(master_source=zopt.nvme)
    else:
        zopt.partition.store.load_host_master()
