"""AutoTP: shard an unmodified model (HF GPT-2, Llama-style, examples/gpt.py) by replacing its
projections in place with the parallel layers (DeepSpeed's `tensor_parallel.autotp_size` route).

Which projection is which is read from the module's own name, as in Megatron's layout of a block:
column-parallel (output features split) for the projections into the attention heads and the MLP's
hidden layer, row-parallel (input features split, one all-reduce) for the projections out of them.
GPT-2's `c_attn` and examples/gpt.py's `qkv` fuse q|k|v and are split section by section
(layers.py, note on fused projections); `Conv1D`'s transposed weight is handled by `from_dense`.
The layouts of fused projections (GPTBigCode's per-head `c_attn`, GPT-NeoX's, BLOOM's and Falcon's
`query_key_value`), DiffLlama's paired heads and BLOOM's and Falcon's per-head ALiBi inputs are
autotp_layouts.py's (its notes). Separate k_proj/v_proj with fewer key/value heads than T (T a multiple
of them) become kv_heads.py's `KeyValueHeadLinear`: each rank keeps the head its queries read.
A fused `c_attn` or `qkv` of a model not listed is taken to be GPT-2's layout; the head counts it needs
are checked, its layout cannot be (a `query_key_value` not listed is refused: autotp_layouts.py).
Embeddings, the LM head and norms stay whole (replicated; grads.py's note). Dropout between a
column-parallel layer and its row-parallel partner draws per tensor rank (dropout_region.py).
[Note: head counts] A module that owns a sharded attention projection runs on n_head/T heads: its
head-count attributes (`HEAD_COUNT_ATTRIBUTES`), GPT-2's `split_size` and the BART family's `embed_dim`
(XGLM's attention reshapes its heads' output to it: undivided, torch's bare shape error in the first
forward) are divided by T, and so are those of its config, which becomes its own copy (Phi-3's attention cuts
its fused q|k|v at `config.num_attention_heads` × head_dim in its forward). head_dim is unchanged. A `SparseSelfAttention` inside it keeps this
rank's heads of its (per-head) layout. A model whose forward hard-codes the full width elsewhere is not
shardable this way.
[Note: head-sized parameters] A parameter the owner holds directly with one entry per head (GPT-OSS's
`sinks`) would meet one rank's heads with all of them, so one as long as a head count is refused at
sharding. One as long as head_dim is a per-head-dim scale applied to every head (DiffLlama's
`lambda_q1`), which own_params.py sums over the tensor ranks, exactly. When head_dim equals a head count
(DiffLlama with hidden 16 and 4 heads) the length cannot tell them apart; it was refused, a false refusal
of a model that trains exactly, so the length of head_dim wins: a per-head parameter of such a model is
not refused here: broadcast against the heads it meets torch's shape error in its first forward, with
a note naming it; read in part (sliced by the divided head count, `p[:self.num_heads]`, which ran
without error, every rank reading the first heads' entries) its first forward raises, naming it: a
per-head-dim scale is read whole (own_params.py's `refuse_partial_reads`, from the autograd graph).
A per-head parameter reshaped to the heads and then indexed through an op other than a view is not seen.
Where neither the module nor its config states head_dim, a head count's length is refused as before.
"""
from __future__ import annotations

import copy

import torch.nn as nn

from ops.sparse_attention import SparseSelfAttention

from ..comm import Communicator
from .autotp_layouts import PAIRED_HEADS, column_sections, is_cut, keep_head_inputs, refuse_unshardable, stated_count
from .dropout_region import mark_parallel_region
from .kv_heads import KeyValueHeadLinear
from .layers import ColumnParallelLinear, RowParallelLinear, is_conv1d
from .own_params import note_region_failures, refuse_partial_reads

# leaf name -> number of fused sections
# (OPT, GPT-J, GPT-NeoX, BLOOM, Falcon, Phi: `fc1 fc_in dense_h_to_4h query_key_value`, `out_proj fc2
# fc_out dense_4h_to_h dense`; `query_key_value` only for the classes autotp_layouts.py lists)
COLUMN_PARALLEL = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "gate_proj": 1, "up_proj": 1, "c_fc": 1, "fc": 1,
                   "fc1": 1, "fc_in": 1, "dense_h_to_4h": 1, "c_attn": 3, "qkv": 3, "query_key_value": 1,
                   "qkv_proj": 3, "gate_up_proj": 2}  # Phi-3's: q|k|v by head counts (autotp_layouts.py), gate|up
