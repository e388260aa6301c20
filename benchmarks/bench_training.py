"""Step time and peak memory of dstrain strategies next to plain PyTorch, in one run.

    python benchmarks/bench_training.py --systems ddp,fsdp2,dstrain-z0 --steps 20
    python benchmarks/bench_training.py --systems ddp,dstrain-z1,deepspeed-z1 --deepspeed-venv /tmp/ds-venv

Workload (shared/reference/baselines.md): GPT with 6 layers, d_model 512, 8 heads, seq 128, vocab
12,000, tied embeddings (25.12M parameters), micro-batch 8 per rank, AdamW, fp32, 2 ranks x 1 thread,
gloo over loopback. Reports the median step time of steps 2..N-1 and peak RSS per rank, and the
ratio of each system to the first one listed. These machines are noisy: read the ratios.

`deepspeed-z1`/`deepspeed-z2` run DeepSpeed itself (benchmarks/deepspeed_peer.py) with the python of
a separate virtual environment, `--deepspeed-venv PATH`. If PATH has no venv yet it is made there
(benchmarks/deepspeed_venv.py: DeepSpeed 0.19.x, the same torch as ours, its CPU Adam op built); a venv
never goes into the repository.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import subprocess
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload_model import ENV as MODEL_ENV  # noqa: E402
from benchmarks.workload_model import MODELS, bench_config  # noqa: E402
from examples.gpt import GPT, GPTConfig, RandomTokens  # noqa: E402

BENCH_CONFIG = bench_config()  # --model: the spawned ranks read the choice at import, as the DeepSpeed peer does
from tests.harness import run_distributed  # noqa: E402

MICRO = 8
LR = 1e-4


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _batches(steps: int, rank: int, model_cfg: GPTConfig | None = None, micro: int = MICRO):
    model_cfg = model_cfg or BENCH_CONFIG
    data = RandomTokens(steps * micro, model_cfg.seq_len, model_cfg.vocab_size, seed=rank)
    return [data[i * micro:(i + 1) * micro] for i in range(steps)]


def _timed_loop(step_fn, batches, counter=None, counted_step: int = -1) -> list[float]:
    """Each step's ms. `counter` (a context manager, e.g. the suite's byte-counting dispatch mode) is
    entered for step `counted_step` only: the suite's last warm-up step, which its median leaves out,
    so the counter's own overhead never reaches a measured step."""
    times = []
    for i, (x, y) in enumerate(batches):
        with (counter if counter is not None and i == counted_step else contextlib.nullcontext()):
            t0 = time.perf_counter()
            step_fn(x, y)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def _torch_step(model, opt):
    def step(x, y):
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# Every runner: (steps, fused, model_cfg=None → BENCH_CONFIG) → per-step times in ms, on every rank.
def _run_ddp(steps: int, fused: bool, model_cfg: GPTConfig | None = None):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(GPT(model_cfg or BENCH_CONFIG), gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=fused, foreach=None if fused else True)
    return _timed_loop(_torch_step(model, opt), _batches(steps, dist.get_rank(), model_cfg))


def _run_fsdp2(steps: int, fused: bool, model_cfg: GPTConfig | None = None, counter=None, counted_step: int = -1):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = GPT(model_cfg or BENCH_CONFIG)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    return _timed_loop(_torch_step(model, opt), _batches(steps, dist.get_rank(), model_cfg), counter, counted_step)


def _dstrain_config(stage: int, fused: bool, extra: dict | None = None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "fused": fused}},
           "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 5e6}}
    cfg.update(extra or {})
    return cfg


def _run_dstrain(steps: int, fused: bool, stage: int = 0, extra: dict | None = None,
                 model_cfg: GPTConfig | None = None, on_engine=None):
    """`on_engine(eng)`, if given, is called after the timed steps (the suite reads bytes communicated)."""
    import engine
    eng, _, _, _ = engine.initialize(model=GPT(model_cfg or BENCH_CONFIG), config=_dstrain_config(stage, fused, extra))

    def step(x, y):
        eng.backward(eng(x, y))
        eng.step()
    times = _timed_loop(step, _batches(steps, dist.get_rank(), model_cfg))
    if on_engine is not None:
        on_engine(eng)
    eng.destroy()
    return times


SYSTEMS = {
    "ddp": _run_ddp,
    "fsdp2": _run_fsdp2,
    "dstrain-z0": lambda steps, fused: _run_dstrain(steps, fused, stage=0),
    "dstrain-z0-fp16": lambda steps, fused: _run_dstrain(steps, fused, stage=0, extra={"fp16": {"enabled": True}}),
    "dstrain-z0-bf16": lambda steps, fused: _run_dstrain(steps, fused, stage=0, extra={"bf16": {"enabled": True}}),
    "dstrain-z1": lambda steps, fused: _run_dstrain(steps, fused, stage=1),
    "dstrain-z2": lambda steps, fused: _run_dstrain(steps, fused, stage=2),
    # Stage 3 with DeepSpeed's stage-3 defaults, as deepspeed-z3 runs (a model this size stays gathered
    # from forward to backward: 2Ψ), and "strict", which re-gathers before backward like FSDP2 (3Ψ).
    "dstrain-z3": lambda steps, fused: _run_dstrain(steps, fused, stage=3),
    "dstrain-z3-strict": lambda steps, fused: _run_dstrain(
        steps, fused, stage=3, extra={"zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": 5e6,
                                                            "stage3_max_reuse_distance": 0,
                                                            "stage3_prefetch_bucket_size": 4e6}}),
}


