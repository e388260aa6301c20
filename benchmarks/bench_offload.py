"""ZeRO-Offload step time: dstrain with the optimizer offloaded to the host against dstrain without
offload and against DeepSpeed's ZeRO-Offload (its DeepSpeedCPUAdam), side by side in one run.

    python benchmarks/bench_offload.py --steps 8 --deepspeed-venv /tmp/ds-venv

Workload: bench_training.py's (the 25M benchmark GPT, examples/gpt.py BENCH_CONFIG, micro-batch 8,
AdamW, fp32, gradient_clipping 1.0, 2 ranks x 1 thread, gloo). Systems:
- `dstrain-z2`: ZeRO-2 without offload (the baseline every ratio is against);
- `dstrain-z2-cpu`: ZeRO-2 with `offload_optimizer: {"device": "cpu"}`;
- `deepspeed-z2-cpu`: DeepSpeed 0.19 with the same config (its JIT-built CPU Adam, which is what
  DeepSpeed uses with offload; the op needs a C++ compiler, and the build is cached under
  ~/.cache/torch_extensions);
- `dstrain-z2-nvme`: ZeRO-2 with `offload_optimizer: {"device": "nvme"}` (engine/zero/nvme_tier.py),
  swap files under `--nvme-path` (default: a temporary directory), `sub_group_size` 1e6, pipelined;
  DeepSpeed has no counterpart (it documents NVMe optimizer offload for stage 3 only);
- `dstrain-z3` / `dstrain-z3-nvme-opt` / `deepspeed-z3-nvme-opt`: ZeRO-3 without offload, and with the
  optimizer on NVMe (swap files under `--nvme-path`, the same sub-group and pool settings) in dstrain
  and in DeepSpeed (its async I/O op, JIT-built with libaio);
- `dstrain-z3-nvme` / `deepspeed-z3-nvme`: ZeRO-3 with NVMe offload of optimizer and parameters
  (`offload_param: {"device": "nvme", "max_in_cpu": 0}`: every gather reads the swap files, as a model
  larger than host memory would; engine/zero/param_nvme.py), the same config in both; `--max-in-cpu N`
  sets it for both (DeepSpeed's default is 1e9: keep up to that many parameter elements in host memory).
Goals (issue 17): dstrain-z2-cpu ≤ 1.10x dstrain-z2 and faster than deepspeed-z2-cpu. On a CPU-only
machine the offloaded partition already is where the step runs, so dstrain stages nothing
(engine/zero/tier.py) and the ratio measures that this costs nothing; `dstrain-z2-cpu-staged` runs the
accelerator's copy path anyway (DSTRAIN_OFFLOAD_STAGE_COPIES=1) to show what those copies cost here,
and `dstrain-z2-cpu-4k` runs with DSTRAIN_HUGE_PAGES=0 (offload/huge_pages.py: the partition and the
optimizer state on 4 KiB pages) to show what huge pages buy in a training step.
These machines are shared and noisy: read the ratios, and the load printed before and after.
A second table splits rank 0's median step into forward, backward (with the reductions that overlap
it) and step (norm, clipping, the optimizer, the all-gather), timed the same way in both systems
(benchmarks/step_phases.py).
What the gradient swap costs (engine/zero/grad_swap.py: `offload_optimizer.swap_gradients`, unset: the
gradient partition in swap files only with the parameters on NVMe too and their partition larger than
`max_in_cpu`): `dstrain-z2-nvme-grad-swapped`
and `dstrain-z3-nvme-opt-grad-swapped` set it true, `dstrain-z3-nvme-grad-in-memory` false (a dstrain
key, so DeepSpeed's rows have no such twin). `dstrain-z3-nvme-heap-bound` fixes glibc's heap bound
(offload/host_heap.py) in its ranks, which the parameter store leaves off where `max_in_cpu` holds the
partition: with `--max-in-cpu 1000000000` it measures what the bound would cost. When an NVMe system runs, the raw O_DIRECT
disk bandwidth is measured first in the same directory (bench_offload_io.disk_bandwidth, `--disk-mb`),
and a third table gives rank 0's gradient bytes written and read per step after the first (the first
also writes the held gradients: grad_swap.py's note) and the seconds they take at that bandwidth. A
fourth sets each NVMe system's extra time over the same stage without offload against all the bytes
its ranks read from and wrote to storage per step (/proc/self/io, every swap file: parameters, master
weights, optimizer state, gradients; both ranks share the disk) at that bandwidth; DeepSpeed's NVMe
rows give their bytes too (the same counters in its peer, benchmarks/storage_io.py).
DeepSpeed's swappers need more buffers than the shared NVMe sections give at this size (it refuses
them: "Not enough buffers", "ran out of swap buffers"); `--optimizer-buffers` / `--param-buffers` set
the shared sections' `buffer_count`s (both systems), `--deepspeed-param-buffers` /
`--deepspeed-optimizer-buffers` raise DeepSpeed's only (as bench_infinity.py's do).
`dstrain-z3-nvme-param` / `deepspeed-z3-nvme-param`: parameters on NVMe, optimizer on the host; with
`--bf16` (both systems train in bf16) dstrain's parameter files hold bf16 (offload/param_swap.py's note:
16-bit files), as DeepSpeed's do; `dstrain-z3-nvme-param-fp32-files` keeps them fp32 (what the 16-bit
files save). With both tiers on NVMe the same: `dstrain-z3-nvme` in bf16 keeps 16-bit parameter files
and the master in the optimizer's files, `dstrain-z3-nvme-fp32-files` fp32 parameter files. At stage 2,
`dstrain-z2-nvme` in bf16 keeps a bf16 send image on the host, `dstrain-z2-nvme-fp32-image` the fp32 one.
`*-frozen` rows freeze the GPT's six blocks (19M of its 25M parameters; embeddings, final norm and the
tied head train), a LoRA-style frozen base: `dstrain-z3-frozen` without offload, `dstrain-z3-nvme-frozen`
and `deepspeed-z3-nvme-frozen` with everything on NVMe (dstrain keeps the frozen chunks in a file of
their own, engine/zero/stage3_frozen.py), `dstrain-z3-nvme-frozen-no-read-ahead` reading each frozen
chunk only when its group is gathered.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_training as bt  # noqa: E402
from step_phases import PHASES, StepPhases, kept  # noqa: E402
from storage_io import storage_bytes  # noqa: E402
from tests.harness import run_distributed  # noqa: E402

ZERO2 = {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e6}
CPU_OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
NVME = None  # NVMe optimizer offload under --nvme-path (_nvme_offload)
NVME_BOTH = "nvme-both"  # and the parameters on NVMe too
NVME_PARAM = "nvme-param"  # the parameters on NVMe, the optimizer on the host
# a system name's suffix: offload_optimizer.swap_gradients set (grad_swap.py's note: when; unset, the
# gradient is swapped only with the parameters on NVMe too)
GRAD_SUFFIX = {"-grad-in-memory": False, "-grad-swapped": True}
FROZEN = "DSTRAIN_BENCH_FROZEN"  # the GPT's blocks frozen, in dstrain's ranks and DeepSpeed's peer alike
# name: (offload sections, environment, ZeRO stage)
DSTRAIN = {"dstrain-z2": ({}, {}, 2), "dstrain-z2-cpu": (CPU_OFFLOAD, {}, 2),
           "dstrain-z2-cpu-staged": (CPU_OFFLOAD, {"DSTRAIN_OFFLOAD_STAGE_COPIES": "1"}, 2),
           "dstrain-z2-cpu-4k": (CPU_OFFLOAD, {"DSTRAIN_HUGE_PAGES": "0"}, 2),
           "dstrain-z2-nvme": (NVME, {}, 2), "dstrain-z2-nvme-grad-swapped": (NVME, {}, 2),
           # with --bf16 the send image stays fp32 (what the 16-bit one saves: partition_store.py)
           "dstrain-z2-nvme-fp32-image": (NVME, {"DSTRAIN_BENCH_FP32_IMAGE": "1"}, 2),
           "dstrain-z3": ({}, {}, 3), "dstrain-z3-nvme-opt": (NVME, {}, 3),
           "dstrain-z3-nvme-opt-grad-swapped": (NVME, {}, 3), "dstrain-z3-nvme": (NVME_BOTH, {}, 3),
           "dstrain-z3-nvme-grad-in-memory": (NVME_BOTH, {}, 3),
           # the heap bound (offload/host_heap.py) fixed in the ranks whatever max_in_cpu says: with
           # --max-in-cpu 1e9 the store leaves it off, and this row measures what it would cost
           "dstrain-z3-nvme-heap-bound": (NVME_BOTH, {"DSTRAIN_BENCH_HEAP_BOUND": "1"}, 3),
           # parameters on NVMe, optimizer on the host (with --bf16: 16-bit parameter files, param_swap.py)
           "dstrain-z3-nvme-param": (NVME_PARAM, {}, 3),
           "dstrain-z3-nvme-param-fp32-files": (NVME_PARAM, {"DSTRAIN_BENCH_PARAM_FILES_FP32": "1"}, 3),
           # both on NVMe with --bf16: 16-bit parameter files, the master in the optimizer's files
           "dstrain-z3-nvme-fp32-files": (NVME_BOTH, {"DSTRAIN_BENCH_PARAM_FILES_FP32": "1"}, 3),
           # the GPT's blocks frozen (a LoRA-style base; engine/zero/stage3_frozen.py): without offload,
           # with their chunks in a file read ahead of each gather, and read only when gathered
           "dstrain-z3-frozen": ({}, {FROZEN: "1"}, 3), "dstrain-z3-nvme-frozen": (NVME_BOTH, {FROZEN: "1"}, 3),
           "dstrain-z3-nvme-frozen-no-read-ahead": (NVME_BOTH, {FROZEN: "1", "DSTRAIN_BENCH_FROZEN_READ_AHEAD": "0"},
                                                    3)}
# DeepSpeed's offload path: without torch_adam, its AdamW with offload is DeepSpeedCPUAdam.
ADAMW = {"type": "AdamW", "params": {"lr": bt.LR}}
# name: (ZeRO stage, config merged in, NVMe optimizer offload under --nvme-path)
DEEPSPEED = {"deepspeed-z2-cpu": (2, {"zero_optimization": CPU_OFFLOAD, "optimizer": ADAMW}, False),
             "deepspeed-z3-nvme-opt": (3, {"optimizer": ADAMW}, True),
             "deepspeed-z3-nvme": (3, {"optimizer": ADAMW}, NVME_BOTH),
             "deepspeed-z3-nvme-param": (3, {"optimizer": ADAMW}, NVME_PARAM),
             "deepspeed-z3-nvme-frozen": (3, {"optimizer": ADAMW}, NVME_BOTH)}  # its peer reads FROZEN


# Adam swaps 3 tensors per sub-group: 9 buffers hold one sub-group read ahead, one stepped, one written
OPTIMIZER_BUFFERS, PARAM_BUFFERS = 9, 5  # the shared sections' buffer_count (--optimizer-buffers, --param-buffers)


def _nvme_offload(nvme_path: str, params: bool = False, optimizer_buffers: int = OPTIMIZER_BUFFERS,
                  param_buffers: int = PARAM_BUFFERS, swap_gradients: bool | None = None, max_in_cpu: int = 0,
                  optimizer_on_host: bool = False) -> dict:
    section = {"sub_group_size": 1_000_000,
               "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": optimizer_buffers,
                                     "pipeline_read": True, "pipeline_write": True}}
    if optimizer_on_host:  # no sub-groups then (dstrain refuses a key nothing reads)
        section = {"offload_optimizer": {"device": "cpu"}}
    if swap_gradients is not None:  # a dstrain key: only dstrain's systems pass it
        section["offload_optimizer"]["swap_gradients"] = swap_gradients
    if params:  # a block's weights per buffer (the 25M GPT's largest gather group is under 1e7 elements)
        section["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": param_buffers,
                                    "buffer_size": 10_000_000, "max_in_cpu": max_in_cpu}
    return section


def _grad_bytes(zopt) -> dict:
    """Gradient bytes this rank's swap files moved so far (engine/zero/grad_swap.py), by kind."""
    swap = zopt.grad_swap
    if swap is None:
        return {}
    held = swap.held
    return {"written": swap.bytes_written, "read": swap.bytes_read,
            "held_written": held.bytes_written if held else 0, "held_read": held.bytes_read if held else 0}


