"""ZeRO-Infinity on this machine (issue 17, benchmark 4): a GPT of `--params` parameters built with
`engine.zero.Init(remote_device="nvme")` and trained with ZeRO-3, parameters and optimizer on NVMe.

    nice -n 19 python benchmarks/bench_infinity.py --params 50e6 --steps 3 [--nvme-path DIR] [--world 2]
        [--deepspeed-venv /tmp/ds-venv]

Each rank builds its chunks straight into swap files (the model never exists in host memory), trains
`--steps` steps of AdamW (fp32, one fixed micro-batch of `--micro` x `--seq` random tokens, so the
loss falls when the updates reach the weights) and reports per step
its loss and time; then its peak RSS (ru_maxrss; also less the RSS at the rank's start, torch and the
engine imported) next to `dstrain estimate`'s host + accelerator
bytes for the "nvme params+optimizer" row (one CPU holds both here; the estimate counts model state,
not activations or the framework), the bytes the process read from and wrote to storage
(/proc/self/io: the block layer's count, O_DIRECT included) and the parameter store's own counts.
Before a large run check `df` under `--nvme-path`: the swap files take about 4 (parameters) + 2 x 12
(optimizer master and moments, two slots) bytes per parameter, plus the 4 bytes per parameter of
zero.Init's file while initialize() copies it. Swap directories are removed at exit.
`--deepspeed-venv`: then the same GPT and config under DeepSpeed (deepspeed_infinity_peer.py, its
zero.Init(remote_device="nvme"), CPU Adam and async_io op), after dstrain's ranks exited, swap files
under the same directory; its rows are printed below dstrain's.
`--gradients swap,memory`: what the gradient swap costs (engine/zero/grad_swap.py): dstrain once with
the gradient partition in swap files (as it runs) and once in host memory (grad_swap.SWAP_GRADIENTS
False in the ranks: a benchmark switch, not a config key), each with its median backward and step
time after the first step (benchmarks/step_phases.py) and rank 0's gradient bytes written and read
per step against the raw O_DIRECT disk bandwidth measured first under the same directory
(bench_offload_io.disk_bandwidth, `--disk-mb`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.gpt import GPT, GPTConfig, RandomTokens  # noqa: E402
from benchmarks.step_phases import StepPhases, fixed_batch_steps  # noqa: E402
from offload.estimate import EstimateSettings, estimate_memory  # noqa: E402
from tests.harness import run_distributed  # noqa: E402

VOCAB = 8192


def gpt_config(params: float, seq: int) -> GPTConfig:
    """A GPT of about `params` parameters: 12 L d^2 in the blocks plus the tied embedding."""
    layers = 8 if params < 2e8 else 16 if params < 1e9 else 32
    d = (params / (12 * layers)) ** 0.5
    d = max(64, int(round(d / 64)) * 64)
    return GPTConfig(vocab_size=VOCAB, seq_len=seq, n_layer=layers, n_head=max(1, d // 64), d_model=d)


def ds_config(nvme_path: str, micro: int, group: int, sub_group: int = 10_000_000, bucket: int = 20_000_000) -> dict:
    nvme = {"device": "nvme", "nvme_path": nvme_path}
    return {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
            "zero_optimization": {
                # gradient buckets bounded too (4 in flight, partitioned.py): the default 5e8 elements
                # would hold a 2.5B model's gradients four times over at 2 GB per bucket
                "stage": 3, "reduce_bucket_size": bucket,
                "sub_group_size": sub_group, "stage3_max_live_parameters": 100_000_000,
                "stage3_prefetch_bucket_size": 50_000_000, "stage3_max_reuse_distance": 100_000_000,
                "offload_optimizer": {**nvme, "buffer_count": 9, "pipeline_read": True, "pipeline_write": True},
                # a block's largest module is one gather group; max_in_cpu 0: every gather reads the files
                "offload_param": {**nvme, "buffer_count": 5, "buffer_size": group, "max_in_cpu": 0}},
            "aio": {"block_size": 1_048_576, "queue_depth": 8, "intra_op_parallelism": 2}}


def _io() -> dict:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def settings(cfg: dict) -> EstimateSettings:
    zero = cfg["zero_optimization"]
    return EstimateSettings(precision="fp32", reduce_bucket_size=zero["reduce_bucket_size"],
                            max_live_parameters=zero["stage3_max_live_parameters"],
                            sub_group_size=zero["sub_group_size"],
                            optimizer_buffer_count=zero["offload_optimizer"]["buffer_count"],
                            param_buffer_count=zero["offload_param"]["buffer_count"],
                            param_buffer_size=zero["offload_param"]["buffer_size"],
                            max_in_cpu=zero["offload_param"]["max_in_cpu"])


def _rank(model_cfg: GPTConfig, cfg: dict, steps: int, gradients: str = "swap") -> dict:
    import torch.distributed as dist

    import engine
    from engine.zero import grad_swap
    grad_swap.SWAP_GRADIENTS = gradients == "swap"  # this rank only (module docstring: --gradients)
    torch.set_num_threads(1)
    rank = dist.get_rank()
    import psutil
    rss_start = psutil.Process().memory_info().rss  # torch and the engine, imported: not model state
    io0, t0 = _io(), time.perf_counter()
    torch.manual_seed(0)
    with engine.zero.Init(remote_device="nvme", config_dict_or_path=cfg):
        model = GPT(model_cfg)
    eng, _, _, _ = engine.initialize(model=model, config=cfg)
    built_s, rss_built = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # one fixed batch per rank, every step: a loss that falls says the updates reach the weights
    x, y = RandomTokens(cfg["train_micro_batch_size_per_gpu"], model_cfg.seq_len, model_cfg.vocab_size, seed=rank)[:]
    phases = StepPhases()
    losses, times = fixed_batch_steps(eng, x, y, steps, phases)
    store, swap = eng.zero_optimizer.partition.store, eng.zero_optimizer.grad_swap
    io1 = _io()
    out = {"losses": losses, "step_s": times, "build_s": built_s, "peak_rss": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024, "rss_after_build": rss_built, "rss_start": rss_start,
        "disk_read": io1["read_bytes"] - io0["read_bytes"], "disk_written": io1["write_bytes"] - io0["write_bytes"],
        "store_read": store.bytes_read, "store_written": store.bytes_written,
        "partition_host_bytes": eng.zero_optimizer.model_state_bytes()["partition"], "phases_ms": phases.medians(),
        "grad_written": swap.bytes_written if swap else 0, "grad_read": swap.bytes_read if swap else 0,
        "held_written": swap.held.bytes_written if swap else 0}
    eng.destroy()
    return out


def _largest_group(model_cfg: GPTConfig, world: int) -> int:
    """Elements of this rank's share of the largest gather group (a block's fc or out weight, or the
    root's tied embedding and positions), padded: the parameter pool's buffer size."""
    d = model_cfg.d_model
    block = 12 * d * d + 13 * d
    root = (model_cfg.vocab_size + model_cfg.seq_len) * d
    return -(-max(block, root) // world) + 4096


def deepspeed_rows(venv: str, model_cfg: GPTConfig, cfg: dict, steps: int, world: int,
                   buffers: dict[str, int | None]) -> list[dict]:
    """The same GPT and config under DeepSpeed (benchmarks/deepspeed_infinity_peer.py in its venv): one
    row per rank, or [{"error": ...}] when it did not run. `buffers`: DeepSpeed's `buffer_count` for the
    "offload_param" / "offload_optimizer" section instead of the config's, where not None: its parameter
    swapper holds one parameter tensor per buffer for as long as it is gathered, and its pipelined
    optimizer swapper takes 4 buffers (fp32 weights, two moments, gradient) per sub-group in flight."""
    peer = Path(__file__).resolve().parent / "deepspeed_infinity_peer.py"
    zero = dict(cfg["zero_optimization"])
    for section, count in buffers.items():
        if count:
            zero[section] = {**zero[section], "buffer_count": count}
    cfg = {**cfg, "zero_optimization": zero}
    cmd = [str(Path(venv, "bin", "python")), str(peer), "--model-json", json.dumps(dataclasses.asdict(model_cfg)),
           "--config-json", json.dumps(cfg), "--steps", str(steps), "--world", str(world)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=6 * 3600)
    if result.returncode != 0:
        return [{"error": (result.stderr.strip().splitlines() or ["no output"])[-1][:300]}]
    return json.loads(result.stdout.strip().splitlines()[-1])


def print_deepspeed(rows: list[dict]) -> None:
    mib = 2**20
    for r, out in enumerate(rows):
        if "error" in out:
            print(f"deepspeed rank {r}: not run: {out['error']}")
            continue
        print(f"deepspeed rank {r}: build {out['build_s']:.1f} s; " + "; ".join(
            f"step {k}: loss {loss:.4f}, {t:.1f} s" for k, (loss, t) in enumerate(zip(out["losses"], out["step_s"]))))
        print(f"deepspeed rank {r}: peak RSS {out['peak_rss'] / mib:.0f} MiB, "
              f"{(out['peak_rss'] - out['rss_start']) / mib:.0f} above the rank's start (after build "
              f"{out['rss_after_build'] / mib:.0f}); disk read {out['disk_read'] / mib:.0f} MiB, written "
              f"{out['disk_written'] / mib:.0f} MiB")


CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def limit_memory(gib: float) -> Path:
    """Move this process (and so the ranks it starts) into a new cgroup-v1 memory group of `gib` GiB,
    page cache included, with swap off for it: the job then runs in less memory than the machine has,
    and a job that needs more is killed by the kernel instead of slowing down. Root only."""
    if not CGROUP_V1.is_dir() or not os.access(CGROUP_V1, os.W_OK):
        raise SystemExit(f"--memory-limit-gib needs a writable cgroup-v1 memory hierarchy at {CGROUP_V1} (root)")
    group = CGROUP_V1 / f"bench-infinity-{os.getpid()}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(int(gib * 2**30)))
    swappiness = group / "memory.swappiness"
    if swappiness.exists():
        swappiness.write_text("0")
    (group / "cgroup.procs").write_text(str(os.getpid()))
    return group


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=50e6)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--nvme-path", default=None, help="directory for the swap files (default: a temp dir)")
    p.add_argument("--sub-group-size", type=float, default=10e6, help="zero_optimization.sub_group_size")
    p.add_argument("--reduce-bucket-size", type=float, default=20e6, help="zero_optimization.reduce_bucket_size")
    p.add_argument("--memory-limit-gib", type=float, default=None,
                   help="run the job in a cgroup memory group of this size (root; the ZeRO-Infinity claim at a "
                        "scale the disk allows: full training state > the memory the job may use)")
    p.add_argument("--deepspeed-venv", default=None, help="then the same GPT and config under DeepSpeed in this venv "
                   "(benchmarks/deepspeed_infinity_peer.py)")
    p.add_argument("--deepspeed-param-buffers", type=int, default=None,
                   help="DeepSpeed's offload_param.buffer_count (default: the config's; DeepSpeed needs one buffer "
                        "per gathered parameter tensor and refuses the config's with 'Not enough buffers')")
    p.add_argument("--deepspeed-optimizer-buffers", type=int, default=None,
                   help="DeepSpeed's offload_optimizer.buffer_count (default: the config's; its pipelined swapper "
                        "needs 4 per sub-group in flight, 12 with pipeline_read and pipeline_write)")
    p.add_argument("--gradients", default="swap", help="comma list of swap, memory: where dstrain's gradient "
                   "partition lives, one run each (module docstring)")
    p.add_argument("--disk-mb", type=int, default=256, help="file size of the raw O_DIRECT bandwidth measurement")
    args = p.parse_args(argv)
    kinds = args.gradients.split(",")
    if not kinds or set(kinds) - {"swap", "memory"}:
        p.error(f"--gradients {args.gradients!r}: expected a comma list of swap, memory")
    group = limit_memory(args.memory_limit_gib) if args.memory_limit_gib else None
    made = args.nvme_path is None
    nvme_path = args.nvme_path or tempfile.mkdtemp(prefix="bench-infinity-")
    model_cfg = gpt_config(args.params, args.seq)
    cfg = ds_config(nvme_path, args.micro, _largest_group(model_cfg, args.world), int(args.sub_group_size),
                    int(args.reduce_bucket_size))
    with torch.device("meta"):
        n = sum(t.numel() for t in GPT(model_cfg).parameters())
    est = next(r for r in estimate_memory(n, gpus_per_node=args.world, settings=settings(cfg))
               if r.stage == 3 and r.offload == "nvme params+optimizer")
    print(f"GPT {n / 1e6:.1f}M parameters ({model_cfg.n_layer} layers, d_model {model_cfg.d_model}), "
          f"{args.world} ranks, swap files under {nvme_path}; load average {os.getloadavg()[0]:.2f}", flush=True)
    disk = None
    try:
        if "memory" in kinds:  # the bandwidth the gradient bytes are set against, where the swap files go
            from benchmarks.bench_offload_io import disk_bandwidth
            with tempfile.TemporaryDirectory(dir=nvme_path) as d:
                disk = disk_bandwidth(d, args.disk_mb * 2**20, repeats=2)
        runs = {kind: run_distributed(_rank, args.world, args=(model_cfg, cfg, args.steps, kind), timeout=6 * 3600)
                for kind in kinds}
        # after dstrain's ranks exited, in the same swap directory (DeepSpeed's swap files go under it)
        buffers = {"offload_param": args.deepspeed_param_buffers, "offload_optimizer": args.deepspeed_optimizer_buffers}
        peer = deepspeed_rows(args.deepspeed_venv, model_cfg, cfg, args.steps, args.world,
                              buffers) if args.deepspeed_venv else None
    finally:
        if made:  # the swap directories inside are removed by the ranks themselves
            shutil.rmtree(nvme_path, ignore_errors=True)
    for kind, per_rank in runs.items():
        _print_dstrain(per_rank, est, "" if kind == "swap" else "[gradient partition in memory] ")
    if disk is not None:
        _print_gradient_costs(runs, disk, args.steps)
    if peer is not None:
        print_deepspeed(peer)
    print(f"full training state 16 B x {n / 1e6:.1f}M = {16 * n / 2**30:.2f} GiB; "
          f"load average {os.getloadavg()[0]:.2f}")
    if group is not None:
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        limit = int((group / "memory.limit_in_bytes").read_text())
        print(f"memory group: limit {limit / 2**30:.2f} GiB, peak use {peak / 2**30:.2f} GiB (every process of the "
              f"job, page cache included; failcnt {(group / 'memory.failcnt').read_text().strip()}); full training "
              f"state / limit = {16 * n / limit:.2f}")
    return 0


def _print_gradient_costs(runs: dict, disk: tuple[float, float], steps: int) -> None:
    """Rank 0's median backward and step, and its gradient swap bytes per step against the disk."""
    mib = 2**20
    print(f"disk (O_DIRECT, best of 2): write {disk[0]:.3f} GB/s, read {disk[1]:.3f} GB/s")
    for kind, per_rank in runs.items():
        out = per_rank[0]
        written, read = out["grad_written"] / steps, out["grad_read"] / steps  # every step lands the same
        at_disk = written / disk[0] / 1e9 + read / disk[1] / 1e9
        print(f"gradients {kind}: rank 0 backward {out['phases_ms']['backward']:.0f} ms, step "
              f"{out['phases_ms']['step']:.0f} ms (medians after the first step); gradient swap per step "
              f"written {written / mib:.1f} MiB, read {read / mib:.1f} MiB = {at_disk:.2f} s at the disk's "
              f"bandwidth; held gradients written in the first backward {out['held_written'] / mib:.1f} MiB")


