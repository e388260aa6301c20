"""The NVMe parameter store failing while it writes the partition to its swap files (here: a 1 MiB
tmpfs fills up, engine/zero/param_nvme.py's attach_param_nvme) leaves nothing of its I/O engine behind:
its worker threads and its swap files' descriptors go with the swap directory. Before, the engine was
never closed, so every failed `initialize` in a process (a notebook retrying configs) kept both."""
from __future__ import annotations

import os

import torch

from tests.harness import run_distributed
from tests.test_offload_io import tmpfs


def _failed_initialize(nvme_path: str) -> dict:
    import threading
    import engine
    model = torch.nn.Sequential(torch.nn.Linear(768, 768), torch.nn.Linear(768, 8))  # 2.3 MiB > the 1 MiB disk
    try:
        engine.initialize(model=model, config={
            "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme_path}}})
        error = None
    except Exception as err:  # noqa: BLE001 - what the test asserts
        error = f"{type(err).__name__}: {err}"
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:  # the listing's own descriptor, closed by now
            pass
    return {"error": error, "aio_threads": [t.name for t in threading.enumerate() if t.name.startswith("dstrain-aio")],
            "swap_fds": [path for path in fds if path.startswith(nvme_path)]}


def test_a_failed_parameter_store_leaves_no_threads_or_open_swap_files(tmp_path):
    with tmpfs(tmp_path / "small", "size=1m") as small:
        out, = run_distributed(_failed_initialize, 1, args=(str(small),), timeout=120)
    assert out["error"] is not None and "No space left on device" in out["error"], out
    assert out["aio_threads"] == [], out
    assert out["swap_fds"] == [], out