def _entry(offload: dict, steps: int, stage: int = 2, precision: dict | None = None):
    import torch.distributed as dist

    import engine
    if os.environ.get("DSTRAIN_BENCH_HEAP_BOUND") == "1":  # before the model's allocations (DSTRAIN's note)
        from offload.host_heap import bound_heap_retention
        bound_heap_retention()
    if os.environ.get("DSTRAIN_BENCH_FP32_IMAGE") == "1":  # what the 16-bit send image saves, measured
        from engine.zero import nvme_tier
        nvme_tier.wants_half_image = lambda zopt, zero: False
    if os.environ.get("DSTRAIN_BENCH_PARAM_FILES_FP32") == "1":  # what the 16-bit files save, measured
        from engine.zero import param_nvme
        param_nvme._file_dtype = lambda zopt, zero: torch.float32
    torch.manual_seed(0)
    zero = {**ZERO2, "stage": stage, **offload}
    model = bt.GPT(bt.BENCH_CONFIG)
    if os.environ.get(FROZEN) == "1":
        for block in model.blocks:
            block.requires_grad_(False)
    eng, _, _, _ = engine.initialize(model=model, config=bt._dstrain_config(stage, True, {"zero_optimization": zero,
                                                                                          **(precision or {})}))
    if os.environ.get("DSTRAIN_BENCH_FROZEN_READ_AHEAD") == "0":
        eng.zero_optimizer.frozen_chunks.limit = 0  # every frozen chunk read when its group is gathered
    phases, times, after_first, io_first = StepPhases(), [], {}, None
    for x, y in bt._batches(steps, dist.get_rank()):
        t0 = time.perf_counter()
        phases.train_step(eng, x, y)
        times.append((time.perf_counter() - t0) * 1e3)
        after_first = after_first or _grad_bytes(eng.zero_optimizer)
        io_first = storage_bytes() if io_first is None else io_first
    storage_per_step = (storage_bytes() - io_first) / max(1, steps - 1)
    end = _grad_bytes(eng.zero_optimizer)
    per_step = {k: (end[k] - after_first[k]) / max(1, steps - 1) for k in end}
    eng.destroy()
    return {"step_ms": statistics.median(kept(times)), "rss_mb": bt._peak_rss_mb(), "phases_ms": phases.medians(),
            "grad_bytes_per_step": per_step, "grad_bytes_first_step": after_first,
            "storage_bytes_per_step": storage_per_step}


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join([*DSTRAIN, *DEEPSPEED]))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--deepspeed-venv", type=Path, default=None, help="virtual environment with deepspeed")
    p.add_argument("--nvme-path", default=None, help="directory for the NVMe systems' swap files (default: a temp dir)")
    p.add_argument("--disk-mb", type=int, default=256, help="file size of the raw O_DIRECT bandwidth measurement")
    p.add_argument("--optimizer-buffers", type=int, default=OPTIMIZER_BUFFERS,
                   help="offload_optimizer.buffer_count of the shared NVMe section (both systems)")
    p.add_argument("--param-buffers", type=int, default=PARAM_BUFFERS,
                   help="offload_param.buffer_count of the shared NVMe section (both systems)")
    p.add_argument("--max-in-cpu", type=int, default=0,
                   help="offload_param.max_in_cpu of the shared NVMe section (both systems; default 0: every gather "
                        "reads the files; DeepSpeed's own default is 1e9)")
    p.add_argument("--bf16", action="store_true", help="bf16 training in both systems (default fp32)")
    p.add_argument("--deepspeed-param-buffers", type=int, default=None,
                   help="DeepSpeed's offload_param.buffer_count (default: the shared section's 5)")
    p.add_argument("--deepspeed-optimizer-buffers", type=int, default=None,
                   help="DeepSpeed's offload_optimizer.buffer_count (default: the shared section's 9; its "
                        "pipelined swapper needs 12)")
    return p


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    systems = args.systems.split(",")
    shared = {"optimizer_buffers": args.optimizer_buffers, "param_buffers": args.param_buffers,
              "max_in_cpu": args.max_in_cpu}
    peer = {**shared, "optimizer_buffers": args.deepspeed_optimizer_buffers or args.optimizer_buffers,
            "param_buffers": args.deepspeed_param_buffers or args.param_buffers}  # DeepSpeed's own counts

    made: list[str] = []  # temp dirs of the swap files, removed at the end (DeepSpeed leaves its files in them)

    def nvme_dir() -> str:
        if args.nvme_path:
            return args.nvme_path
        made.append(tempfile.mkdtemp(prefix="bench-offload-"))
        return made[-1]
    try:
        return _run_systems(args, systems, shared, peer, nvme_dir)
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)