def _print_dstrain(per_rank: list[dict], est, prefix: str) -> None:
    mib = 2**20
    for r, out in enumerate(per_rank):
        print(f"{prefix}rank {r}: build {out['build_s']:.1f} s; " + "; ".join(
            f"step {k}: loss {loss:.4f}, {t:.1f} s" for k, (loss, t) in enumerate(zip(out["losses"], out["step_s"]))))
        print(f"{prefix}rank {r}: peak RSS {out['peak_rss'] / mib:.0f} MiB, {(out['peak_rss'] - out['rss_start']) / mib:.0f} "
              f"above the rank's start (after build {out['rss_after_build'] / mib:.0f}), "
              f"estimate {(est.host_bytes + est.accelerator_bytes) / mib:.0f} MiB of model state "
              f"(host {est.host_bytes / mib:.0f} + gathered/buckets {est.accelerator_bytes / mib:.0f}), "
              f"NVMe {est.nvme_bytes / mib:.0f} MiB; disk read {out['disk_read'] / mib:.0f} MiB, written "
              f"{out['disk_written'] / mib:.0f} MiB (parameter store {out['store_read'] / mib:.0f} / "
              f"{out['store_written'] / mib:.0f} MiB); host flat {out['partition_host_bytes']} bytes")


if __name__ == "__main__":
    sys.exit(main())
