"""`ColumnParallelLinear.from_dense` / `RowParallelLinear.from_dense` of a dense layer built inside
engine.zero.Init (engine/tensor_parallel/layers.py `dense_features`): the layer's in/out features are the
dense layer's, read from the full shape, for an `nn.Linear` and HF's `Conv1D` (stored in × out). Between
uses an Init-partitioned weight is a placeholder of shape (0, *rest) (zero/stage3_params.py): read from it,
`out_features` was 0 (a Conv1D's `in_features`), silently, and the widths the regions check whole-width
parameters against (region_params.column_widths) held 0 instead of the projection's width."""
from __future__ import annotations

import torch
import torch.nn as nn

from tests.harness import run_distributed

CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def _features() -> dict:
    import engine
    from transformers.pytorch_utils import Conv1D
    from engine.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from engine.tensor_parallel.region_params import column_widths
    torch.manual_seed(0)
    out = {}
    with engine.zero.Init(config=CONFIG):
        dense = {"linear": (nn.Linear(8, 16), nn.Linear(16, 8)), "conv1d": (Conv1D(16, 8), Conv1D(8, 16))}
        for kind, (up, down) in dense.items():
            col, row = ColumnParallelLinear.from_dense(up), RowParallelLinear.from_dense(down)
            out[kind] = {"column": (col.in_features, col.out_features), "row": (row.in_features, row.out_features),
                         "widths": sorted(column_widths([col]))}
    return out


def test_from_dense_of_a_layer_built_in_init_has_the_dense_features():
    for r in run_distributed(_features, 2, timeout=120):
        for kind in ("linear", "conv1d"):
            assert r[kind] == {"column": (8, 16), "row": (16, 8), "widths": [16]}, (kind, r[kind])