ROW_PARALLEL = ("o_proj", "down_proj", "c_proj", "proj", "out", "out_proj", "fc2", "fc_out", "dense_4h_to_h", "dense")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "c_attn", "qkv", "query_key_value", "qkv_proj")
HEAD_COUNTS = ("num_heads", "n_head", "num_attention_heads", "num_key_value_heads", "num_kv_heads")
HEAD_COUNT_ATTRIBUTES = HEAD_COUNTS + ("split_size", "embed_dim")  # note: head counts
KV_HEAD_COUNTS = ("num_key_value_heads", "num_kv_heads")


def _is_projection(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _few_kv_heads(owner: nn.Module, children: dict, world: int) -> int | None:
    """The key/value head count of an owner with separate k_proj and v_proj and fewer key/value heads
    than ranks, which the ranks divide by (kv_heads.py's note); None otherwise."""
    if not {"k_proj", "v_proj"} <= children.keys() or type(owner).__name__ in PAIRED_HEADS:
        return None
    kv = stated_count(owner, KV_HEAD_COUNTS)
    return kv if kv is not None and kv < world and world % kv == 0 else None


def _divide_head_counts(owner: nn.Module, world: int, where: str, few_kv: bool = False) -> None:
    """Divide `owner`'s head counts by T; with fewer key/value heads than ranks each keeps one."""
    if few_kv and isinstance(getattr(owner, "num_key_value_groups", None), int):
        owner.num_key_value_groups = _head_count(owner) // world  # its query heads read its one key/value head
    for attribute in HEAD_COUNT_ATTRIBUTES:
        value = getattr(owner, attribute, None)
        if few_kv and attribute in KV_HEAD_COUNTS and isinstance(value, int):
            setattr(owner, attribute, 1)
        elif isinstance(value, int) and not isinstance(value, bool):
            if value % world:
                raise ValueError(f"tensor_parallel.autotp_size: {where}.{attribute} = {value} does not divide by "
                                 f"{world}; use an autotp_size that divides the head count")
            setattr(owner, attribute, value // world)
    config = getattr(owner, "config", None)
    if config is not None and not isinstance(config, nn.Module):  # note: head counts
        counts = {a: getattr(config, a) for a in HEAD_COUNTS if isinstance(getattr(config, a, None), int)}
        owner.config = copy.copy(config)
        for attribute, value in counts.items():  # from the values read before: an attribute_map alias is one value
            setattr(owner.config, attribute, 1 if few_kv and attribute in KV_HEAD_COUNTS else value // world)


def _head_count(owner: nn.Module) -> int:
    """The whole model's query heads, before they are divided."""
    config = getattr(owner, "config", None)
    for src in (owner, config):
        for attribute in ("num_heads", "n_head", "num_attention_heads"):
            if isinstance(getattr(src, attribute, None), int):
                return getattr(src, attribute)
    return 0


def _check_config_head_counts(owner: nn.Module, world: int, where: str, few_kv: bool = False) -> None:
    """An attention module without head-count attributes (HF Llama's reads its config): every head
    count of its config must divide by T, or a rank would hold part of a (key/value) head."""
    config = getattr(owner, "config", None)
    counts = {a: getattr(config, a) for a in ("num_attention_heads", "num_key_value_heads", "num_kv_heads")
              if isinstance(getattr(config, a, None), int) and not (few_kv and a in KV_HEAD_COUNTS)}
    pair = PAIRED_HEADS.get(type(owner).__name__, 1)  # DiffLlama: else a rank's chunk(2) met one head or 1.5
    if any(value % (world * pair) for value in counts.values()):
        listed = ", ".join(f"config.{a} = {v}" for a, v in counts.items())
        whole = "query and key/value heads" if pair == 1 else \
            f"pairs of query and key/value heads (head h with h + H/2: each count must divide by {pair} x {world})"
        raise ValueError(f"tensor_parallel.autotp_size: {world} does not divide the head counts of {where} ({listed}): "
                         f"each rank must hold whole {whole}; use an autotp_size that divides them")


def _refuse_per_head_own_parameters(owner: nn.Module, where: str) -> None:
    """A parameter the projections' owner holds directly, one per head (GPT-OSS's attention `sinks`),
    would meet one rank's heads with all of them: a bare shape error at best. Refused here, naming it
    (module note: head-sized parameters).
    Other own parameters are found where they are used, in the first forward (own_params.py)."""
    config = getattr(owner, "config", None)
    sizes = {getattr(src, a) for src in (owner, config) for a in HEAD_COUNTS
             if isinstance(getattr(src, a, None), int)}
    head_dims = {getattr(src, "head_dim") for src in (owner, config) if isinstance(getattr(src, "head_dim", None), int)}
    either = [name for name, p in owner.named_parameters(recurse=False) if p.numel() in sizes & head_dims]
    if either:  # note: head-sized parameters
        refuse_partial_reads(owner, either)
        note_region_failures(owner, either, "as long as head_dim and as a head count: taken for one entry per "
                                            "head_dim, which every head shares; if it has one per head, each rank "
                                            "meets its heads with all of them")
    for name, p in owner.named_parameters(recurse=False):
        if p.numel() in sizes - head_dims:
            raise ValueError(f"tensor_parallel.autotp_size: {where}.{name} {tuple(p.shape)} is sized by the attention "
                             "heads AutoTP would split, and its module uses it directly; leave autotp_size at 1 for "
                             "this model, or shard it with engine.tensor_parallel's layers")


def _shard_sparse_attention(owner: nn.Module, comm: Communicator, where: str) -> None:
    """This rank's heads of each sparse attention's layout: the column-parallel projections give rank r
    the r-th contiguous 1/T of the heads."""
    for name, module in owner.named_modules():
        if isinstance(module, SparseSelfAttention):
            heads = module.sparsity_config.num_heads
            if heads % comm.world_size:
                raise ValueError(f"tensor_parallel.autotp_size: {where}.{name} has a sparsity config of {heads} heads, "
                                 f"which does not divide by {comm.world_size}; use an autotp_size that divides it")
            per_rank = heads // comm.world_size
            module.keep_heads(comm.rank * per_rank, (comm.rank + 1) * per_rank)


def shard_model(model: nn.Module, comm: Communicator, require_projections: bool = True) -> list[str]:
    """Replace `model`'s projections in place with parallel layers over `comm`; returns their names.
    Every tensor-parallel rank must hold the same full weights when this runs. Finding none is an error
    unless `require_projections` is False (one pipeline stage of many: the caller checks the whole)."""
    if comm.world_size == 1:
        return []
    replaced = []
    for owner_name, owner in list(model.named_modules()):
        children = {name: child for name, child in owner.named_children() if _is_projection(child)
                    and (name in COLUMN_PARALLEL or name in ROW_PARALLEL) and is_cut(owner, name)}
        # a row-parallel layer needs its input split by a column-parallel sibling: shard only pairs.
        # GPT-2's cross-attention fuses only k|v in `c_attn` and projects q in `q_attn`: cut as q|k|v it
        # failed in forward with a shape error, so it stays whole (replicated, exact)
        if not (children.keys() & COLUMN_PARALLEL.keys() and children.keys() & set(ROW_PARALLEL)) \
                or getattr(owner, "is_cross_attention", False):
            continue
        sharded_attention, column, row = False, [], []
        where = owner_name or type(model).__name__
        refuse_unshardable(owner, where)
        few_kv = _few_kv_heads(owner, children, comm.world_size)
        if children.keys() & set(ATTENTION_PROJECTIONS):
            _check_config_head_counts(owner, comm.world_size, owner_name or type(model).__name__, few_kv is not None)
            _refuse_per_head_own_parameters(owner, owner_name or type(model).__name__)
        for name, child in children.items():
            path = f"{owner_name}.{name}" if owner_name else name
            parts = column_sections(owner, name, COLUMN_PARALLEL[name], path) if name in COLUMN_PARALLEL else 1
            try:
                if few_kv is not None and name in ("k_proj", "v_proj"):
                    layer = KeyValueHeadLinear(child, few_kv, stated_count(owner, ("head_dim",)) or 0, group=comm)
                elif name in COLUMN_PARALLEL:
                    layer = ColumnParallelLinear.from_dense(child, parts=parts, group=comm)
                else:
                    layer = RowParallelLinear.from_dense(child, input_is_parallel=True, group=comm)
            except ValueError as err:
                raise ValueError(f"tensor_parallel.autotp_size: cannot shard {path} "
                                 f"({type(child).__name__}): {err}") from None
            setattr(owner, name, layer)
            replaced.append(path)
            sharded_attention |= name in ATTENTION_PROJECTIONS
            (column if name in COLUMN_PARALLEL else row).append(layer)
        mark_parallel_region(owner, column, row)
        if sharded_attention:
            keep_head_inputs(owner, _head_count(owner), comm.rank, comm.world_size)
            _divide_head_counts(owner, comm.world_size, owner_name or type(model).__name__, few_kv is not None)
            _shard_sparse_attention(owner, comm, owner_name or type(model).__name__)
    if not replaced and require_projections:
        raise ValueError(f"tensor_parallel.autotp_size: {comm.world_size}, but no projection of "
                         f"{type(model).__name__} has a name AutoTP knows (column: {sorted(COLUMN_PARALLEL)}; "
                         f"row: {list(ROW_PARALLEL)}); shard it with engine.tensor_parallel's layers instead")
    return replaced
