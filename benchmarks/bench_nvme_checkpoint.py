"""Checkpoint save and load with NVMe optimizer offload (streamed) against the same model without offload.

    python benchmarks/bench_nvme_checkpoint.py [--width 2048] [--dir /tmp/dstrain-bench] [--repeats 2]

One process (world 1), ZeRO-2, AdamW, a `--width`² linear layer trained one step. For each of "none"
(state in memory) and "nvme" (state in swap files under `--dir`, sub-groups of `--sub-group`
elements): the time of `save_checkpoint` and of `load_checkpoint` into a fresh engine, and the peak
RSS growth during each (VmHWM reset via /proc/self/clear_refs), with the rank file's size. And
"nvme-async" (`checkpoint.async_save`: the swap files are copied, engine/checkpoint/nvme.py's note):
`save_s` is the training thread's time inside `save_checkpoint` (the file copies), `commit_s` the time
until the background writer committed, the peak over both. Best of
`--repeats` for times (other load only ever adds time), the last run's peaks. DeepSpeed has no peer
figure here: it documents NVMe offload for ZeRO-3 only. Prints one JSON object; record `uptime`
before and after (the machine may be shared).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402
import torch  # noqa: E402

import engine  # noqa: E402


def _model(width: int) -> torch.nn.Module:
    return torch.nn.Linear(width, width, bias=False, device="cpu")


def _config(offload: str, swap: str, sub_group: int) -> dict:
    zero: dict = {"stage": 2}
    if offload.startswith("nvme"):
        zero.update(sub_group_size=sub_group, offload_optimizer={"device": "nvme", "nvme_path": swap})
    return {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero,
            "checkpoint": {"async_save": offload.endswith("async")}}


def _save(eng, ckpt: str, times: dict) -> None:
    start = time.perf_counter()
    eng.save_checkpoint(ckpt, tag="t")
    times["save_s"] = time.perf_counter() - start
    eng.wait_for_checkpoint()  # the async save's writer; nothing for a synchronous one


def _peak_growth(fn) -> tuple[int, float]:
    """(peak RSS growth during fn in bytes, its wall seconds)."""
    base = psutil.Process().memory_info().rss
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return peak - base, seconds


def measure(offload: str, width: int, root: str, sub_group: int) -> dict:
    ckpt = tempfile.mkdtemp(dir=root)
    torch.manual_seed(0)
    eng, _, _, _ = engine.initialize(model=_model(width), config=_config(offload, root, sub_group))
    x = torch.randn(2, width, device="cpu")
    eng.backward(eng(x).square().mean())
    eng.step()
    times: dict = {}
    save_peak, commit_s = _peak_growth(lambda: _save(eng, ckpt, times))
    eng.destroy()
    torch.manual_seed(1)
    fresh, _, _, _ = engine.initialize(model=_model(width), config=_config(offload, root, sub_group))
    load_peak, load_s = _peak_growth(lambda: fresh.load_checkpoint(ckpt, tag="t"))
    fresh.destroy()
    size = os.path.getsize(os.path.join(ckpt, "t", "rank_00000.pt"))
    return {"save_s": times["save_s"], "commit_s": commit_s, "load_s": load_s, "save_peak_mib": save_peak / 2**20,
            "load_peak_mib": load_peak / 2**20, "rank_file_mib": size / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--sub-group", type=int, default=1 << 20, help="zero_optimization.sub_group_size")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    out: dict = {"width": args.width, "params": args.width ** 2, "sub_group_size": args.sub_group}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for offload in ("none", "nvme", "nvme-async"):
            runs = [measure(offload, args.width, root, args.sub_group) for _ in range(args.repeats)]
            best = {k: min(r[k] for r in runs) for k in ("save_s", "commit_s", "load_s")}
            out[offload] = {**runs[-1], **best}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
