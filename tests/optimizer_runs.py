"""The multi-process runs behind tests/test_optimizer_set.py, tests/test_optimizer_checkpoint.py, the
ZeRO case of tests/test_optimizers.py, tests/test_mup_optimizers.py and the engine case of tests/test_state_layout.py: one spawn per world size, made on first use and shared by
whichever of those files runs (spawning and importing on every rank, not training their tiny models,
was most of their time: ~40 s per spawn on the shared 2-core machine against ~0.4 s per training).

Each part of a rank's work is recorded separately, so a failure in one (a checkpoint load, say) fails
the tests that read it, with its traceback, and not the others. World 2 runs first: it saves the
checkpoints that worlds 1 and 4 load. Offload runs with DSTRAIN_OFFLOAD_STAGE_COPIES=1, so the
accelerator's copy path (engine/zero/tier.py) runs on CPU-only machines.
"""
from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
import traceback

import torch

from tests.harness import run_distributed

ENV = {"DSTRAIN_OFFLOAD_STAGE_COPIES": "1"}


def record(out: dict, name, fn, *args) -> None:
    """out[name] = fn(*args), or the failure's traceback, re-raised in the test that reads it."""
    try:
        out[name] = fn(*args)
    except Exception:
        out[name] = PartFailed(traceback.format_exc())


class PartFailed:
    def __init__(self, text: str):
        self.text = text


class Results(dict):
    """A dict of recorded results whose failed entries raise, with their traceback, where a test reads them."""

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if isinstance(value, PartFailed):
            raise AssertionError(f"{key} failed on rank 0:\n{value.text}")
        return value


def _work(root: str) -> dict:
    from tests import test_optimizer_checkpoint as ckpt, test_optimizer_set as opt_set, test_optimizers as optimizers
    from tests import test_mup_optimizers as mup_set, test_state_layout as layout
    world, out = torch.distributed.get_world_size(), {}
    nvme_path = os.path.join(root, "nvme")
    if world in opt_set.CASES:
        record(out, "set", opt_set._runs, opt_set.CASES[world], nvme_path)
    if world == 2:
        record(out, "uncorrected_zero2", optimizers._train_uncorrected_zero2)
        record(out, "layout_refusals", layout._refusals)
        record(out, "mup", mup_set._runs, nvme_path)
        record(out, "saved", ckpt._save_all, root)
    record(out, "loaded", ckpt._load_all, root)
    return out


@functools.cache
def _root() -> str:
    root = tempfile.mkdtemp(prefix="dstrain-optimizer-runs-")
    atexit.register(shutil.rmtree, root, True)
    os.makedirs(os.path.join(root, "nvme"))
    return root


@functools.cache
def on_ranks(world: int) -> list[dict]:
    if world != 2:
        on_ranks(2)  # saves the checkpoints this world loads
    return run_distributed(_work, world, args=(_root(),), timeout=600, env=ENV)


def part(world: int, name: str) -> list:
    """Every rank's result of part `name` of the `world`-rank run; a failed part raises its traceback."""
    results = [rank[name] for rank in on_ranks(world)]
    for rank, result in enumerate(results):
        if isinstance(result, PartFailed):
            raise AssertionError(f"rank {rank} failed in {name!r}:\n{result.text}")
    return results
