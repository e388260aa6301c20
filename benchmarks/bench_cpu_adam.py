"""CPU Adam step on `--millions` fp32 parameters: the kernel dstrain uses against the alternatives.

    python benchmarks/bench_cpu_adam.py [--millions 100] [--steps 3] [--rounds 2] [--threads 2,1]
        [--deepspeed-venv /tmp/ds-venv]

Side by side in one run, in `--rounds` interleaved rounds (each kind below in turn) of `--steps` steps
after one warm-up step each; each figure is the best step over all rounds (other load on a shared
machine only ever adds time; the median is reported too):
- `fused`: what dstrain's step runs: torch's `AdamW(fused=True)` over master weights and gradient on
  transparent huge pages and its state moved onto them after the first step, as the engine does
  (offload/huge_pages.py; the move is in the timed step, a no-op once done);
- `fused_4k`: the same kernel on tensors from torch's allocator (4 KiB pages where THP is "madvise");
- `torch.optim.AdamW(foreach=True)`;
- DeepSpeed's `DeepSpeedCPUAdam` (AdamW mode), run in DeepSpeed's own venv (`--deepspeed-venv`; its op
  JIT-builds with g++/ninja the first time), or "not run: why"; and `deepspeed_thp`, the same with
  torch's `THP_MEM_ALLOC_ENABLE=1` (not DeepSpeed's default: what it would gain if its user set it);
- the memory-bandwidth bound: an Adam step reads param, grad, exp_avg, exp_avg_sq and writes three
  of them, 28 bytes per parameter, at the bandwidth of `a.add_(b)` (12 bytes per element) measured in
  this run with the same threads, on 4 KiB and on huge pages, the best of `--steps` calls in each round
  (load only slows it); the bound takes the faster of the two.
Each of `--threads` (default: torch's count, then 1, the thread count of an offloading rank in the
benchmarks and tests, 2 ranks on 2 cores) is its own set of rows; DeepSpeed's OpenMP kernel gets
OMP_NUM_THREADS and torch.set_num_threads of the same count.
Goal (issue 17): fused >= DeepSpeed's and >= 70% of the bound. One JSON object; the machine may be
shared (load averages before and after are in it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

STEP_CODE = """
import json, statistics, sys, time, torch
n, steps, kind, threads = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
torch.set_num_threads(threads)
torch.manual_seed(0)
after_step = lambda: None
if kind == "fused":  # the engine's tensors (offload/huge_pages.py)
    from offload import huge_pages
    p = torch.nn.Parameter(huge_pages.host_zeros(n).normal_()); p.grad = huge_pages.host_zeros(n).normal_()
else:
    p = torch.nn.Parameter(torch.randn(n, device="cpu")); p.grad = torch.randn(n, device="cpu")
if kind.startswith("deepspeed"):
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01, adamw_mode=True)
elif kind.startswith("fused"):
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
    if kind == "fused":
        after_step = lambda: huge_pages.adopt_state(opt)
else:
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, foreach=True)
times = []
for i in range(steps + 1):
    t = time.perf_counter(); opt.step(); after_step(); times.append(time.perf_counter() - t)
out = {"best_s": min(times[1:]), "median_s": statistics.median(times[1:]), "threads": torch.get_num_threads()}
if kind == "fused":  # the share of the streamed bytes the kernel did map on huge pages
    streamed = [p.detach(), p.grad] + [v for v in opt.state[p].values() if v.dim() > 0]
    out["huge_page_share"] = sum(map(huge_pages.resident_huge_bytes, streamed)) / sum(t.numel() * 4 for t in streamed)
print(json.dumps(out))
"""


def add_bandwidth(n: int, repeats: int, threads: int, huge: bool) -> float:
    from offload import huge_pages
    torch.set_num_threads(threads)
    if huge:
        a, b = huge_pages.host_empty(n).normal_(), huge_pages.host_empty(n).normal_()
    else:
        a, b = torch.randn(n, device="cpu"), torch.randn(n, device="cpu")
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        a.add_(b)
        times.append(time.perf_counter() - t)
    return 12 * n / min(times[1:])  # read a, read b, write a: the best run is the least disturbed


def run_step(python: str, n: int, steps: int, kind: str, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if kind == "deepspeed_thp":
        env["THP_MEM_ALLOC_ENABLE"] = "1"  # torch's allocator advises huge pages (read at its first allocation)
    result = subprocess.run([python, "-c", STEP_CODE, str(n), str(steps), kind, str(threads)], capture_output=True,
                            text=True, timeout=1800, env=env)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return {"not_run": last[:300]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def summary(results: list[dict], bound_s: float) -> dict:
    ok = [r for r in results if "best_s" in r]
    if not ok:
        return results[-1]
    out = {"step_s": min(r["best_s"] for r in ok), "median_s": statistics.median(r["median_s"] for r in ok),
           "threads": ok[0]["threads"]}
    if "huge_page_share" in ok[0]:
        out["huge_page_share"] = min(r["huge_page_share"] for r in ok)
    out["vs_bound"] = bound_s / out["step_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--millions", type=float, default=100)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", default=f"{torch.get_num_threads()},1", help="comma-separated thread counts")
    p.add_argument("--deepspeed-venv", default=None)
    args = p.parse_args()
    n = int(args.millions * 1e6)
    threads = sorted({int(t) for t in args.threads.split(",")}, reverse=True)
    out = {"params": n, "load_before": os.getloadavg()}
    ds_python = os.path.join(args.deepspeed_venv, "bin", "python") if args.deepspeed_venv else None
    pythons = {"fused": sys.executable, "fused_4k": sys.executable, "foreach": sys.executable,
               "deepspeed": ds_python, "deepspeed_thp": ds_python}
    runs: dict[tuple, list] = {(kind, t): [] for t in threads for kind in pythons}
    bandwidth = {(t, huge): 0.0 for t in threads for huge in (False, True)}
    for _ in range(args.rounds):
        for t in threads:
            for huge in (False, True):
                bandwidth[t, huge] = max(bandwidth[t, huge], add_bandwidth(n, args.steps, t, huge))
            for kind, python in pythons.items():
                if python is None:
                    runs[kind, t].append({"not_run": "no --deepspeed-venv given"})
                elif not os.path.exists(python):
                    runs[kind, t].append({"not_run": f"no python in {args.deepspeed_venv}"})
                else:
                    runs[kind, t].append(run_step(python, n, args.steps, kind, t))
    for t in threads:
        bound_s = 28 * n / max(bandwidth[t, False], bandwidth[t, True])
        row = {"add_bandwidth_GBps": bandwidth[t, False] / 1e9, "add_bandwidth_huge_pages_GBps": bandwidth[t, True] / 1e9,
               "bound_step_s": bound_s}
        row.update({kind: summary(runs[kind, t], bound_s) for kind in pythons})
        if "step_s" in row["deepspeed"]:
            row["fused_speedup_vs_deepspeed"] = row["deepspeed"]["step_s"] / row["fused"]["step_s"]
            row["fused_median_speedup_vs_deepspeed"] = row["deepspeed"]["median_s"] / row["fused"]["median_s"]
        out[f"threads_{t}"] = row
    out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
