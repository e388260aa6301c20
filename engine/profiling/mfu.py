"""Model and hardware FLOPs utilisation.

MFU = model FLOPs per second / peak, where model FLOPs per step = 3 × forward FLOPs (a backward pass
costs two forwards: gradients for inputs and for weights) × samples; HFU adds the forward passes
activation recomputation repeats (`flops_profiler.recompute_fwd_factor`, DeepSpeed's key: 1.0 for
full recomputation). For a decoder-only transformer the model FLOPs per token are also known in closed
form (PaLM, appendix B): 6N + 12·L·H·Q·T, with N the matmul parameters, L layers, H heads, Q the head
size and T the sequence length; the counted figure must agree with it.
"""
from __future__ import annotations

from dataclasses import dataclass


def transformer_train_flops_per_token(n_params: int, n_layer: int, n_head: int, head_dim: int, seq_len: int) -> float:
    """6N + 12·L·H·Q·T: forward and backward FLOPs per token of a dense, non-causal-masked count."""
    return 6 * n_params + 12 * n_layer * n_head * head_dim * seq_len


@dataclass(frozen=True)
class Utilisation:
    tflops: float  # achieved model TFLOPS per device
    mfu: float | None  # fractions of the peak; None when no peak is known
    hfu: float | None


def utilisation(fwd_flops_per_sample: float, samples_per_s_per_device: float, peak_flops: float | None,
                recompute_fwd_factor: float = 0.0) -> Utilisation:
    model = 3 * fwd_flops_per_sample * samples_per_s_per_device
    hardware = (3 + recompute_fwd_factor) * fwd_flops_per_sample * samples_per_s_per_device
    if not peak_flops:
        return Utilisation(model / 1e12, None, None)
    return Utilisation(model / 1e12, model / peak_flops, hardware / peak_flops)
