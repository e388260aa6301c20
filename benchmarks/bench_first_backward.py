"""The first backward's gradient hold under reentrant activation checkpointing, measured.

    python benchmarks/bench_first_backward.py --stages 2,3 --steps 3

ZeRO's first reducing backward holds every full gradient to its end where a parameter's gradient may
arrive in pieces (engine/zero/arrivals.py, note "when to discover"). The 25M benchmark GPT
(examples/gpt.py) on 2 ranks, each block in a region of: torch's reentrant checkpoint (regions ZeRO
cannot see into: the first backward holds), dstrain's reentrant `engine.checkpointing.checkpoint`
(DeepSpeed's API; its regions record their parameters, engine/activation_checkpointing/region_params.py,
and share none here: no hold), torch's non-reentrant checkpoint (no Python Function: no hold). Per step,
the peak RSS above the RSS before it (benchmarks/peak_rss.py restarts the peak mark), the larger of the
two ranks, and the step time; step 0's extra peak over step 1's is the hold (fp32 here: 4 bytes per
parameter of the whole model, against buckets and a partition otherwise). AdamW, micro-batch 8, one
thread per rank. Not a timing of the recording itself: it runs once, in step 0's forward.
With `--deepspeed-venv`, DeepSpeed's rows on the same model (benchmarks/deepspeed_first_backward_peer.py):
torch's reentrant checkpoint, DeepSpeed's own `deepspeed.checkpointing.checkpoint`, non-reentrant.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness import run_distributed  # noqa: E402

FLAVOURS = ("torch-reentrant", "dstrain-reentrant", "non-reentrant")


def _model(flavour: str):
    import torch

    from benchmarks.checkpointed_gpt import CheckpointedGPT, torch_region
    from engine.activation_checkpointing import checkpoint
    from examples.gpt import BENCH_CONFIG
    torch.manual_seed(0)
    region = checkpoint if flavour == "dstrain-reentrant" else torch_region(flavour == "torch-reentrant")
    return CheckpointedGPT(BENCH_CONFIG, region), BENCH_CONFIG


def _run(stage: int, flavour: str, steps: int) -> list[tuple[float, float]]:
    """(peak RSS MB above the step's start, ms) per step, in fresh processes: a heap that an earlier
    run freed would hide part of a later run's peak."""
    import torch

    import engine
    from benchmarks.checkpointed_gpt import measured_steps
    model, cfg = _model(flavour)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": stage}}
    eng, *_ = engine.initialize(model=model, config=config)
    rows = measured_steps(eng, cfg, steps, torch.distributed.get_rank())
    eng.destroy()
    return rows


def _deepspeed(venv: str, stage: int, flavour: str, steps: int) -> list | str:
    """DeepSpeed's rows (benchmarks/deepspeed_first_backward_peer.py, in its venv), or why not."""
    peer = Path(__file__).resolve().parent / "deepspeed_first_backward_peer.py"
    proc = subprocess.run([str(Path(venv) / "bin" / "python"), str(peer), "--stage", str(stage), "--flavour", flavour,
                           "--steps", str(steps)], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return f"not run: {(proc.stderr.strip().splitlines() or ['?'])[-1][:160]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _print_row(stage: int, name: str, rows: list) -> None:
    peaks, times = [r[0] for r in rows], [r[1] for r in rows]
    print(f"{stage:>4} {name:<28} " + " ".join(f"{x:>15.1f}" for x in peaks)
          + f" {peaks[0] - peaks[1]:>13.1f} " + " ".join(f"{x:>10.0f}" for x in times), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default="2,3")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--deepspeed-venv", default=None, help="DeepSpeed's venv: its rows too (torch's and its own "
                   "reentrant checkpoint, non-reentrant)")
    args = p.parse_args()
    print(f"load before: {os.getloadavg()}")
    print(f"{'ZeRO':>4} {'system, checkpoint':<28} " + " ".join(f"{'step ' + str(i) + ' peak MB':>15}" for i in range(args.steps))
          + f" {'step 0 - 1 MB':>13} " + " ".join(f"{'step ' + str(i) + ' ms':>10}" for i in range(args.steps)))
    for stage in [int(s) for s in args.stages.split(",")]:
        for flavour in FLAVOURS:
            ranks = run_distributed(_run, world_size=2, args=(stage, flavour, args.steps), timeout=1800)
            _print_row(stage, f"dstrain, {flavour}", [[max(r[i][k] for r in ranks) for k in (0, 1)]
                                                      for i in range(args.steps)])
        for flavour in ("torch-reentrant", "deepspeed-reentrant", "non-reentrant") if args.deepspeed_venv else ():
            rows = _deepspeed(args.deepspeed_venv, stage, flavour, args.steps)
            if isinstance(rows, str):
                print(f"{stage:>4} {'deepspeed, ' + flavour:<28} {rows}", flush=True)
            else:
                _print_row(stage, f"deepspeed, {flavour}", rows)
    print(f"load after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
