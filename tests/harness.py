"""Run a function on N spawned ranks over gloo, with a hard timeout, and collect what each returns.

    results = run_distributed(fn, world_size=2, args=(...), timeout=60)

`fn` must be importable (defined at module level). Each rank gets RANK/WORLD_SIZE/LOCAL_RANK/
MASTER_ADDR/MASTER_PORT as dslaunch would set them, one intra-op thread (2 cores are shared by all
ranks), and an initialised default process group. If a rank raises, the others are killed and its
traceback is re-raised here; if the whole thing exceeds `timeout`, every rank is killed and the test
fails with the ranks that had not finished — a hang costs seconds, not the 30-minute NCCL default.
"""
from __future__ import annotations

import faulthandler
import os
import pickle
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world_size, port, outdir, args, kwargs, env):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "DSTRAIN_TIMEOUT": "60", **env})
    out = Path(outdir)
    faulthandler.enable(all_threads=True)  # a C++ abort (SIGABRT/SIGSEGV) prints every thread's Python stack
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        from engine.dist import init_distributed
        init_distributed(dist_backend="gloo")
        result = fn(*args, **kwargs)
        (out / f"{rank}.pkl").write_bytes(pickle.dumps(result))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        (out / f"{rank}.err").write_text(traceback.format_exc())
        os._exit(1)


def run_distributed(fn, world_size: int, args: tuple = (), kwargs: dict | None = None,
                    timeout: float = 90.0, env: dict | None = None) -> list:
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as outdir:
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, outdir, args, kwargs or {}, env or {}),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in procs):
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:
                    raise RankFailed(_failure_text(outdir, failed, procs))
                if time.monotonic() > deadline:
                    stuck = [r for r, p in enumerate(procs) if p.is_alive()]
                    raise RankFailed(f"timeout after {timeout:.0f}s; ranks still running: {stuck}\n"
                                     + _failure_text(outdir, range(world_size), procs))
                time.sleep(0.05)
            failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
            if failed:
                raise RankFailed(_failure_text(outdir, failed, procs))
            return [pickle.loads((Path(outdir) / f"{r}.pkl").read_bytes()) for r in range(world_size)]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)


def _failure_text(outdir, ranks, procs) -> str:
    parts = []
    for r in ranks:
        err = Path(outdir) / f"{r}.err"
        if err.exists():
            parts.append(f"--- rank {r} ---\n{err.read_text()}")
        elif procs[r].exitcode not in (None, 0):
            when = ("after its function returned (teardown)" if (Path(outdir) / f"{r}.pkl").exists()
                    else "inside its function")
            parts.append(f"--- rank {r} exited with {procs[r].exitcode}, {when} ---")
    return "\n".join(parts) or "(no rank reported an error)"
