"""Keys dstrain accepts without reading them, because its design already meets their DeepSpeed purpose.

Each is an internal layout or scheduling choice of DeepSpeed's with the same result in dstrain, for
either value (DeepSpeed's purpose and why it holds are in the field's docstring, and in the README).
A key that changes the math, the memory a run relies on, or behaviour a user sees never belongs here:
it is read by the runtime or rejected by `schemas/unbuilt.py`. `tests/test_config_coverage.py` checks
that every field of the schema is one of the three.
"""
from __future__ import annotations

BY_CONSTRUCTION: dict[str, str] = {
    "zero_optimization.contiguous_gradients": "stages 1-3 always reduce into contiguous flat partitions",
    "zero_optimization.round_robin_gradients": "orders CPU-offload gradient copies; dstrain's land in fixed bucket order",
    "zero_optimization.use_multi_rank_bucket_allreduce": "one collective per bucket for all ranks already",
    "zero_optimization.memory_efficient_linear": "stage 3 keeps no gathered weight alive between forward and backward",
    "zero_optimization.elastic_checkpoint": "every checkpoint loads at any world size and stage",
}
