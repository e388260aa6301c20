"""Tensor-parallel step time: dstrain's AutoTP next to DeepSpeed's AutoTP and dense DDP, in one run.

    python benchmarks/bench_tensor_parallel.py --deepspeed-venv /tmp/ds-venv --steps 8

Workload: a Llama-style HF model at the benchmark GPT's sizes (benchmarks/deepspeed_autotp_peer.py,
`bench_model`), fp32, AdamW (torch's), no clipping, global batch 8 sequences of 128 tokens per step, 2 ranks x 1 thread, gloo over loopback:
- `ddp`: torch DDP, each rank the whole model and 4 sequences;
- `dstrain-tp2`: `tensor_parallel.autotp_size: 2`, ZeRO-1, both ranks one model and all 8 sequences;
- `dstrain-tp2-clip`: the same with `gradient_clipping: 1.0` (DeepSpeed's default): the norm agreed
  over the world (engine/tensor_parallel/norm.py) costs one more all-reduce of one float per step (over the model group);
- `dstrain-tp2-fp16`, `dstrain-tp2-fp16-clip`: the same in fp16 (dynamic loss scale), without and with
  clipping (the agreed norm of the unscaled gradients; on CPU fp16 matmuls are slow, compare the pair);
- `dstrain-tp2-z3`: `dstrain-tp2` at ZeRO-3: each shard partitioned over the data axis and gathered around
  its use (with 2 ranks and T = 2 the data axis has one rank: the cost of stage 3's hooks and gathers
  beside ZeRO-1's, not memory; on 4 ranks each shard is halved);
- `deepspeed-autotp2`: DeepSpeed 0.19's `tensor_parallel.autotp_size: 2`, ZeRO-1, the same.
Median step time of steps 2..N-1, slowest rank, and the ratio to the first system. On 2 CPU cores
tensor parallelism cannot beat DDP (the same flops plus 4 all-reduces of activations per layer); the
comparison that matters is against DeepSpeed's AutoTP. These machines are shared: read the ratios.
"""
from __future__ import annotations

import argparse
import functools
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_training import print_ratio_table  # noqa: E402
from deepspeed_autotp_peer import GLOBAL_BATCH, LR, bench_batches, bench_model, median_ms  # noqa: E402
from tests.harness import run_distributed  # noqa: E402

PEER = Path(__file__).resolve().parent / "deepspeed_autotp_peer.py"


def _timed(step, batches) -> list[float]:
    times = []
    for ids in batches:
        t0 = time.perf_counter()
        step(ids)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _run_ddp(steps: int) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel as DDP
    world = dist.get_world_size()
    model = DDP(bench_model(), gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(ids):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _timed(step, bench_batches(steps, GLOBAL_BATCH // world, dist.get_rank()))


def _run_dstrain_tp(steps: int, tp: int = 2, clip: float = 0.0, fp16: bool = False, zero: int = 1) -> list[float]:
    import engine
    from engine.topology import current
    data = dist.get_world_size() // tp
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // data, "gradient_accumulation_steps": 1,
           "gradient_clipping": clip, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
           "zero_optimization": {"stage": zero}, "tensor_parallel": {"autotp_size": tp}, "fp16": {"enabled": fp16}}
    eng, _, _, _ = engine.initialize(model=bench_model(), config=cfg)

    def step(ids):
        eng.backward(eng(input_ids=ids, labels=ids).loss)
        eng.step()
    times = _timed(step, bench_batches(steps, GLOBAL_BATCH // data, current().coord.data))
    eng.destroy()
    return times


SYSTEMS = {"ddp": _run_ddp, "dstrain-tp2": _run_dstrain_tp,
           "dstrain-tp2-clip": functools.partial(_run_dstrain_tp, clip=1.0),
           "dstrain-tp2-fp16": functools.partial(_run_dstrain_tp, fp16=True),
           "dstrain-tp2-fp16-clip": functools.partial(_run_dstrain_tp, clip=1.0, fp16=True),
           "dstrain-tp2-z3": functools.partial(_run_dstrain_tp, zero=3)}


def _rank_entry(system: str, steps: int) -> dict:
    torch.manual_seed(0)
    times = SYSTEMS[system](steps)
    return {"step_ms": median_ms(times), "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _run_deepspeed(venv: Path, steps: int, world: int) -> dict:
    python = venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"--deepspeed-venv {venv}: no bin/python there (benchmarks/bench_training.py creates one)")
    out = subprocess.run([str(python), str(PEER), "--steps", str(steps), "--world", str(world), "--tp", "2"],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"DeepSpeed AutoTP peer failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="ddp,dstrain-tp2,deepspeed-autotp2")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--world", type=int, default=2,
                   help="ranks; 4 gives dstrain 2 model x 2 data (ZeRO-3: shards halved)")
    p.add_argument("--deepspeed-venv", type=Path, default=None)
    args = p.parse_args(argv)
    rows = []
    for name in args.systems.split(","):
        if name == "deepspeed-autotp2":
            if args.deepspeed_venv is None:
                p.error("deepspeed-autotp2 needs --deepspeed-venv PATH")
            row = _run_deepspeed(args.deepspeed_venv, args.steps, args.world)
        elif name in SYSTEMS:
            per_rank = run_distributed(_rank_entry, args.world, args=(name, args.steps), timeout=1800)
            row = {"step_ms": max(r["step_ms"] for r in per_rank), "rss_mb": max(r["rss_mb"] for r in per_rank)}
        else:
            p.error(f"unknown system {name!r}; choose from {sorted(SYSTEMS) + ['deepspeed-autotp2']}")
        print(f"{name:>18}: {row['step_ms']:8.1f} ms/step  peak RSS/rank {row['rss_mb']:7.0f} MB", flush=True)
        rows.append((name, row["step_ms"], row["rss_mb"]))
    print_ratio_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
