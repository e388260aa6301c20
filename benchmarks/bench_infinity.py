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
Before a large run check `df` under `--nvme-path` (the run prints the estimator's figure and the free
space first): the swap files take about 4 (parameters) + 2 x 12 (optimizer master and moments, two
slots; `--swap-slots 1`: one, written in place) + 4 (the gradient partition) bytes per parameter, plus
the 4 bytes per parameter of zero.Init's file while initialize() copies it (and, for a model whose
graph has a Python autograd Function such as reentrant checkpointing, the first backward's held
gradients, 4 bytes per parameter per rank, until that backward ends). Swap directories are removed
at exit.
`--deepspeed-venv`: then the same GPT and config under DeepSpeed (deepspeed_infinity_peer.py, its
zero.Init(remote_device="nvme"), CPU Adam and async_io op), after dstrain's ranks exited, swap files
under the same directory; its rows are printed below dstrain's.
`--check-against-torch`: then also single-process torch on the same GPT and global batch
(benchmarks/infinity_agreement.py), each system's losses and gradient norms (before clipping) next to
torch's, and how far its final fp32 parameters are from torch's in units of torch's own update.
`--clip 0`, `--offload-param cpu|none`, `--offload-optimizer cpu|none` switch one feature off at a time
in both systems (the loss-gap diagnosis in README's ZeRO-Infinity paragraph).
`--gradients swap,memory`: what the gradient swap costs (engine/zero/grad_swap.py): dstrain once with
the gradient partition in swap files (as it runs: with the parameters on NVMe that is the default) and
once in host memory (`offload_optimizer.swap_gradients: false`), each with its median backward and step
time after the first step (benchmarks/step_phases.py) and rank 0's gradient bytes written and read
per step against the raw O_DIRECT disk bandwidth measured first under the same directory
(bench_offload_io.disk_bandwidth, `--disk-mb`). Kind `sync-writes`: the gradient swap as in `swap`,
but the parameter store's write-behind off (`NvmeParamStore.write_behind` is its synchronous `write`
in the ranks: a benchmark switch), so `--gradients swap,sync-writes` is write-behind's before/after
(offload/param_swap.py's note). The torch comparison and the parameter files are the first kind's run.
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
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.gpt import GPT, GPTConfig, RandomTokens  # noqa: E402
from benchmarks.infinity_agreement import compare, dump_full_params, torch_reference  # noqa: E402
from benchmarks.step_phases import StepPhases, fixed_batch_steps  # noqa: E402
from offload.estimate import EstimateSettings, estimate_memory  # noqa: E402
from tests.harness import run_distributed  # noqa: E402

VOCAB = 8192
# (offload_param, offload_optimizer) devices -> the `dstrain estimate` row printed next to the peak RSS
ESTIMATE_ROW = {("none", "none"): "none", ("none", "cpu"): "cpu optimizer", ("none", "nvme"): "nvme optimizer",
                ("cpu", "cpu"): "cpu params+optimizer", ("nvme", "cpu"): "nvme params+cpu optimizer",
                ("nvme", "nvme"): "nvme params+optimizer"}


def gpt_config(params: float, seq: int) -> GPTConfig:
    """A GPT of about `params` parameters: 12 L d^2 in the blocks plus the tied embedding."""
    layers = 8 if params < 2e8 else 16 if params < 1e9 else 32
    d = (params / (12 * layers)) ** 0.5
    d = max(64, int(round(d / 64)) * 64)
    return GPTConfig(vocab_size=VOCAB, seq_len=seq, n_layer=layers, n_head=max(1, d // 64), d_model=d)


def ds_config(nvme_path: str, micro: int, group: int, sub_group: int = 10_000_000, bucket: int = 20_000_000,
              clip: float = 1.0, offload_param: str = "nvme", offload_optimizer: str = "nvme",
              swap_pipeline: bool = True, swap_slots: int = 2) -> dict:
    """The run's config: ZeRO-Infinity by default; `offload_param` / `offload_optimizer` "cpu" or
    "none", `clip` 0 and `swap_pipeline` False switch one feature off at a time (`--check-against-torch`'s
    diagnosis)."""
    nvme = {"device": "nvme", "nvme_path": nvme_path}
    tiers = {"offload_optimizer": {**nvme, "buffer_count": 9, "pipeline_read": swap_pipeline,
                                   "pipeline_write": swap_pipeline, **({"swap_slots": 1} if swap_slots == 1 else {})},
             # a block's largest module is one gather group; max_in_cpu 0: every gather reads the files
             "offload_param": {**nvme, "buffer_count": 5, "buffer_size": group, "max_in_cpu": 0}}
    for section, device in (("offload_param", offload_param), ("offload_optimizer", offload_optimizer)):
        if device != "nvme":
            tiers.pop(section)
            if device == "cpu":
                tiers[section] = {"device": "cpu"}
    # sub-groups and the aio section only where NVMe reads them (dstrain refuses them elsewhere, by name)
    swapped = {"sub_group_size": sub_group} if offload_optimizer == "nvme" else {}
    aio = {"aio": {"block_size": 1_048_576, "queue_depth": 8, "intra_op_parallelism": 2}} \
        if "nvme" in (offload_param, offload_optimizer) else {}
    return {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
            "zero_optimization": {
                # gradient buckets bounded too (4 in flight, partitioned.py): the default 5e8 elements
                # would hold a 2.5B model's gradients four times over at 2 GB per bucket
                "stage": 3, "reduce_bucket_size": bucket, **swapped, "stage3_max_live_parameters": 100_000_000,
                "stage3_prefetch_bucket_size": 50_000_000, "stage3_max_reuse_distance": 100_000_000, **tiers},
            **aio}


def remote_device(cfg: dict) -> str | None:
    """zero.Init's remote_device for the config's parameter tier (both systems build the GPT under it)."""
    return cfg["zero_optimization"].get("offload_param", {}).get("device")


def _io() -> dict:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def settings(cfg: dict) -> EstimateSettings:
    zero = cfg["zero_optimization"]
    opt, param = zero.get("offload_optimizer", {}), zero.get("offload_param", {})
    return EstimateSettings(precision="fp32", reduce_bucket_size=zero["reduce_bucket_size"],
                            max_live_parameters=zero["stage3_max_live_parameters"],
                            sub_group_size=zero.get("sub_group_size", EstimateSettings.sub_group_size),
                            optimizer_buffer_count=opt.get("buffer_count", EstimateSettings.optimizer_buffer_count),
                            swap_slots=opt.get("swap_slots", EstimateSettings.swap_slots),
                            swap_gradients=opt.get("swap_gradients"),
                            param_buffer_count=param.get("buffer_count", EstimateSettings.param_buffer_count),
                            param_buffer_size=param.get("buffer_size", EstimateSettings.param_buffer_size),
                            max_in_cpu=param.get("max_in_cpu", EstimateSettings.max_in_cpu),
                            pipeline_read=opt.get("pipeline_read", EstimateSettings.pipeline_read))


def _rank(model_cfg: GPTConfig, cfg: dict, steps: int, dump: str | None = None, gradients: str = "swap") -> dict:
    import torch.distributed as dist

    import engine
    from engine.utils import safe_get_full_fp32_param
    if gradients == "memory":  # module docstring: --gradients
        cfg = {**cfg, "zero_optimization": {**cfg["zero_optimization"], "offload_optimizer": {
            **cfg["zero_optimization"]["offload_optimizer"], "swap_gradients": False}}}
    if gradients == "sync-writes":
        from offload.param_swap import NvmeParamStore
        NvmeParamStore.write_behind = NvmeParamStore.write
    torch.set_num_threads(1)
    rank = dist.get_rank()
    import psutil
    rss_start = psutil.Process().memory_info().rss  # torch and the engine, imported: not model state
    io0, t0 = _io(), time.perf_counter()
    torch.manual_seed(0)
    with engine.zero.Init(remote_device=remote_device(cfg), config_dict_or_path=cfg):
        model = GPT(model_cfg)
    eng, _, _, _ = engine.initialize(model=model, config=cfg)
    built_s, rss_built = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # one fixed batch per rank, every step: a loss that falls says the updates reach the weights
    x, y = RandomTokens(cfg["train_micro_batch_size_per_gpu"], model_cfg.seq_len, model_cfg.vocab_size, seed=rank)[:]
    phases = StepPhases()
    losses, times, norms = fixed_batch_steps(eng, x, y, steps, phases)
    store, swap = eng.zero_optimizer.partition.store, getattr(eng.zero_optimizer, "grad_swap", None)
    io1 = _io()
    out = {"losses": losses, "step_s": times, "norms": norms, "build_s": built_s, "peak_rss": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024, "rss_after_build": rss_built, "rss_start": rss_start,
        "disk_read": io1["read_bytes"] - io0["read_bytes"], "disk_written": io1["write_bytes"] - io0["write_bytes"],
        "store_read": getattr(store, "bytes_read", 0), "store_written": getattr(store, "bytes_written", 0),
        "partition_host_bytes": eng.zero_optimizer.model_state_bytes()["partition"], "phases_ms": phases.medians(),
        "grad_written": swap.bytes_written if swap else 0, "grad_read": swap.bytes_read if swap else 0,
        "held_written": swap.held.bytes_written if swap else 0}
    if dump:  # after the byte counts: gathering every parameter reads the store too
        dump_full_params(model, safe_get_full_fp32_param, dump, rank)
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
                   buffers: dict[str, int | None], dump: str | None = None) -> list[dict]:
    """The same GPT and config under DeepSpeed (benchmarks/deepspeed_infinity_peer.py in its venv): one
    row per rank, or [{"error": ...}] when it did not run. `buffers`: DeepSpeed's `buffer_count` for the
    "offload_param" / "offload_optimizer" section instead of the config's, where not None: its parameter
    swapper holds one parameter tensor per buffer for as long as it is gathered, and its pipelined
    optimizer swapper takes 4 buffers (fp32 weights, two moments, gradient) per sub-group in flight."""
    peer = Path(__file__).resolve().parent / "deepspeed_infinity_peer.py"
    zero = dict(cfg["zero_optimization"])
    for section, count in buffers.items():
        if count and zero.get(section, {}).get("device") == "nvme":
            zero[section] = {**zero[section], "buffer_count": count}
    if "swap_slots" in zero.get("offload_optimizer", {}):  # a dstrain key: DeepSpeed's swapper always writes in place
        zero["offload_optimizer"] = {k: v for k, v in zero["offload_optimizer"].items() if k != "swap_slots"}
    cfg = {**cfg, "zero_optimization": zero}
    cmd = [str(Path(venv, "bin", "python")), str(peer), "--model-json", json.dumps(dataclasses.asdict(model_cfg)),
           "--config-json", json.dumps(cfg), "--steps", str(steps), "--world", str(world)]
    cmd += ["--dump", dump] if dump else []
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=6 * 3600)
    if result.returncode != 0:
        return [{"error": (result.stderr.strip().splitlines() or ["no output"])[-1][:300]}]
    return json.loads(result.stdout.strip().splitlines()[-1])


def print_dstrain(per_rank: list[dict], est, prefix: str = "") -> None:
    mib = 2**20
    for r, out in enumerate(per_rank):
        print(f"{prefix}rank {r}: build {out['build_s']:.1f} s; " + "; ".join(
            f"step {k}: loss {loss:.4f}, {t:.1f} s" for k, (loss, t) in enumerate(zip(out["losses"], out["step_s"]))))
        estimate = "no estimate row for these tiers" if est is None else (
            f"estimate {(est.host_bytes + est.accelerator_bytes) / mib:.0f} MiB of model state "
            f"(host {est.host_bytes / mib:.0f} + gathered/buckets {est.accelerator_bytes / mib:.0f}), "
            f"NVMe {est.nvme_bytes / mib:.0f} MiB")
        print(f"{prefix}rank {r}: peak RSS {out['peak_rss'] / mib:.0f} MiB, {(out['peak_rss'] - out['rss_start']) / mib:.0f} "
              f"above the rank's start (after build {out['rss_after_build'] / mib:.0f}), {estimate}; disk read "
              f"{out['disk_read'] / mib:.0f} MiB, written {out['disk_written'] / mib:.0f} MiB (parameter store "
              f"{out['store_read'] / mib:.0f} / {out['store_written'] / mib:.0f} MiB); host flat "
              f"{out['partition_host_bytes']} bytes")


KIND_LABEL = {"swap": "", "memory": "[gradient partition in memory] ",
              "sync-writes": "[parameter writes synchronous, no write-behind] "}


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


def print_agreement(ref: dict, rank0: dict[str, dict | None], dumps: str) -> None:
    """Each system's rank-0 losses and gradient norms next to single-process torch's, and how far its
    final parameters are from torch's in units of torch's own update (infinity_agreement.compare)."""
    print("torch (one process, same global batch): losses " + ", ".join(f"{v:.4f}" for v in ref["losses"])
          + "; grad norms " + ", ".join(f"{v:.4f}" for v in ref["norms"]))
    for name, out in rank0.items():
        path = Path(dumps, f"{name}.pt")
        if out is None or "error" in out or not path.exists():
            continue
        found = compare(torch.load(path, weights_only=True), ref)
        norms = ", ".join("-" if v is None else f"{v:.4f}" for v in out["norms"])
        print(f"{name} against torch: losses " + ", ".join(f"{v:.4f}" for v in out["losses"]) + f"; grad norms "
              f"{norms}; final parameters: ‖diff‖ / ‖torch's update‖ per tensor, largest {found['max']:.2e}, "
              "worst: "
              + ", ".join(f"{n} {v:.2e}" for n, v in found["worst"])
              + (f"; not in the dump: {found['missing']}" if found["missing"] else ""))


def deepspeed_misaligned(model_cfg: GPTConfig, world: int) -> list[str]:
    """Parameters whose per-rank partition is not a multiple of 128 fp32 elements (512 bytes). With the
    optimizer on NVMe, DeepSpeed 0.19.8 reads each gradient partition of 1 MiB or more back into its
    sub-group's pinned buffer at the parameter's offset through O_DIRECT, and a read into an address
    that is not 512-byte aligned fails unchecked (README's ZeRO-Infinity paragraph): once one partition
    is misaligned, the offsets after it may be, and those tensors get a wrong update."""
    with torch.device("meta"):
        model = GPT(model_cfg)
    return [name for name, p in model.named_parameters() if -(-p.numel() // world) % 128]


def print_deepspeed(rows: list[dict], misaligned: list[str] = ()) -> None:
    if misaligned:
        print(f"deepspeed: {len(misaligned)} parameters' per-rank partitions are not multiples of 512 bytes (e.g. "
              f"{misaligned[0]}): DeepSpeed 0.19.8 then reads some swapped gradients wrong (README); its losses and "
              "times are for a partly wrong update unless --check-against-torch shows it agrees")
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


class DiskUse:
    """The peak of the file system's used bytes under `path` above its value at the start, sampled
    in a thread: what the swap files really took (sparse regions and files given back included)."""

    def __init__(self, path: str, every_s: float = 0.5):
        self.start = self.peak_used = shutil.disk_usage(path).used
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(path, every_s), daemon=True)
        self._thread.start()

    def _sample(self, path: str, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.peak_used = max(self.peak_used, shutil.disk_usage(path).used)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak(self) -> int:
        return self.peak_used - self.start


def run_and_report(args, model_cfg: GPTConfig, cfg: dict, est, dumps: str | None, made_nvme: str | None,
                   kinds: list[str], nvme_path: str) -> None:
    """dstrain's ranks (once per `--gradients` kind), then DeepSpeed's (`--deepspeed-venv`), then torch's
    reference (`dumps`, against the first kind's run), printed."""
    disk = None
    used = DiskUse(nvme_path)
    try:
        if len(kinds) > 1:  # the bandwidth the gradient bytes are set against, where the swap files go
            from benchmarks.bench_offload_io import disk_bandwidth
            with tempfile.TemporaryDirectory(dir=nvme_path) as d:
                disk = disk_bandwidth(d, args.disk_mb * 2**20, repeats=2)
        runs = {kind: run_distributed(_rank, args.world, timeout=6 * 3600, args=(
            model_cfg, cfg, args.steps, dumps and k == 0 and f"{dumps}/dstrain.pt", kind))
            for k, kind in enumerate(kinds)}
        per_rank = runs[kinds[0]]
        # after dstrain's ranks exited, in the same swap directory (DeepSpeed's swap files go under it)
        buffers = {"offload_param": args.deepspeed_param_buffers, "offload_optimizer": args.deepspeed_optimizer_buffers}
        peer = deepspeed_rows(args.deepspeed_venv, model_cfg, cfg, args.steps, args.world, buffers,
                              dumps and f"{dumps}/deepspeed.pt") if args.deepspeed_venv else None
    finally:
        used.stop()
        if made_nvme:  # the swap directories inside are removed by the ranks themselves
            shutil.rmtree(made_nvme, ignore_errors=True)
    print(f"peak disk use under {nvme_path}: {used.peak / 1e9:.1f} GB above the start "
          "(the file system's used bytes, sampled every 0.5 s: other writers on it count too)")
    for kind, ranks in runs.items():
        print_dstrain(ranks, est, KIND_LABEL[kind])
    if disk is not None:
        _print_gradient_costs(runs, disk, args.steps)
    if peer is not None:
        misaligned = deepspeed_misaligned(model_cfg, args.world) if args.offload_optimizer == "nvme" else []
        print_deepspeed(peer, misaligned)
    if dumps:
        ref = torch_reference(model_cfg, cfg, args.steps, args.world)
        if args.keep_params:
            torch.save({"initial": ref["initial"], "final": ref["final"]}, Path(dumps, "torch.pt"))
        print_agreement(ref, {"dstrain": per_rank[0], "deepspeed": (peer or [None])[0]}, dumps)


def _parser() -> argparse.ArgumentParser:
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
    p.add_argument("--check-against-torch", action="store_true",
                   help="also train the GPT in one process with torch's AdamW on the same global batch and compare "
                        "each system's losses, gradient norms and final parameters with it (infinity_agreement.py)")
    p.add_argument("--keep-params", default=None, metavar="DIR",
                   help="with --check-against-torch: keep the parameter files (dstrain.pt, deepspeed.pt, "
                        "torch.pt) in DIR")
    p.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (0: off)")
    p.add_argument("--swap-slots", type=int, choices=(1, 2), default=2,
                   help="offload_optimizer.swap_slots: 1 writes the optimizer-state files in place (half the disk)")
    p.add_argument("--swap-pipeline", action=argparse.BooleanOptionalAction, default=True,
                   help="offload_optimizer.pipeline_read / pipeline_write (default on)")
    for tier in ("param", "optimizer"):
        p.add_argument(f"--offload-{tier}", choices=("nvme", "cpu", "none"), default="nvme",
                       help=f"offload_{tier}.device (default nvme: ZeRO-Infinity)")
    p.add_argument("--gradients", default="swap", help="comma list of swap, memory, sync-writes: where dstrain's gradient "
                   "partition lives, one run each (module docstring)")
    p.add_argument("--disk-mb", type=int, default=256, help="file size of the raw O_DIRECT bandwidth measurement")
    return p


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    kinds = args.gradients.split(",")
    if not kinds or set(kinds) - set(KIND_LABEL):
        p.error(f"--gradients {args.gradients!r}: expected a comma list of {', '.join(KIND_LABEL)}")
    group = limit_memory(args.memory_limit_gib) if args.memory_limit_gib else None
    made = args.nvme_path is None
    nvme_path = args.nvme_path or tempfile.mkdtemp(prefix="bench-infinity-")
    model_cfg = gpt_config(args.params, args.seq)
    cfg = ds_config(nvme_path, args.micro, _largest_group(model_cfg, args.world), int(args.sub_group_size),
                    int(args.reduce_bucket_size), args.clip, args.offload_param, args.offload_optimizer,
                    args.swap_pipeline, args.swap_slots)
    with torch.device("meta"):
        n = sum(t.numel() for t in GPT(model_cfg).parameters())
    est = next((r for r in estimate_memory(n, gpus_per_node=args.world, settings=settings(cfg))
                if r.stage == 3 and r.offload == ESTIMATE_ROW.get((args.offload_param, args.offload_optimizer))), None)
    print(f"GPT {n / 1e6:.1f}M parameters ({model_cfg.n_layer} layers, d_model {model_cfg.d_model}), "
          f"{args.world} ranks, swap files under {nvme_path}; load average {os.getloadavg()[0]:.2f}", flush=True)
    if est is not None:  # the swap files' size, per the estimator, against the disk (before hours are spent)
        free = shutil.disk_usage(nvme_path).free
        print(f"swap files (estimate, all ranks): {est.nvme_bytes * args.world / 1e9:.1f} GB; "
              f"free under {nvme_path}: {free / 1e9:.1f} GB", flush=True)
    if args.keep_params:
        os.makedirs(args.keep_params, exist_ok=True)
    checked = args.check_against_torch or args.keep_params
    dumps = args.keep_params or (tempfile.mkdtemp(prefix="bench-infinity-params-") if checked else None)
    try:
        run_and_report(args, model_cfg, cfg, est, dumps, nvme_path if made else None, kinds, nvme_path)
    finally:  # a failed run's parameter files too
        if dumps and not args.keep_params:
            shutil.rmtree(dumps, ignore_errors=True)
    print(f"full training state 16 B x {n / 1e6:.1f}M = {16 * n / 2**30:.2f} GiB; "
          f"load average {os.getloadavg()[0]:.2f}")
    if group is not None:
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        limit = int((group / "memory.limit_in_bytes").read_text())
        print(f"memory group: limit {limit / 2**30:.2f} GiB, peak use {peak / 2**30:.2f} GiB (every process of the "
              f"job, page cache included; failcnt {(group / 'memory.failcnt').read_text().strip()}); full training "
              f"state / limit = {16 * n / limit:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