def _run_systems(args, systems: list, shared: dict, peer: dict, nvme_dir) -> int:
    print(f"before: {_load()}", flush=True)
    precision = {"bf16": {"enabled": True}} if args.bf16 else {}  # both systems
    disk = None  # (write, read) GB/s of the raw O_DIRECT loop where the swap files go
    if any(DSTRAIN.get(name, (0,))[0] in (NVME, NVME_BOTH, NVME_PARAM) for name in systems):
        from bench_offload_io import disk_bandwidth
        with tempfile.TemporaryDirectory(dir=args.nvme_path, prefix="bench-offload-disk-") as d:
            disk = disk_bandwidth(d, args.disk_mb * 2**20, repeats=2)
        print(f"disk (O_DIRECT, {args.disk_mb} MiB, best of 2): write {disk[0]:.2f} GB/s, read {disk[1]:.2f} GB/s",
              flush=True)
    rows, phases, grads, storage = [], {}, {}, {}  # phases: rank 0's median forward / backward / step ms (step_phases.py)
    for name in systems:
        if name in DEEPSPEED:
            if args.deepspeed_venv is None:
                rows.append((name, None, None, "not run: no --deepspeed-venv"))
                continue
            stage, extra, nvme = DEEPSPEED[name]
            extra = {**extra, **precision}
            if nvme:
                extra = {**extra, "zero_optimization": _nvme_offload(nvme_dir(), nvme in (NVME_BOTH, NVME_PARAM),
                                                                     optimizer_on_host=nvme == NVME_PARAM, **peer)}
            os.environ[FROZEN] = "1" if name.endswith("-frozen") else "0"  # read by the peer only
            try:
                row = bt._run_deepspeed(bt._deepspeed_python(args.deepspeed_venv), stage, args.steps,
                                        args.world, extra, full=True)
                rows.append((name, row["step_ms"], row["rss_mb"], ""))
                phases[name] = row["phases_ms"]
                if nvme:
                    storage[name] = (stage, row["storage_bytes_per_step"])
            except SystemExit as failed:  # the peer's own error, shortened to its last line
                rows.append((name, None, None, f"not run: {str(failed).strip().splitlines()[-1][:200]}"))
            finally:
                os.environ.pop(FROZEN)
        else:
            offload, env, stage = DSTRAIN[name]
            if offload in (NVME, NVME_BOTH, NVME_PARAM):
                swap = next((v for suffix, v in GRAD_SUFFIX.items() if name.endswith(suffix)), None)
                offload = _nvme_offload(nvme_dir(), offload in (NVME_BOTH, NVME_PARAM), swap_gradients=swap,
                                        optimizer_on_host=offload == NVME_PARAM, **shared)
            per_rank = run_distributed(_entry, args.world, args=(offload, args.steps, stage, precision),
                                       timeout=1800, env=env)
            rows.append((name, max(r["step_ms"] for r in per_rank), max(r["rss_mb"] for r in per_rank), ""))
            phases[name] = per_rank[0]["phases_ms"]
            if per_rank[0]["grad_bytes_per_step"]:
                grads[name] = per_rank[0]
            if "nvme" in (offload.get("offload_optimizer", {}).get("device"), offload.get("offload_param", {}).get("device")):
                storage[name] = (stage, sum(r["storage_bytes_per_step"] for r in per_rank))

        print(f"{name:>22}: {rows[-1][1] or 0:8.1f} ms/step  {rows[-1][3]}", flush=True)
    print(f"after: {_load()}")
    _print_step_tables(rows, phases)
    if grads and disk:
        _print_gradient_io(grads, disk)
    if storage and disk:
        _print_storage_time(storage, {name: step for name, step, _, _ in rows if step}, disk)
    return 0


