"""DeepSpeed's side of bench_first_backward.py, run inside DeepSpeed's own venv.

    VENV/bin/python benchmarks/deepspeed_first_backward_peer.py --stage 3 --flavour torch-reentrant --steps 3

The same 25M GPT with each block in a checkpoint region (benchmarks/checkpointed_gpt.py): torch's
reentrant or non-reentrant checkpoint, or DeepSpeed's own `deepspeed.checkpointing.checkpoint`; the
same AdamW, micro-batch 8, fp32, one thread per rank, gloo. Per step, the peak RSS above the RSS
before it (benchmarks/peak_rss.py) and the step time; prints one JSON line: per step, the larger of
the two ranks'.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.checkpointed_gpt import CheckpointedGPT, measured_steps, torch_region  # noqa: E402
from benchmarks.peer_ranks import spawn_ranks  # noqa: E402
from examples.gpt import BENCH_CONFIG  # noqa: E402


def _rank(rank: int, world: int, port: int, stage: int, flavour: str, steps: int, outdir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    region = deepspeed.checkpointing.checkpoint if flavour == "deepspeed-reentrant" else \
        torch_region(flavour == "torch-reentrant")
    torch.manual_seed(0)
    model = CheckpointedGPT(BENCH_CONFIG, region)
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rows = measured_steps(eng, BENCH_CONFIG, steps, rank)
    Path(outdir, f"{rank}.json").write_text(json.dumps(rows))
    deepspeed.comm.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--flavour", choices=("torch-reentrant", "deepspeed-reentrant", "non-reentrant"), required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args()
    ranks = spawn_ranks(_rank, args.world, args.stage, args.flavour, args.steps)
    print(json.dumps([[max(r[i][k] for r in ranks) for k in (0, 1)] for i in range(args.steps)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