DEEPSPEED_SYSTEMS = {"deepspeed-z1": 1, "deepspeed-z2": 2, "deepspeed-z3": 3}
PEER = Path(__file__).resolve().parent / "deepspeed_peer.py"


def _deepspeed_python(venv: Path) -> Path:
    """The venv's python, making the venv first when it has none (benchmarks/deepspeed_venv.py)."""
    from benchmarks.deepspeed_venv import VenvError, ensure
    try:
        return ensure(venv)
    except VenvError as e:
        raise SystemExit(f"--deepspeed-venv: {e}") from None


def _run_deepspeed(python: Path, stage: int, steps: int, world: int, extra: dict | None = None,
                   model: dict | None = None, config: dict | None = None, full: bool = False):
    """DeepSpeed on the benchmark GPT (or `model`, GPTConfig fields) with AdamW at `stage` (or `config`),
    `extra` merged into the config (bench_offload.py's offload sections). (step ms, peak RSS MB), or with
    `full` the peer's whole JSON row (the suite reads its bytes)."""
    cmd = [str(python), str(PEER), "--stage", str(stage), "--steps", str(steps), "--world", str(world)]
    # the model always named: the peer's own default is the same choice (workload_model), but explicit is checkable
    cmd += ["--model-json", json.dumps(model or dataclasses.asdict(bench_config()))]
    cmd += ["--config-json", json.dumps(config)] if config else []
    cmd += ["--extra", json.dumps(extra)] if extra else []
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"DeepSpeed ZeRO-{stage} peer failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return row if full else (row["step_ms"], row["rss_mb"])


def _rank_entry(system: str, steps: int, fused: bool):
    torch.manual_seed(0)
    times = SYSTEMS[system](steps, fused)
    return {"step_ms": statistics.median(times[2:-1] if len(times) > 4 else times), "rss_mb": _peak_rss_mb()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="ddp,dstrain-z0")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--model", choices=sorted(MODELS), default="25m", help="the 25M benchmark GPT or the demo's")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the systems this many times, interleaved, and keep each one's best round")
    p.add_argument("--foreach", action="store_true", help="AdamW foreach instead of fused (baselines.md used foreach)")
    p.add_argument("--deepspeed-venv", type=Path, default=None,
                   help="virtual environment with deepspeed for the deepspeed-z* systems (made if missing)")
    args = p.parse_args(argv)
    os.environ[MODEL_ENV] = args.model  # read by the spawned ranks at import and by the DeepSpeed peer
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS and s not in DEEPSPEED_SYSTEMS]
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {sorted(SYSTEMS) + sorted(DEEPSPEED_SYSTEMS)}")
    if any(s in DEEPSPEED_SYSTEMS for s in systems):
        if args.deepspeed_venv is None:
            p.error("the deepspeed-z* systems need --deepspeed-venv PATH")
        ds_python = _deepspeed_python(args.deepspeed_venv)
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.rounds):  # interleaved rounds: a noisy neighbour hurts every system alike
        for name in systems:
            if name in DEEPSPEED_SYSTEMS:
                step, rss = _run_deepspeed(ds_python, DEEPSPEED_SYSTEMS[name], args.steps, args.world)
            else:
                per_rank = run_distributed(_rank_entry, args.world, args=(name, args.steps, not args.foreach),
                                           timeout=1800)
                step = max(r["step_ms"] for r in per_rank)
                rss = max(r["rss_mb"] for r in per_rank)
            print(f"{name:>16}: {step:8.1f} ms/step  peak RSS/rank {rss:7.0f} MB", flush=True)
            if name not in best or step < best[name][0]:
                best[name] = (step, rss)
    print_ratio_table([(name, *best[name]) for name in systems])
    return 0


def print_ratio_table(rows: list[tuple[str, float, float]]) -> None:
    """(system, ms/step, peak RSS MB) rows as a markdown table, with ratios to the first row."""
    base_step, base_rss = rows[0][1], rows[0][2]
    print(f"\n| system | ms/step | ratio vs {rows[0][0]} | peak RSS/rank MB | RSS ratio |")
    print("|---|---|---|---|---|")
    for name, step, rss in rows:
        print(f"| {name} | {step:.0f} | {step / base_step:.3f} | {rss:.0f} | {rss / base_rss:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
