"""DeepSpeed's PipelineEngine (1F1B) on bench_pipeline.py's workload, run inside DeepSpeed's venv.

    VENV/bin/python benchmarks/deepspeed_pipe_peer.py --stages 2 --micro-batches 4 --steps 5

Imports only torch, deepspeed and benchmarks/pipe_workload.py. Prints one JSON line: the slowest
rank's median train_batch time (ms) over the last min(15, steps - 1) steps, and each rank's median minor
page faults and CPU ms (process time, all threads) per step over the same steps (bench_pipeline --faults).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipe_workload as wl  # noqa: E402
from peer_ranks import spawn_ranks  # noqa: E402


def _rank(rank: int, world: int, port: int, m: int, steps: int, outdir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.pipe import PipelineModule
    deepspeed.init_distributed(dist_backend="gloo")
    model = PipelineModule(layers=wl.layers(), num_stages=world, loss_fn=wl.loss_fn, partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": wl.MICRO, "gradient_accumulation_steps": m, "steps_per_print": 10**9}
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    eng, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    data = wl.micro_batches(m * steps)
    times, faults, cpu = [], [], []
    for i in range(steps):
        it = iter(data[i * m:(i + 1) * m])
        f0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time(), time.perf_counter()
        eng.train_batch(it)
        times.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    last = min(15, len(times) - 1)  # as bench_pipeline.measured: the last 15, warm-up left out
    Path(outdir, f"{rank}.json").write_text(json.dumps({
        "step_ms": statistics.median(times[-last:]), "faults": statistics.median(faults[-last:]),
        "cpu_ms": statistics.median(cpu[-last:])}))
    deepspeed.comm.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--micro-batches", type=int, required=True)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    rows = spawn_ranks(_rank, args.stages, args.micro_batches, args.steps)
    print(json.dumps({"step_ms": max(r["step_ms"] for r in rows), "faults": [r["faults"] for r in rows],
                      "cpu_ms": [r["cpu_ms"] for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
