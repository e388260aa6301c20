"""What runs inside each rank of a suite measurement (benchmarks/suite.py): one system's timed steps,
its peak RSS and the bytes it communicated. Every system trains the same GPT on the same global batch
per optimizer step (2 ranks x micro-batch 8 = 16 sequences): data-parallel systems feed each rank its
own micro-batch; tensor parallelism and the pipeline hold one model copy over both ranks, so they run
gradient_accumulation_steps micro-batches per step (config) on the data of data-parallel rank 0."""
from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks import bench_training as bt
from benchmarks.comm_bytes import DispatchBytes, bytes_sent, communicator_payloads, count_ddp_buckets
from benchmarks.peak_rss import peak_mb, restart_peak
from examples.gpt import GPT, GPTConfig

# How each system's bytes/step/rank is counted (the report prints this next to the table). One
# convention for all: the bytes one rank sends, from each collective's payload and group size
# (benchmarks/comm_bytes.py's table: all-reduce 2(n-1)/n of the buffer, reduce-scatter and all-gather
# (n-1)/n of the full tensor, send the tensor).
COUNTED_BY = {
    "dstrain": "dstrain's communicator counter (engine/comm.py: every data-parallel collective's payload), "
               "converted to bytes sent, over every step",
    "dstrain's pipeline and tensor-parallel rows": "a dispatch mode over every torch.distributed op called from "
                        "Python (benchmarks/comm_bytes.py), converted to bytes sent with each op's group size "
                        "(pipeline sends, tensor-parallel layers and ZeRO-3 inside a stage use groups of their own), "
                        "in the last warm-up step only: it intercepts every tensor op, so no measured step runs under it",
    "ddp": "a comm hook around torch's default all-reduce hook (each gradient bucket), converted to bytes sent",
    "fsdp2": "the dispatch mode of benchmarks/comm_bytes.py (FSDP2's all-gathers and reduce-scatters), in the "
             "last warm-up step, converted to bytes sent",
    "deepspeed": "DeepSpeed's own comms_logger (config section comms_logger, prof_all), converted to bytes sent "
                 "(it logs an all-gather's input shard, 1/n of the gathered tensor); its pipeline and AutoTP rows: "
                 "the dispatch mode in one step its median leaves out, as dstrain's",
}


def nvme_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), "dstrain-suite-nvme")
    os.makedirs(path, exist_ok=True)
    return path


def counted_step(warmup: int) -> int:
    """The step a dispatch-mode count runs in: the last warm-up step (out of the median, past the first
    step's one-time traffic where there are two); step 0 when there is no warm-up."""
    return max(warmup - 1, 0)


def rank_entry(system: str, steps: int, model: dict, micro: int, warmup: int, config: dict | None) -> dict:
    """One system's median step ms, peak RSS and bytes one rank sends per step (comm_bytes.py)."""
    torch.manual_seed(0)
    cfg = GPTConfig(**model)
    if system == "ddp":
        times, sent = _ddp(steps, cfg)
    elif system == "fsdp2":
        seen = DispatchBytes()
        times = bt._run_fsdp2(steps, True, cfg, seen, counted_step(warmup))
        sent = seen.bytes  # one step's
    elif system == "bound":
        times, sent = _bound(steps, cfg, micro), None
    else:
        times, sent, (share, data_world) = _dstrain(steps, cfg, config, warmup)
        return {"step_ms": statistics.median(times[warmup:]), "rss_mb": bt._peak_rss_mb(), "bytes": sent,
                "model_share": share, "data_world": data_world}
    return {"step_ms": statistics.median(times[warmup:]), "rss_mb": bt._peak_rss_mb(), "bytes": sent}


