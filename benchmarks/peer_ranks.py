"""How DeepSpeed's peers (benchmarks/deepspeed_*_peer.py, run in DeepSpeed's own venv) start their ranks:
a free loopback port, one process per rank by torch.multiprocessing, and each rank's result as the JSON
file `<rank>.json` it writes into a temporary directory. Standard library and torch only."""
from __future__ import annotations

import json
import socket
import tempfile
from pathlib import Path

import torch.multiprocessing as mp


def spawn_ranks(target, world: int, *args) -> list:
    """`target(rank, world, port, *args, outdir)` on `world` processes; what each rank wrote, in rank order."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(target, args=(world, port, *args, outdir), nprocs=world)
        return [json.loads(Path(outdir, f"{r}.json").read_text()) for r in range(world)]
