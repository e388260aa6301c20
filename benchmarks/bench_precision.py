"""The cost of dstrain's overflow/NaN check next to DeepSpeed's per-tensor check, on the gradients of
the 25M-parameter benchmark GPT (fp16 and fp32).

    python benchmarks/bench_precision.py

dstrain reads one scalar — the global gradient norm over the flat gradient buffers, which clipping
needs anyway — so the check itself is free when clipping is on and one reduction per buffer when it
is off. DeepSpeed's `_has_inf_or_nan` calls `float(x.sum())` on every gradient: one host sync per
tensor (on a GPU each is a device→host round trip). Step-time figures for fp16/bf16 vs fp32 come from
`bench_training.py --systems dstrain-z0,dstrain-z0-fp16,dstrain-z0-bf16`.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.zero.stage0 import global_norm  # noqa: E402
from examples.gpt import BENCH_CONFIG, GPT  # noqa: E402


def _median_ms(fn, repeats: int = 15) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[2:])


def per_tensor_check(grads: list[torch.Tensor]) -> bool:
    """DeepSpeed's rule: any gradient whose float sum is inf or nan (one host sync each)."""
    for g in grads:
        s = float(g.float().sum())
        if s in (float("inf"), float("-inf")) or s != s:
            return True
    return False


def main() -> int:
    torch.set_num_threads(1)
    sizes = [p.numel() for p in GPT(BENCH_CONFIG).parameters()]
    print(f"{len(sizes)} gradient tensors, {sum(sizes) / 1e6:.2f}M elements, 1 thread\n")
    print("| dtype | dstrain: global norm of flat buffer (ms) | per-tensor float(sum) (ms) | host syncs (dstrain / per-tensor) |")
    print("|---|---|---|---|")
    for dtype in (torch.float32, torch.float16):
        flat = torch.randn(sum(sizes)).to(dtype)
        grads = list(flat.split(sizes))
        master = flat.float()  # dstrain checks the fp32 master gradients (unscaled) it steps on
        ours = _median_ms(lambda: float(global_norm([master])))
        theirs = _median_ms(lambda: per_tensor_check(grads))
        print(f"| {str(dtype).removeprefix('torch.')} | {ours:.2f} | {theirs:.2f} | 1 / {len(grads)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
