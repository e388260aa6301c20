"""Tensor-parallel shards in checkpoints: how a sharded parameter is recorded and put back together.

[Note: tensor-parallel shards] A parameter that engine/tensor_parallel/layers.py split over the model
axis (`tensor_parallel_dim` set: column-parallel and vocab-parallel dim 0, row-parallel dim 1, fused
q|k|v `tensor_parallel_parts` sections) is recorded in metadata.json with its *full* shape and
`"tensor_parallel": {"dim", "parts", "degree"}`; each of its fragments is `[rank, start, stop, index]`:
rows [start, stop) of dim 0 of shard `index` (the saving rank's model coordinate), cut by the data
rank as the ZeRO partition cuts any parameter. Elementwise optimizer state is sharded exactly as its
parameter (same rows of the same shard); scalar state is repeated per fragment and loaded once.
A replicated parameter (layer norms, a row-parallel bias, embeddings AutoTP leaves whole) is identical
on the ranks of a model group (tensor_parallel/grads.py's note), so only model coordinate 0 writes it,
as a plain entry. A frozen shard (`requires_grad=False`: no optimizer state) is recorded like a
sharded parameter with kind `module` only, each model coordinate writing its own (snapshot.py).
The format does not depend on the ZeRO stage: any stage whose adapter gives rows of
the local shard (state.py) records shards the same way.
[Note: resharding across degrees] A reader asks for the full tensor (`FragmentSource.full`: every
shard's rows joined, then the shards joined along `dim`, section by section), and a loading rank with
tensor parallelism cuts its own shard of it (`LocalShards`) with the layers' own `shard`, so a
checkpoint saved at degree T loads at any degree that divides the dimension, including 1 (a dense
model). The full tensor of one parameter and kind at a time is built on each loading rank: transient
memory of the largest parameter, not of the model.
[Note: HF Conv1D] GPT-2's `Conv1D` stores its weight (in, out); its shards are kept (out, in) like
any other (layers.py) and carry `tensor_parallel_transposed`. The checkpoint records such a weight in
the dense model's orientation, so that every layout agrees on it: the full shape is (in, out), the
layout says `"transposed": true`, the fragments are still rows of the (out, in) shards, and the
reader transposes what it joined. A dense `Conv1D` then loads `full` as it is, consolidate writes
the dense model's state dict, and a rank with shards transposes `full` back before cutting its own.
A checkpoint of a Conv1D shard written before the flag existed records (out, in): it still loads
into shards, and is refused by name for a dense `Conv1D` (the orientation cannot be told apart for a
square weight).
"""
from __future__ import annotations

import torch

from ..tensor_parallel.layers import is_conv1d, is_partitioned, join, shard
from .format import CheckpointError
from .state import rows_of

KEY = "tensor_parallel"


def _transposed(p: torch.Tensor) -> bool:
    return bool(getattr(p, "tensor_parallel_transposed", False))


def shard_entry(p: torch.Tensor, degree: int) -> dict | None:
    """The metadata of a sharded parameter's layout (module note), None for a replicated one."""
    if not is_partitioned(p):
        return None
    parts = p.tensor_parallel_parts  # a count of equal sections, or their sizes (layers.py's fused note)
    entry = {"dim": int(p.tensor_parallel_dim), "parts": int(parts) if isinstance(parts, int) else
             [int(s) for s in parts], "degree": int(degree)}
    if _transposed(p):
        entry["transposed"] = True  # module note: HF Conv1D
    return entry


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The dense shape a parameter has in the checkpoint: the whole matrix for a shard, in the dense
    model's orientation (module note: HF Conv1D)."""
    if not is_partitioned(p):
        return tuple(p.shape)
    shape = tuple(p.tensor_parallel_full_shape)
    return shape[::-1] if _transposed(p) else shape


def _saved_in_dense_orientation(entry: dict) -> bool:
    """Whether a checkpoint entry's full tensor is the dense model's own: a dense entry, or a shard
    recorded with `transposed` (module note: HF Conv1D); False for an unflagged shard, kept (out, in)."""
    return KEY not in entry or bool(entry[KEY].get("transposed"))


