"""Run a function on N spawned ranks over gloo, with a hard timeout, and collect what each returns.

    results = run_distributed(fn, world_size=2, args=(...), timeout=60)

`fn` must be importable (defined at module level). Each rank gets RANK/WORLD_SIZE/LOCAL_RANK/
MASTER_ADDR/MASTER_PORT as dslaunch would set them, one intra-op thread (2 cores are shared by all
ranks), and an initialised default process group. If a rank raises, the others are killed and its
traceback is re-raised here; if the whole thing exceeds `timeout`, every rank is killed and the test
fails with the ranks that had not finished — a hang costs seconds, not the 30-minute NCCL default.

Ranks start from a forkserver that imported torch and the engine once, not by spawn: a spawned rank
spends about 2 s of CPU importing torch, and the suite starts hundreds of ranks on 2 cores. The
forkserver runs no torch op, so no intra-op thread exists to be lost in the fork; each rank is still a
fresh process. Because a forkserver child inherits the forkserver's environment and directory, not
the test's, each rank is given the test's current `os.environ`, working directory and standard output
and error (duplicated file descriptors: what pytest's capture sees, as with spawned ranks) explicitly.
The ranks meet through a file store in the run's own directory, not a TCP port: a free port found by
binding port 0 can be taken by another process before rank 0 listens on it (it happened with several
test runs on one machine: EADDRINUSE), and a rank that connected to someone else's store would join the
wrong job. MASTER_ADDR/MASTER_PORT are still set, as dslaunch sets them, for code that reads them.
DSTRAIN_TEST_START=spawn restores spawned ranks (to rule the forkserver out when chasing a failure).
"""
from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import sys
import tempfile
import time
import traceback
from multiprocessing import reduction
from pathlib import Path

import torch.multiprocessing as mp

from tests.launcher_scripts.harness import free_port, release_port  # the tests' one port chooser, imported from here too


class RankFailed(RuntimeError):
    pass


class _Fd:
    """A file descriptor of the test process handed to a rank: duplicated into the child when the
    process object is pickled at start (multiprocessing's own fd passing, forkserver or spawn)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _Fd._detach, (reduction.DupFd(self.fd),)

    @staticmethod
    def _detach(dup) -> int:
        return dup.detach()


# What (almost) every rank imports, so that it is imported once per test session, not once per rank:
# torch.optim's first Optimizer() imports torch._dynamo (and with it sympy), about 1.5 s of CPU per rank
# on an idle machine and 4-14 s on a loaded one; engine.build pulls in ZeRO, checkpoints and monitors;
# unpickling a test's function imports its module and so pytest. None of these imports starts a thread
# or runs a torch op (checked: the forkserver keeps its thread count).
_PRELOAD = ["torch", "torch.distributed", "torch.optim", "torch._dynamo", "torch.profiler", "engine", "engine.dist",
            "engine.build", "engine.pipe", "engine.checkpointing", "engine.monitors", "engine.teardown", "pytest"]
# transformers' model machinery (its notes), for the test suite's ranks only: the benchmarks that start
# their ranks here (benchmarks/suite.py, gpu/run.py) run no Hugging Face model and report each rank's RSS
_TEST_PRELOAD = ["tests.rank_preload"]


def _context():
    if os.environ.get("DSTRAIN_TEST_START", "forkserver") == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD + (_TEST_PRELOAD if "_pytest" in sys.modules else []))
    return ctx


def _rank_main(call, rank, world_size, port, outdir, env, parent_env, cwd, stdout, stderr):
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(parent_env)
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
        init_distributed(dist_backend="gloo", init_method=f"file://{out / 'rendezvous'}")
        fn, args, kwargs = pickle.loads(call)
        # What the forkserver preloaded and unpickling imported (~310k objects: torch, the engine, the
        # test's module) lives to the rank's end: frozen out of the collector's sight, each gc.collect()
        # (engine.destroy() makes one) and automatic full collection walks only what `fn` made: 0.15 s of
        # CPU per collect -> 30 us, measured at load 8 (tests/offload_runs.py did it for its 100 runs).
        gc.freeze()
        result = fn(*args, **kwargs)
        (out / f"{rank}.pkl").write_bytes(pickle.dumps(result))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        (out / f"{rank}.err").write_text(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def run_distributed(fn, world_size: int, args: tuple = (), kwargs: dict | None = None,
                    timeout: float = 90.0, env: dict | None = None) -> list:
    ctx = _context()
    # The ranks meet through a file store, but a rank that re-initialises from the environment binds
    # MASTER_PORT (test_initialize_arguments): held for the run, as the launcher tests hold theirs.
    port = free_port()
    # Plain pickle, by value: multiprocessing's own pickler would share tensors as file descriptors, and
    # the forkserver refuses more than a few hundred of them.
    call = pickle.dumps((fn, args, kwargs or {}))
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryDirectory() as outdir:
        procs = [ctx.Process(target=_rank_main, args=(call, r, world_size, port, outdir, env or {}, dict(os.environ),
                                                      os.getcwd(), _Fd(1), _Fd(2)),
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
            release_port(port)


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
