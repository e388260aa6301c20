"""Pipeline schedules side by side: dstrain's `train_batch` with every `pipeline.schedule`, torch's own
PipelineStage + schedule on the same layers, and (with --deepspeed-venv) DeepSpeed's PipelineEngine.

    python benchmarks/bench_pipeline.py --stages 2,4 --micro-batches 1,4,8 --steps 20 --rounds 3
    python benchmarks/bench_pipeline.py --stages 2 --micro-batches 4 --deepspeed-venv /tmp/ds-venv
    python benchmarks/bench_pipeline.py --stages 2 --micro-batches 4 --tensor-parallel 2   # 3D rows

Workload: benchmarks/pipe_workload.py (16 layers: 8 × Linear(512, 512) + GELU, micro-batch 16, MSE,
SGD), one rank per stage, 1 thread each, gloo over loopback, fp32. Per row: the median train_batch
time of the last min(15, N - 1) of N steps (the first builds the stages; the next warm up), the slowest
rank's, over `--rounds` interleaved rounds (each round runs dstrain's schedules and torch's in one set of
processes, then DeepSpeed's, for every m), with the ratio to DeepSpeed taken within each round and its
median over rounds reported (a shared machine's load drifts between rounds), the bubble fraction from the executed actions
(engine/pipe/schedule.py) next to its formula, and the peak bytes of activations autograd holds per
stage (saved-tensor hooks). Interleaved and zero-bubble rows use 2 chunks per rank. These machines are
shared and noisy: read ratios, and the load printed with them.
`--tensor-parallel T` adds pipeline × tensor parallelism rows instead: examples/gpt_pipe.py's GPT
(d_model 256, 4 blocks, seq 64) in 1F1B on `stages` × T ranks with AutoTP (`autotp_size: T`), next to
the same model on `stages` ranks without it. DeepSpeed has no peer row here: its PipelineEngine takes
tensor parallelism only from a Megatron `mpu`, not from AutoTP.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import pipe_workload as wl  # noqa: E402
from tests.harness import run_distributed  # noqa: E402

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble")


def measured(times: list[float]) -> float:
    """The median of the last min(15, N - 1) step times (the first builds; the next ones warm up)."""
    return statistics.median(times[-min(15, len(times) - 1):])


def _dstrain(schedule: str, m: int, steps: int) -> dict:
    import torch.distributed as dist
    import engine
    from engine.checkpointing import SavedActivationProbe
    from engine.pipe import PipelineModule
    from engine.pipe.schedule import idle_fractions
    stages, virtual = dist.get_world_size(), 2 if schedule in ("interleaved_1f1b", "zero_bubble") else 1
    pm = PipelineModule(wl.layers(), num_stages=stages, loss_fn=wl.loss_fn, partition_method="uniform",
                        virtual_stages=virtual)
    cfg = {"train_micro_batch_size_per_gpu": wl.MICRO, "gradient_accumulation_steps": m,
           "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "pipeline": {"schedule": schedule},
           "steps_per_print": 10**9}
    eng, *_ = engine.initialize(model=pm, config=cfg)
    data = wl.micro_batches(m * steps)
    times = []
    for i in range(steps):
        batch = iter(data[i * m:(i + 1) * m])
        t0 = time.perf_counter()
        if i == steps - 1:
            with SavedActivationProbe(pm.parameters()) as probe:
                eng.train_batch(batch)
        else:
            eng.train_batch(batch)
        times.append((time.perf_counter() - t0) * 1e3)
    idle = idle_fractions(eng.schedule_actions(), stages * virtual)
    eng.destroy()
    return {"step_ms": measured(times), "bubble": max(idle.values()), "act_bytes": probe.peak_bytes}


def _torch_native(m: int, steps: int) -> dict:
    """torch's own PipelineStage + Schedule1F1B (GPipe when m < stages) on the same layers."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining as tp
    rank, world = dist.get_rank(), dist.get_world_size()
    per = len(wl.layers()) // world
    mod = torch.nn.Sequential(*wl.layers()[rank * per:(rank + 1) * per])
    stage = tp.PipelineStage(mod, rank, world, torch.device("cpu"))
    cls = tp.Schedule1F1B if m >= world else tp.ScheduleGPipe
    sched = cls(stage, n_microbatches=m, loss_fn=wl.loss_fn)
    opt = torch.optim.SGD(mod.parameters(), lr=1e-3)
    data = wl.micro_batches(m * steps)
    times = []
    for i in range(steps):
        xs = torch.cat([x for x, _ in data[i * m:(i + 1) * m]])
        ys = torch.cat([y for _, y in data[i * m:(i + 1) * m]])
        t0 = time.perf_counter()
        if rank == 0:
            sched.step(xs)
        elif rank == world - 1:
            sched.step(target=ys)
        else:
            sched.step()
        opt.step()
        opt.zero_grad()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"step_ms": measured(times)}