def _print_step_tables(rows: list, phases: dict) -> None:
    """Each run's step time and peak RSS (ratios against dstrain-z2 where it ran), then rank 0's phases."""
    base = next((step for name, step, _, _ in rows if name == "dstrain-z2" and step), None)
    print("\n| system | ms/step | ratio vs dstrain-z2 | peak RSS/rank MB | note |")
    print("|---|---|---|---|---|")
    for name, step, rss, note in rows:
        ratio = f"{step / base:.3f}" if step and base else "-"
        print(f"| {name} | {step:.0f} | {ratio} | {rss:.0f} | {note} |" if step else f"| {name} | - | - | - | {note} |")
    print("\n| system (rank 0, median ms) | " + " | ".join(PHASES) + " |")
    print("|---|" + "---|" * len(PHASES))
    for name, parts in phases.items():  # a system run twice shows its last round
        print(f"| {name} | " + " | ".join(f"{parts[k]:.0f}" for k in PHASES) + " |")


def _print_storage_time(storage: dict, steps: dict, disk: tuple[float, float]) -> None:
    """Each NVMe system's extra ms over its stage without offload against its ranks' storage bytes per
    step at the disk bandwidth measured in this run (the slower direction's: reads and writes mix)."""
    print(f"\n| system | storage MiB per step (both ranks) | at disk bandwidth ({min(disk):.2f} GB/s), ms | "
          f"extra ms over the same stage and model without offload |")
    print("|---|---|---|---|")
    for name, (stage, nbytes) in storage.items():
        baseline = f"dstrain-z{stage}" + ("-frozen" if "-frozen" in name else "")  # the same model
        base = steps.get(baseline)
        extra = f"{steps[name] - base:.0f}" if base and name in steps else f"- (run {baseline} too)"
        if name.startswith("deepspeed"):
            extra = "- (no DeepSpeed row without offload)"
        print(f"| {name} | {nbytes / 2**20:.0f} | {nbytes / min(disk) / 1e6:.0f} | {extra} |")


def _print_gradient_io(grads: dict, disk: tuple[float, float]) -> None:
    """Rank 0's gradient swap traffic per step against the disk bandwidth measured in this run."""
    mib = 2**20
    print(f"\n| system (rank 0) | gradient MiB written / read per step | at disk bandwidth, ms | "
          f"first step: held gradients MiB written / read |")
    print("|---|---|---|---|")
    for name, r in grads.items():
        per, first = r["grad_bytes_per_step"], r["grad_bytes_first_step"]
        at_disk = (per["written"] / disk[0] + per["read"] / disk[1]) / 1e6  # bytes / (GB/s) -> ms
        print(f"| {name} | {per['written'] / mib:.1f} / {per['read'] / mib:.1f} | {at_disk:.0f} | "
              f"{first['held_written'] / mib:.1f} / {first['held_read'] / mib:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