def expected_shape(p: torch.Tensor, entry: dict) -> tuple[int, ...]:
    """The full shape the checkpoint `entry` must have to load into the shard `p`."""
    shape = full_shape(p)
    return shape if not _transposed(p) or _saved_in_dense_orientation(entry) else shape[::-1]


def local_shape(shape: list[int], layout: dict) -> list[int]:
    """The (out, in) shape of one shard of a full tensor recorded as `shape` with `layout`."""
    out = list(shape[::-1]) if layout.get("transposed") else list(shape)
    out[layout["dim"]] //= layout["degree"]
    return out


def join_shards(shards: list[torch.Tensor], layout: dict) -> torch.Tensor:
    """The full tensor from every shard in index order, in the recorded orientation: the inverse of
    `layers.shard` (each shard holds its slice of each of the `parts` fused sections, so the sections
    are joined one by one), transposed back for a Conv1D weight (module note)."""
    full = join(shards, layout["dim"], layout["parts"])
    return full.t().contiguous() if layout.get("transposed") else full


def live_layouts(module: torch.nn.Module, model_rank: int, degree: int) -> dict[str, tuple]:
    """name -> (dim, parts, index, degree, transposed) of this rank's sharded parameters."""
    return {name: (p.tensor_parallel_dim, p.tensor_parallel_parts, model_rank, degree, _transposed(p))
            for name, p in module.named_parameters() if is_partitioned(p)}


def refuse_transposed_targets(module: torch.nn.Module, src) -> None:
    """A dense HF `Conv1D` (in, out) cannot take a shard recorded (out, in) without the `transposed`
    flag (module note): it would fail on the shape, or silently transpose a square weight. Refused
    before anything is copied."""
    for name, p in module.named_parameters():
        owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        entry = src.params.get(name, {})
        if is_conv1d(owner) and p is owner.weight and not _saved_in_dense_orientation(entry):  # a bias is 1-D
            raise CheckpointError(f"{src.path}: {name!r} was saved as a tensor-parallel shard in (out, in) layout "
                                  "without the orientation flag of HF Conv1D weights (a checkpoint of an earlier "
                                  "dstrain) and the model holds it as a Conv1D (in, out): load it at "
                                  "tensor_parallel.autotp_size > 1 and save it again")


class LocalShards:
    """A `FragmentSource` seen from a rank whose parameters are tensor-parallel shards: rows of *this
    rank's shard* of a parameter, cut from the full tensor (module note: resharding). Parameters this
    rank holds whole go straight to the source."""

    def __init__(self, src, layouts: dict[str, tuple]):
        self.src, self.layouts = src, layouts
        self.path, self.params, self.meta = src.path, src.params, src.meta
        self._cached: tuple = (None, None, None)  # (name, kind, local shard): the weights are read twice

    def _local(self, name: str, kind: str) -> torch.Tensor:
        if self._cached[:2] != (name, kind):
            dim, parts, index, degree, transposed = self.layouts[name]
            full = self.src.full(name, kind)
            if transposed and _saved_in_dense_orientation(self.params[name]):
                full = full.t()  # the dense Conv1D's (in, out) → the shards' (out, in): module note
            try:
                local = shard(full, dim, index, degree, parts)
            except ValueError as err:
                raise CheckpointError(f"{self.path}: parameter {name!r} cannot be cut into {degree} tensor-parallel "
                                      f"shards ({err}); load it at a tensor_parallel.autotp_size that divides it") from None
            self._cached = (name, kind, local)
        return self._cached[2]

    def rows(self, name: str, kind: str, start: int, stop: int) -> torch.Tensor:
        if name not in self.layouts:
            return self.src.rows(name, kind, start, stop)
        return rows_of(self._local(name, kind))[start:stop]

    def copy_rows(self, name: str, kind: str, out: torch.Tensor) -> None:
        if name not in self.layouts:
            self.src.copy_rows(name, kind, out)
        else:
            rows_of(out).copy_(rows_of(self._local(name, kind)))

    def full(self, name: str, kind: str) -> torch.Tensor:
        return self.src.full(name, kind)

    def scalar(self, name: str, kind: str):
        return self.src.scalar(name, kind)

    def kinds(self, name: str) -> dict:
        return self.src.kinds(name)

    def weights_kind(self, name: str) -> str:
        return self.src.weights_kind(name)
