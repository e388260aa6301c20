"""The end of a training process (engine/teardown.py's note): gloo's worker threads are idle before the
interpreter finalizes, and `Engine.destroy()` releases what the engine created."""
from __future__ import annotations

import atexit

import torch

import engine
from engine import teardown
from tests.harness import run_distributed
from tests.models import OddMLP, make_batches, micro_batches


def _train_then_destroy(tmp: str) -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3}, "checkpoint": {"async_save": True}}
    eng, _, _, _ = engine.initialize(model=OddMLP(), config=cfg)
    for x, y in make_batches(2, 2 * world):
        xm, ym = next(micro_batches(x, y, rank, world, 1))
        eng.backward(eng(xm, ym))
        eng.step()
    eng.save_checkpoint(tmp)  # async: the checkpoint group exists and a save may be in flight
    workers_before = len(teardown._gloo_workers())
    eng.destroy()
    idle = all(teardown._idle(t) for t in teardown._gloo_workers())
    hooks_left = sum(len(p._post_accumulate_grad_hooks or {}) for p in eng.module.parameters())
    return {"before": workers_before, "after": len(teardown._gloo_workers()), "idle": idle,
            "hooks_left": hooks_left, "committed": (__import__("pathlib").Path(tmp) / "latest").exists()}


def test_destroy_waits_for_the_save_releases_groups_and_hooks(tmp_path):
    for r in run_distributed(_train_then_destroy, 2, args=(str(tmp_path),), timeout=120):
        assert r["committed"], "destroy() returned before the async save was committed"
        assert r["hooks_left"] == 0
        assert r["idle"], "a gloo worker was still busy after destroy()"
        # three groups (default, stage 3's gathers, checkpoints) have two workers each; the engine's own
        # two are gone
        assert r["before"] == 6 and r["after"] == 2, r


def _collectives_then_release() -> bool:
    t = torch.ones(1 << 16)
    works = [torch.distributed.all_reduce(t, async_op=True) for _ in range(8)]
    for w in works:
        w.wait()
    del works, t
    return teardown.release_collective_threads(timeout=5.0)


def test_release_collective_threads_sees_idle_workers():
    assert run_distributed(_collectives_then_release, 2, timeout=60) == [True, True]


def test_init_distributed_registers_the_release_at_exit(monkeypatch):
    from engine import dist as edist
    registered = []
    monkeypatch.setattr(edist, "_AT_EXIT", [])
    monkeypatch.setattr(atexit, "register", registered.append)
    edist._release_threads_at_exit()
    edist._release_threads_at_exit()
    assert registered == [teardown.release_collective_threads]