def _gpt_pipe(stages: int, degree: int, m: int, steps: int) -> dict:
    """1F1B on the GPT layer list, pipe `stages` × model `degree` (AutoTP), ZeRO-1, AdamW."""
    import torch
    import torch.distributed as dist
    import engine
    from engine.pipe import PipelineModule
    from engine.topology import Topology
    from examples.gpt import GPTConfig, RandomTokens
    from examples.gpt_pipe import gpt_layers, gpt_loss
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=256)
    topo = Topology.for_world(dist.get_world_size(), pipe=stages, model=degree)
    pm = PipelineModule(gpt_layers(cfg), topology=topo, loss_fn=gpt_loss, seed_layers=True,
                        partition_method="type:BlockLayer")
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": m, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
              "tensor_parallel": {"autotp_size": degree}}
    eng, *_ = engine.initialize(model=pm, config=config)
    data = RandomTokens(4 * m * steps, cfg.seq_len, cfg.vocab_size)
    times = []
    for i in range(steps):
        batch = iter([tuple(torch.stack(t) for t in zip(*(data[4 * (i * m + k) + j] for j in range(4))))
                      for k in range(m)])
        t0 = time.perf_counter()
        eng.train_batch(batch)
        times.append((time.perf_counter() - t0) * 1e3)
    eng.destroy()
    return {"step_ms": statistics.median(times[1:])}


def _tensor_parallel_rows(stages: int, degree: int, ms: list[int], steps: int) -> None:
    print(f"{'p':>2} {'m':>2} {'system':<26} {'ranks':>5} {'step ms':>9} {'vs tp1':>6}")
    for m in ms:
        base = max(r["step_ms"] for r in run_distributed(_gpt_pipe, world_size=stages, args=(stages, 1, m, steps),
                                                          timeout=1800))
        tp = max(r["step_ms"] for r in run_distributed(_gpt_pipe, world_size=stages * degree,
                                                        args=(stages, degree, m, steps), timeout=1800))
        print(f"{stages:>2} {m:>2} {'dstrain-1f1b-gpt':<26} {stages:>5} {base:>9.1f} {1.0:>6.2f}")
        print(f"{stages:>2} {m:>2} {f'dstrain-1f1b-gpt-autotp{degree}':<26} {stages * degree:>5} {tp:>9.1f} "
              f"{tp / base:>6.2f}")


def _all(stages: int, ms: list[int], steps: int) -> dict:
    out = {}
    for m in ms:
        for schedule in SCHEDULES:
            if schedule in ("interleaved_1f1b", "zero_bubble") and m % stages:
                continue  # torch's interleaved schedules need m to be a multiple of the stage count
            out[(schedule, m)] = _dstrain(schedule, m, steps)
        out[("torch", m)] = _torch_native(m, steps)
    return out


