"""FLOPs profiler and model FLOPs utilisation (DeepSpeed's `flops_profiler`, counted at the dispatcher).

FLOPs are counted with `torch.utils.flop_counter.FlopCounterMode`, which sees every aten op that runs:
`@` matmuls, `F.scaled_dot_product_attention` and third-party modules count, where DeepSpeed's
patched `torch.nn.functional` misses them. Only matmul-like ops (mm, bmm, addmm, conv, SDPA) carry
FLOPs in torch's registry; element-wise ops count as zero, as in Megatron's and PaLM's MFU.

- `get_model_profile(model, input_shape=..., args=..., kwargs=...)`: DeepSpeed's function, signature and
  return values (flops, macs, params).
- `ModuleProfile`: per-module parameters, FLOPs and forward latency of one forward pass.
- `mfu`: MFU/HFU arithmetic, the analytic transformer count, device peaks.
"""
from __future__ import annotations

from .model_profile import get_model_profile
from .module_profile import ModuleProfile
from .peaks import peak_flops_per_device

__all__ = ["get_model_profile", "ModuleProfile", "peak_flops_per_device"]
