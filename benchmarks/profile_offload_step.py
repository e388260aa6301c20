"""Where rank 0's step goes with offload on NVMe: wall time inside the swap path's functions, per step.

    python benchmarks/profile_offload_step.py [--bf16] [--steps 8] [--params] [--max-in-cpu 0] [--param-buffers 5]

Runs bench_offload.py's ZeRO-3 entry on 2 gloo ranks (the 25M benchmark GPT; `--params`: the parameters on
NVMe too, as `dstrain-z3-nvme`), with the parameter store's gathers and write-backs, the swapped stepper,
the gradient swap's reads and landings and every I/O wait wrapped in timers. Times nest (the tier's step
contains the stepper's waits), so rows do not add up; the phases (forward, backward, step) are
bench_offload's. A diagnostic, not a benchmark row: it changes nothing it measures but adds a timer per call.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_offload as bo  # noqa: E402
from tests.harness import run_distributed  # noqa: E402

_TIMES: dict = collections.defaultdict(float)
_CALLS: dict = collections.defaultdict(int)


def _timed(cls, name: str) -> None:
    fn, label = getattr(cls, name), f"{cls.__name__}.{name}"

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _TIMES[label] += time.perf_counter() - t0
            _CALLS[label] += 1
    setattr(cls, name, timed)


def _entry(offload: dict, steps: int, precision: dict) -> dict:
    from engine.zero.grad_swap import GradientSwap, SwappedTargets
    from engine.zero.nvme_tier import NvmeOptimizerTier
    from engine.zero.partitioned import PartitionedZeroOptimizer
    from offload.aio import IOHandle
    from offload.param_swap import NvmeParamStore
    from offload.swapped_partition import SwappedPartition
    for cls, names in ((NvmeParamStore, ("open_slots", "read_ahead", "write_behind", "_write_file")),
                       (IOHandle, ("wait",)), (SwappedPartition, ("step", "_step_sub_group")),
                       (NvmeOptimizerTier, ("step",)), (PartitionedZeroOptimizer, ("step", "_global_norm")),
                       (GradientSwap, ("read", "step_slice", "add_squares", "fold_squares", "flush")),
                       (SwappedTargets, ("land",))):
        for name in names:
            _timed(cls, name)
    out = bo._entry(offload, steps, 3, precision)
    out["times"] = {k: (v * 1e3 / steps, _CALLS[k] / steps) for k, v in sorted(_TIMES.items(), key=lambda kv: -kv[1])}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--params", action="store_true", help="the parameters on NVMe too")
    p.add_argument("--max-in-cpu", type=int, default=0)
    p.add_argument("--optimizer-buffers", type=int, default=12)
    p.add_argument("--param-buffers", type=int, default=None, help="offload_param.buffer_count (bench_offload's default)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="profile-offload-") as d:
        offload = bo._nvme_offload(d, args.params, optimizer_buffers=args.optimizer_buffers, max_in_cpu=args.max_in_cpu,
                                   param_buffers=args.param_buffers or bo.PARAM_BUFFERS)
        precision = {"bf16": {"enabled": True}} if args.bf16 else {}
        rank0 = run_distributed(_entry, 2, args=(offload, args.steps, precision), timeout=1800)[0]
    phases = ", ".join(f"{k} {v:.0f}" for k, v in rank0["phases_ms"].items())
    print(f"rank 0: {rank0['step_ms']:.0f} ms per step (median; {phases} ms)")
    print("| function (rank 0) | ms per step | calls per step |\n|---|---|---|")
    for name, (ms, calls) in rank0["times"].items():
        print(f"| {name} | {ms:.1f} | {calls:g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
