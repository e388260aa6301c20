"""Moving tensors out of accelerator memory (ZeRO-Offload / ZeRO-Infinity): async file I/O, aligned
and pinned buffer pools, optimizer-state and parameter swappers.

Not built yet: `zero_optimization.offload_optimizer` / `offload_param` with a device other than
"none", and a non-default `aio` section, are rejected by the config (schemas/unbuilt.py) until they land.
"""