def _deepspeed(venv: str, stages: int, m: int, steps: int) -> float | None:
    peer = Path(__file__).resolve().parent / "deepspeed_pipe_peer.py"
    proc = subprocess.run([str(Path(venv) / "bin" / "python"), str(peer), "--stages", str(stages),
                           "--micro-batches", str(m), "--steps", str(steps)], capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        print(f"deepspeed p={stages} m={m} failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])["step_ms"]


def _round(stages: int, ms: list[int], steps: int, venv: str | None, deepspeed_first: bool) -> dict:
    """One round on `stages` ranks: {(system, m): row}, each row the slowest rank's step time."""
    def ours() -> dict:
        ranks = run_distributed(_all, world_size=stages, args=(stages, ms, steps), timeout=1800)
        return {key: {**ranks[0][key], "step_ms": max(r[key]["step_ms"] for r in ranks),
                      "acts": "/".join(f"{r[key]['act_bytes'] / 1024:.0f}" for r in ranks) if key[0] != "torch" else ""}
                for key in ranks[0]}

    def theirs() -> dict:
        out = {}
        for m in ms:
            ds = _deepspeed(venv, stages, m, steps) if venv else None
            if ds is not None:
                out[("deepspeed", m)] = {"step_ms": ds}
        return out

    if deepspeed_first:
        first = theirs()
        return {**first, **ours()}
    first = ours()
    return {**first, **theirs()}


def _print_rows(stages: int, ms: list[int], rounds: list[dict]) -> None:
    from engine.pipe.schedule import formula_bubble
    for m in ms:
        for system in ("deepspeed", *SCHEDULES, "torch"):
            if (system, m) not in rounds[0]:
                continue
            steps = [r[(system, m)]["step_ms"] for r in rounds]
            ratios = [r[(system, m)]["step_ms"] / r[("deepspeed", m)]["step_ms"] for r in rounds
                      if ("deepspeed", m) in r]
            ratio = f"{statistics.median(ratios):>6.2f}" if ratios else f"{'-':>6}"
            each = ",".join(f"{x:.2f}" for x in ratios)
            row = rounds[0][(system, m)]
            name = {"deepspeed": "deepspeed-1f1b", "torch": "torch-native"}.get(system, "dstrain-" + system)
            extra = ""
            if "bubble" in row:
                v = 2 if system in ("interleaved_1f1b", "zero_bubble") else 1
                extra = f"{row['bubble']:>7.3f} {formula_bubble(system, stages, m, v):>7.3f} {row['acts']:>16}"
            print(f"{stages:>2} {m:>2} {name:<24} {statistics.median(steps):>9.1f} {ratio} {each:<16} {extra}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default="2,4")
    p.add_argument("--micro-batches", default="1,4,8")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (dstrain+torch, then DeepSpeed)")
    p.add_argument("--deepspeed-venv", default=None)
    p.add_argument("--tensor-parallel", type=int, default=1, help="T > 1: the pipeline x tensor-parallel rows")
    args = p.parse_args()
    print(f"load before: {os.getloadavg()}")
    if args.tensor_parallel > 1:
        for stages in [int(s) for s in args.stages.split(",")]:
            _tensor_parallel_rows(stages, args.tensor_parallel, [int(m) for m in args.micro_batches.split(",")],
                                  args.steps)
        print(f"load after: {os.getloadavg()}")
        return 0
    ms = [int(m) for m in args.micro_batches.split(",")]
    for stages in [int(s) for s in args.stages.split(",")]:
        rounds = []
        for k in range(args.rounds):
            rounds.append(_round(stages, ms, args.steps, args.deepspeed_venv, deepspeed_first=k % 2 == 1))
            print(f"# p={stages} round {k + 1}/{args.rounds} done, load {os.getloadavg()}", flush=True)
        print(f"{'p':>2} {'m':>2} {'system':<24} {'step ms':>9} {'vs DS':>6} {'per round':<16} {'bubble':>7} "
              f"{'formula':>7} {'act KB/stage':>16}")
        _print_rows(stages, ms, rounds)
    print(f"load after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