def _ddp(steps: int, cfg: GPTConfig) -> tuple[list[float], float]:
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(GPT(cfg), gradient_as_bucket_view=True)
    seen = count_ddp_buckets(model, dist.get_world_size())
    opt = torch.optim.AdamW(model.parameters(), lr=bt.LR, fused=True)
    times = bt._timed_loop(bt._torch_step(model, opt), bt._batches(steps, dist.get_rank(), cfg))
    return times, bytes_sent(seen["payloads"]) / steps


def _bound(steps: int, cfg: GPTConfig, micro: int) -> list[float]:
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=bt.LR, fused=True)
    return bt._timed_loop(bt._torch_step(model, opt), bt._batches(steps, 0, cfg, micro))


def _dstrain(steps: int, cfg: GPTConfig, config: dict, warmup: int) -> tuple[list[float], float]:
    """dstrain's steps; bytes per step from its communicator over all steps, or (pipeline, tensor
    parallel: communicators of their own) the dispatch mode over one warm-up step."""
    import engine
    pipe = "pipeline" in config
    if pipe:
        from engine.pipe import PipelineModule
        from examples.gpt_pipe import gpt_layers, gpt_loss
        from engine.topology import Topology
        degree = config.get("tensor_parallel", {}).get("autotp_size", 1)  # AutoTP shards the stages' blocks
        topology = Topology.for_world(dist.get_world_size(), pipe=config["pipeline"]["stages"], model=degree)
        model = PipelineModule(gpt_layers(cfg), topology=topology, loss_fn=gpt_loss)
    else:
        model = GPT(cfg)
    one_copy = pipe or "tensor_parallel" in config
    eng, _, _, _ = engine.initialize(model=model, config=config)
    from engine.topology import current
    gas = config["gradient_accumulation_steps"]
    # each data-parallel rank its own data; ranks of one model copy (pipe, tensor) the same
    batches = bt._batches(steps * gas, current().coord.data, cfg, config["train_micro_batch_size_per_gpu"])
    groups = [batches[i * gas:(i + 1) * gas] for i in range(steps)]

    def step(group):
        if pipe:
            eng.train_batch(iter(group))
            return
        for x, y in group:
            eng.backward(eng(x, y))
            eng.step()
    seen, times = DispatchBytes(), []
    for i, group in enumerate(groups):
        with (seen if one_copy and i == counted_step(warmup) else contextlib.nullcontext()):
            t0 = time.perf_counter()
            step(group)
            times.append((time.perf_counter() - t0) * 1e3)
    sent = seen.bytes if one_copy else bytes_sent(communicator_payloads(eng.comm.stats.bytes,
                                                                         eng.comm.world_size)) / steps
    share = model_parallel_share(eng.module), eng.comm.world_size
    eng.destroy()
    return times, sent, share


def model_parallel_share(module: torch.nn.Module) -> int:
    """Ψ of this rank's model-parallel share: the parameters its pipeline stage holds, each at its
    tensor-parallel shard's size, before ZeRO partitions them over the data axis (a stage-3 parameter
    keeps that size in `ds_shape` while its data is a placeholder: engine/zero/stage3_params.py)."""
    return sum(torch.Size(getattr(p, "ds_shape", p.shape)).numel() for p in module.parameters())


# -- several measurements in one spawn --------------------------------------------------------------------
def rank_batch(items: list[tuple], steps: int, micro: int, warmup: int) -> list[dict]:
    """`rank_entry` for each (system, model, config) in turn in this one process: on a shared 2-core
    machine a spawn (torch, gloo) costs more than a small model's steps. Peak RSS: benchmarks/peak_rss.py.
    An item that fails is its error's text (a "not built yet" refusal is one row's "not run: why")."""
    rows = []
    for system, model, config in items:
        restart_peak()
        try:
            row = rank_entry(system, steps, model, micro, warmup, config)
        except Exception as e:  # noqa: BLE001 - one row's failure, not the batch's
            rows.append({"error": f"{type(e).__name__}: {e}"})
            continue
        row["rss_mb"] = peak_mb()
        rows.append(row)
    return rows
