"""A dstrain job that checkpoints every 2 steps, resumes by itself (`auto_resume`), and on its first
attempt kills one of its ranks with SIGKILL at --crash_at. Rank 0 writes the final loss and a digest
of the parameters to --out, so a test can compare it with an uninterrupted run."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import engine  # noqa: E402
from tests.models import OddMLP, make_batches, micro_batches  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--crash_at", type=int, default=0, help="0: never")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 1},
              "checkpoint": {"save_dir": args.ckpt, "save_interval": 2, "auto_resume": True}}
    eng, _, _, _ = engine.initialize(model=OddMLP(), config=config)
    rank, world = eng.comm.rank, eng.comm.world_size
    batches = make_batches(args.steps, 2 * world)  # step k always trains on batch k, resumed or not
    first_attempt = os.environ.get("DSTRAIN_RESTART_COUNT", "0") == "0"
    loss = None
    while eng.global_steps < args.steps:
        if args.crash_at and first_attempt and eng.global_steps == args.crash_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = next(micro_batches(*batches[eng.global_steps], rank, world, 1))
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
    if rank == 0:
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in eng.module.parameters()))
        with open(args.out, "w") as f:
            json.dump({"loss": loss.item(), "params": digest.hexdigest(),
                       "restarts": os.environ.get("DSTRAIN_RESTART_COUNT", "0")}, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
