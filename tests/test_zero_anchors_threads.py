"""The reentrant-region wrapper (engine/zero/anchors.py, note: reentrant regions) is a class attribute of
torch's CheckpointFunction, seen by every thread: a region another thread runs while a training forward
is open (another model trained there) is not anchored in that forward's pass. Before, it was: that pass's
backward then ran the other thread's graph (a second backward through it, or its units' recompute).
Single process: only BackwardAnchors and torch's checkpoint, no engine."""
from __future__ import annotations

import threading

import torch

from engine.zero.anchors import BackwardAnchors


def _region(lin: torch.nn.Linear) -> torch.Tensor:
    x = torch.randn(2, 4, requires_grad=True)
    return torch.utils.checkpoint.checkpoint(lin, x, use_reentrant=True)


def test_a_region_of_another_thread_is_not_anchored():
    lin = torch.nn.Linear(4, 4)
    anchors = BackwardAnchors()
    anchors.open()
    try:
        worker = threading.Thread(target=_region, args=(lin,))
        worker.start()
        worker.join()
        other_thread = len(anchors.edges)
        _region(lin)
        own_thread = len(anchors.edges)
    finally:
        anchors.close()
    assert (other_thread, own_thread) == (0, 1)
    assert "apply" not in torch.utils.checkpoint.CheckpointFunction.__dict__
