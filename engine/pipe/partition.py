"""Which layers each pipeline stage holds: a contiguous split of the layer list into parts of
balanced weight (DeepSpeed's `partition_method`).

- `"uniform"`: every layer weighs 1 (equal layer counts);
- `"parameters"`: a layer weighs its trainable parameter count (DeepSpeed's default);
- `"type:REGEX"`: a layer weighs 1 when its class name matches REGEX (case-insensitive), else 0,
  e.g. `"type:transformer"` spreads the transformer blocks evenly whatever sits between them.

The split minimises the heaviest part (binary search on the capacity, greedy fill), every part
getting at least one layer, so the slowest stage — which sets the pipeline's pace — is as light as
a contiguous split allows.
"""
from __future__ import annotations

import re


def layer_weights(layers: list, method: str, count_params) -> list[int]:
    """The weight of every layer for `method`; `count_params(i)` counts layer i's trainable parameters."""
    if method == "uniform":
        return [1] * len(layers)
    if method == "parameters":
        return [count_params(i) for i in range(len(layers))]
    if method.startswith("type:"):
        pattern = re.compile(method[len("type:"):], re.IGNORECASE)
        return [1 if pattern.search(_type_name(layer)) else 0 for layer in layers]
    raise ValueError(f"partition_method={method!r}: use 'parameters', 'uniform' or 'type:REGEX'")


def _type_name(layer) -> str:
    typename = getattr(layer, "typename", None)  # a LayerSpec names the class it will build
    if typename is not None:
        return typename.__name__
    return type(layer).__name__ if not callable(layer) or hasattr(layer, "parameters") else getattr(
        layer, "__name__", type(layer).__name__)


def balanced_bounds(weights: list[int], parts: int) -> list[int]:
    """Boundaries b[0]=0 < b[1] < ... < b[parts]=len(weights): part k is layers b[k]:b[k+1]."""
    n = len(weights)
    if parts > n:
        raise ValueError(f"{n} layers cannot fill {parts} pipeline stages: give at least one layer per stage")

    def split(capacity: int) -> list[int] | None:
        bounds, load = [0], 0
        for i, w in enumerate(weights):
            remaining_parts = parts - len(bounds)
            must_cut = n - i == remaining_parts  # each remaining part needs a layer
            if i > bounds[-1] and (load + w > capacity or must_cut) and remaining_parts > 0:
                bounds.append(i)
                load = 0
            load += w
            if load > capacity:
                return None
        bounds.append(n)
        return bounds if len(bounds) == parts + 1 else None

    lo, hi = max(weights, default=0), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        if split(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    found = split(lo)
    if found is None:  # all-zero weights or too few cuts taken: fall back to equal counts
        found = [round(k * n / parts) for k in range(parts + 1)]
    return found
