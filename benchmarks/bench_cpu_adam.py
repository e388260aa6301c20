"""CPU Adam step on `--millions` fp32 parameters: the kernel dstrain uses against the alternatives.

    python benchmarks/bench_cpu_adam.py [--millions 100] [--steps 3] [--rounds 2] [--deepspeed-venv /tmp/ds-venv]

Side by side in one run, in `--rounds` interleaved rounds (fused, foreach, DeepSpeed, fused, ...) of
`--steps` steps after one warm-up step each; each figure is the best step over all rounds (other load
on a shared machine only ever adds time; the median is reported too):
- `torch.optim.AdamW(fused=True)`: the kernel the offloaded step uses (offload/swapped_partition.py);
- `torch.optim.AdamW(foreach=True)`;
- DeepSpeed's `DeepSpeedCPUAdam` (AdamW mode), run in DeepSpeed's own venv (`--deepspeed-venv`; its op
  JIT-builds with g++/ninja the first time), or "not run: why";
- the memory-bandwidth bound: an Adam step reads param, grad, exp_avg, exp_avg_sq and writes three
  of them, 28 bytes per parameter, at the bandwidth of `a.add_(b)` (12 bytes per element) measured in
  this run with the same threads.
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
n, steps, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
p = torch.nn.Parameter(torch.randn(n, device="cpu")); p.grad = torch.randn(n, device="cpu")
if kind == "deepspeed":
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01, adamw_mode=True)
elif kind == "fused":
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
else:
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, foreach=True)
times = []
for i in range(steps + 1):
    t = time.perf_counter(); opt.step(); times.append(time.perf_counter() - t)
print(json.dumps({"best_s": min(times[1:]), "median_s": statistics.median(times[1:]), "threads": torch.get_num_threads()}))
"""


def add_bandwidth(n: int, repeats: int) -> float:
    a, b = torch.randn(n, device="cpu"), torch.randn(n, device="cpu")
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        a.add_(b)
        times.append(time.perf_counter() - t)
    return 12 * n / min(times[1:])  # read a, read b, write a: the best run is the least disturbed


def run_step(python: str, n: int, steps: int, kind: str) -> dict:
    result = subprocess.run([python, "-c", STEP_CODE, str(n), str(steps), kind], capture_output=True, text=True,
                            timeout=1800)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return {"not_run": last[:300]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--millions", type=float, default=100)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--deepspeed-venv", default=None)
    args = p.parse_args()
    n = int(args.millions * 1e6)
    out = {"params": n, "load_before": os.getloadavg(), "threads": torch.get_num_threads()}
    bandwidth = add_bandwidth(n, args.steps)
    out["add_bandwidth_GBps"] = bandwidth / 1e9
    out["bound_step_s"] = 28 * n / bandwidth
    ds_python = os.path.join(args.deepspeed_venv, "bin", "python") if args.deepspeed_venv else None
    pythons = {"fused": sys.executable, "foreach": sys.executable, "deepspeed": ds_python}
    runs: dict[str, list] = {kind: [] for kind in pythons}
    for _ in range(args.rounds):
        for kind, python in pythons.items():
            if python is None:
                runs[kind].append({"not_run": "no --deepspeed-venv given"})
            elif not os.path.exists(python):
                runs[kind].append({"not_run": f"no python in {args.deepspeed_venv}"})
            else:
                runs[kind].append(run_step(python, n, args.steps, kind))
    for kind, results in runs.items():
        ok = [r for r in results if "best_s" in r]
        if not ok:
            out[kind] = results[-1]
            continue
        out[kind] = {"step_s": min(r["best_s"] for r in ok), "median_s": statistics.median(r["median_s"] for r in ok),
                     "threads": ok[0]["threads"]}
        out[kind]["vs_bound"] = out["bound_step_s"] / out[kind]["step_s"]
    if "step_s" in out["deepspeed"]:
        out["fused_speedup_vs_deepspeed"] = out["deepspeed"]["step_s"] / out["fused"]["step_s"]
    out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
