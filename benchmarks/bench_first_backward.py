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
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.peak_rss import peak_mb, restart_peak  # noqa: E402
from tests.harness import run_distributed  # noqa: E402

FLAVOURS = ("torch-reentrant", "dstrain-reentrant", "non-reentrant")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _model(flavour: str):
    import torch
    import torch.nn.functional as F

    from engine.activation_checkpointing import checkpoint
    from examples.gpt import BENCH_CONFIG, GPT

    class Checkpointed(GPT):
        def forward(self, idx, targets):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                if flavour == "dstrain-reentrant":
                    x = checkpoint(block, x)
                else:
                    x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=flavour == "torch-reentrant")
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
    torch.manual_seed(0)
    return Checkpointed(BENCH_CONFIG), BENCH_CONFIG


def _run(stage: int, flavour: str, steps: int) -> list[tuple[float, float]]:
    """(peak RSS MB above the step's start, ms) per step, in fresh processes: a heap that an earlier
    run freed would hide part of a later run's peak."""
    import torch

    import engine
    from examples.gpt import RandomTokens
    model, cfg = _model(flavour)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": stage}}
    eng, *_ = engine.initialize(model=model, config=config)
    data = RandomTokens(8 * steps, cfg.seq_len, cfg.vocab_size, seed=torch.distributed.get_rank())
    rows = []
    for i in range(steps):
        x, y = (torch.stack(t) for t in zip(*(data[8 * i + j] for j in range(8))))
        restart_peak()
        before, t0 = _rss_mb(), time.perf_counter()
        eng.backward(eng(x, y))
        eng.step()
        rows.append((peak_mb() - before, (time.perf_counter() - t0) * 1e3))
    eng.destroy()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default="2,3")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    print(f"load before: {os.getloadavg()}")
    print(f"{'ZeRO':>4} {'checkpoint':<18} " + " ".join(f"{'step ' + str(i) + ' peak MB':>15}" for i in range(args.steps))
          + f" {'step 0 - 1 MB':>13} " + " ".join(f"{'step ' + str(i) + ' ms':>10}" for i in range(args.steps)))
    for stage in [int(s) for s in args.stages.split(",")]:
        for flavour in FLAVOURS:
            ranks = run_distributed(_run, world_size=2, args=(stage, flavour, args.steps), timeout=1800)
            peaks = [max(r[i][0] for r in ranks) for i in range(args.steps)]
            times = [max(r[i][1] for r in ranks) for i in range(args.steps)]
            print(f"{stage:>4} {flavour:<18} " + " ".join(f"{x:>15.1f}" for x in peaks)
                  + f" {peaks[0] - peaks[1]:>13.1f} " + " ".join(f"{x:>10.0f}" for x in times), flush=True)
    print(f"load after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
