"""The peak a device can reach, the denominator of MFU: the config's `mfu.peak_tflops`, else a table
of dense bf16 tensor-core peaks for known GPUs (vendor datasheets, without sparsity), else, on a CPU,
a matmul measured once with this process's thread count and cached under ~/.cache/dstrain."""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

# Dense bf16 TFLOPS per device (no 2:4 sparsity), matched against torch.cuda.get_device_name().
# Longer keys first: "H100 PCIe" must win over "H100".
GPU_PEAK_TFLOPS: dict[str, float] = {
    "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.4, "H200": 989.4, "H800": 989.4, "GH200": 989.4,
    "B200": 2250.0, "B100": 1750.0, "A100": 312.0, "A800": 312.0, "A10G": 70.0, "A10": 125.0,
    "L40S": 362.1, "L40": 181.0, "L4": 121.0, "A6000": 154.8, "RTX 4090": 165.2, "V100": 125.0,  # V100: fp16
    "MI300X": 1307.4, "MI250X": 383.0,
}

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dstrain" / "cpu_peak_flops.json"


def gpu_peak_tflops(name: str) -> float | None:
    for key in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True):
        if key.lower() in name.lower():
            return GPU_PEAK_TFLOPS[key]
    return None


def measure_cpu_matmul_flops(n: int = 512, repeats: int = 5) -> float:
    """Best of `repeats` fp32 n×n matmuls with the current thread count, in FLOP/s (2n³ per matmul)."""
    a = torch.randn(n, n, device="cpu")
    b = torch.randn(n, n, device="cpu")
    torch.mm(a, b)  # first call pays for thread-pool start-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def cpu_peak_flops(cache: Path = CACHE) -> float:
    """The measured CPU matmul peak for this machine and thread count, measured once and cached."""
    key = f"{platform.node()}|{platform.processor() or platform.machine()}|threads={torch.get_num_threads()}"
    try:
        table = json.loads(cache.read_text())
    except (OSError, ValueError):
        table = {}
    if key not in table:
        table[key] = measure_cpu_matmul_flops()
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(table, indent=1))
        except OSError:
            pass  # a read-only home: measure again next time
    return float(table[key])


def peak_flops_per_device(device: torch.device, configured_tflops: float | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, where the figure came from); (None, why) for an unknown GPU."""
    if configured_tflops:
        return configured_tflops * 1e12, "mfu.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name)
        if peak is None:
            return None, f"{name} is not in the peak table; set mfu.peak_tflops"
        return peak * 1e12, f"bf16 dense peak of {name}"
    if device.type == "cpu":
        return cpu_peak_flops(), f"fp32 matmul measured on this CPU with {torch.get_num_threads()} thread(s)"
    return None, f"no peak known for {device.type}; set mfu.peak_tflops"
