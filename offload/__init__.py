"""Moving tensors out of accelerator memory (ZeRO-Offload / ZeRO-Infinity): async file I/O, aligned
and pinned buffer pools, and the sub-group stepper that keeps optimizer state in swap files.

The interface the engine calls (stable; later versions add, never change):

    from offload import AsyncFileIO, SwapBufferPool, SwapDir, SwappedPartition, sub_group_buffer_elements
    key = "zero_optimization.offload_optimizer.nvme_path"
    swap = SwapDir.create(cfg.offload_optimizer.nvme_path, path_key=key)    # per-job dir; sweeps stale ones
    io = AsyncFileIO(config.aio, path_key=key)                              # reads every `aio` key
    pool = SwapBufferPool(cfg.offload_optimizer.buffer_count,               # fixed, aligned host buffers,
                          sub_group_buffer_elements(numel, cfg.sub_group_size),  # pinned with an accelerator
                          pin_memory=cfg.offload_optimizer.pin_memory)
    part = SwappedPartition(numel, lambda params: torch.optim.AdamW(params, lr=..., fused=True),
                            swap, io, pool, cfg.sub_group_size,
                            pipeline_read=..., pipeline_write=..., name="rank0-group0")
    part.initialize(lambda start, end: fp32_master[start:end])   # once, before the first step
    for group in part.param_groups: group["lr"] = lr              # LR schedule: the inner optimizer's groups
    part.step(lambda start, end: fp32_grad[start:end],            # skip a step (overflow) by not calling it
              lambda start, end, master: model_flat[start:end].copy_(master),  # master valid during the call
              lambda start, end: model_flat[start:end])  # optional: an exact copy of the master, read instead
    part.step_order()                        # the sub-groups the next step visits (it alternates: kept ones first)
    part.read_master(start, stop); part.start_read_master(out, start)  # the committed fp32 master, between steps
    for chunk in part.state_chunks(): ...    # checkpoint: {"start","end","master","state":{k: t},"scalars"}
    part.load_chunks(chunks)                 # from such chunks, cut at any boundaries, ascending
    part.sweep(visit, read={key: slot}, write=[keys]); part.commit(scalars)  # a step in several passes
                                             # (Lamb, Muon: engine/zero/nvme_per_tensor.py)
    part.close(); io.close(); swap.close()   # swap also closes at exit and on the next start after a kill

Errors of the swap tier are `OffloadIOError`, one line naming the path and the key to change; state
the optimizer's declared layout (ops/state_layout.py) does not describe is `StateLayoutError`.
`pool.acquire()` / `pool.release(buf)` are there for other swappers: `offload.param_swap.NvmeParamStore`
(stage-3 parameters on NVMe, a partition store: engine/zero/partition_store.py's note) uses them, and
`offload.chunk_file`'s `ChunkFile` / `SwappedChunk` hold `zero.Init(remote_device="nvme")`'s chunks until it copies them.
"""
from offload.aio import AsyncFileIO, IOHandle, OffloadIOError, OffloadIOWarning, aligned_empty
from offload.pool import SwapBufferPool
from offload.swap_dir import SwapDir
from offload.swapped_partition import SwappedPartition, learn_state_layout, sub_group_buffer_elements

__all__ = ["AsyncFileIO", "IOHandle", "OffloadIOError", "OffloadIOWarning", "SwapBufferPool", "SwapDir",
           "SwappedPartition", "aligned_empty", "learn_state_layout", "sub_group_buffer_elements"]
