"""What AutoTP must know of a model family beyond its projections' names: how a fused projection is
laid out, which layouts no cut of the output features makes exact, and which inputs of an attention
module hold one slice per head of the whole model.

[Note: per-head fused layout] The name says the projection is fused, not how: HF GPTBigCode's `c_attn`
(multi_query=False) lays its output out head by head, [q_h k_h v_h] for each head h, where GPT-2's is
three blocks q|k|v. Cut as three sections it gave each rank the wrong features of every head: the
loss was 2.6e-3 off the dense model's at step 0, silently. A contiguous 1/T of a per-head layout is
T whole heads, so such projections (`OWNER_SECTIONS`, by the owner's class) are cut as one section.
[Note: query_key_value] GPT-NeoX, BLOOM and Persimmon fuse `query_key_value` head by head (the forward
views it as (heads, 3, head_dim) or (heads, 3 x head_dim)); Falcon's layout follows its config: head by
head (multi_query=False), key/value group by group, [q of the group's heads, k_g, v_g]
(new_decoder_architecture: a contiguous 1/T is whole groups when T divides num_kv_heads), or the
queries of every head then one key and one value (multi_query): that key/value head is read by every
rank's heads, so no cut of the output features holds it once: refused (`refuse_unshardable`). Cut as
q|k|v thirds, GPT-NeoX's loss was 1.1e-2 off the dense model's within 2 SGD steps, without a shape
error. Other code uses the name with other layouts (ChatGLM's q|k|v blocks of unequal width), so a
`query_key_value` of a class not listed is refused rather than guessed (`FUSED_BY_OWNER_ONLY`).
[Note: unequal sections] Phi-3's `qkv_proj` is three blocks q|k|v, q num_heads × head_dim wide and k
and v num_key_value_heads × head_dim each (narrower under grouped-query attention), and its forward
cuts q at `config.num_attention_heads × head_dim`. It is cut as sections of those sizes, each split
by T (layers.py's fused note), so rank r's output is [q_r | k_r | v_r]; the owner's config is its own
copy with the head counts divided (autotp.py's note), so the forward's own cut reads it. Where
num_key_value_heads does not divide by T it is refused with the other head counts (autotp.py).
[Note: paired heads] HF DiffLlama's attention pairs head h with head h + H/2 (`torch.chunk(..., 2)` over
the head axis, of v's key/value heads and of the attention output). A contiguous 1/T of the heads pairs
them differently: its loss was 1.7e-2 off the dense model's at step 0, silently. Its q, k and v
projections are cut as two sections (rank r holds the r-th 1/T of each half), so its own chunks pair
the dense model's heads; o_proj's input, one feature block per pair, is cut whole.
[Note: per-head inputs] BLOOM's attention receives the ALiBi bias as `alibi`, (batch x heads, 1, keys)
over the whole model's heads, and Falcon's (config.alibi) inside `attention_mask`, (batch, heads,
queries, keys). On n_head/T heads torch raised a bare shape error in the first forward; a forward
pre-hook hands the module this rank's heads of them (rank r: the r-th contiguous 1/T, as the cut).
"""
from __future__ import annotations

import inspect

import torch
import torch.nn as nn

# owner class -> {projection: sections} where the name's default is wrong (notes above)
OWNER_SECTIONS = {"GPTBigCodeAttention": {"c_attn": 1},
                  "DiffLlamaAttention": {"q_proj": 2, "k_proj": 2, "v_proj": 2},
                  "GPTNeoXAttention": {"query_key_value": 1}, "BloomAttention": {"query_key_value": 1},
                  "PersimmonAttention": {"query_key_value": 1}, "FalconAttention": {"query_key_value": 1}}
# fused projections whose layout differs between families: sharded only for an owner listed above
FUSED_BY_OWNER_ONLY = ("query_key_value",)
# fused q|k|v blocks sized by the owner's head counts, for the owners listed (note: unequal sections)
FUSED_BY_HEAD_COUNTS = ("qkv_proj",)
HEAD_COUNT_OWNERS = ("Phi3Attention", "Phi4MultimodalAttention")
# owner class -> heads per pair: a rank must hold whole pairs (note: paired heads)
PAIRED_HEADS = {"DiffLlamaAttention": 2}
# owner class -> (argument, dim of its heads): 0 means batch x heads flattened (note: per-head inputs)
HEAD_INPUTS = {"BloomAttention": ("alibi", 0), "FalconAttention": ("attention_mask", 1)}


def is_cut(owner: nn.Module, name: str) -> bool:
    """Whether AutoTP cuts `owner`'s projection `name`: a `qkv_proj` only where its layout is known (CodeGen's
    interleaves it otherwise: left whole, as before it was cut anywhere)."""
    return name not in FUSED_BY_HEAD_COUNTS or type(owner).__name__ in HEAD_COUNT_OWNERS


def stated_count(owner: nn.Module, names: tuple[str, ...]) -> int | None:
    """The first of `names` the module or its config states as an int."""
    config = getattr(owner, "config", None)
    for src in (owner, config):
        for attribute in names:
            if isinstance(getattr(src, attribute, None), int):
                return getattr(src, attribute)
    return None


def _head_count_sections(owner: nn.Module, path: str) -> tuple[int, int, int]:
    """q|k|v widths of a projection fused by head counts (note: unequal sections)."""
    heads = stated_count(owner, ("num_heads", "num_attention_heads"))
    kv_heads = stated_count(owner, ("num_key_value_heads", "num_kv_heads"))
    head_dim = stated_count(owner, ("head_dim",))
    if heads is None or kv_heads is None or head_dim is None:
        raise ValueError(f"tensor_parallel.autotp_size: {path} ({type(owner).__name__}) fuses q, k and v, but its module "
                         "or config does not state num_attention_heads, num_key_value_heads and head_dim, which size "
                         "its sections; leave autotp_size at 1 for this model, or shard it with engine.tensor_parallel's "
                         "layers")
    return heads * head_dim, kv_heads * head_dim, kv_heads * head_dim


def column_sections(owner: nn.Module, name: str, default: int, path: str):
    """How `owner`'s column projection `name` is cut: a count of equal fused sections, or their sizes."""
    cls = type(owner).__name__
    if name in OWNER_SECTIONS.get(cls, {}):
        return OWNER_SECTIONS[cls][name]
    if name in FUSED_BY_HEAD_COUNTS:
        return _head_count_sections(owner, path)
    if name in FUSED_BY_OWNER_ONLY:  # note: query_key_value
        raise ValueError(f"tensor_parallel.autotp_size: {path} ({cls}) fuses q, k and v in a layout AutoTP does not "
                         f"know (it knows {sorted(c for c, s in OWNER_SECTIONS.items() if name in s)}); leave "
                         "autotp_size at 1 for this model, or shard it with engine.tensor_parallel's layers")
    return default


def refuse_unshardable(owner: nn.Module, where: str) -> None:
    """Layouts no cut of the output features makes exact, refused naming the module and why."""
    cls = type(owner).__name__
    if cls == "FalconAttention" and owner.multi_query and not owner.new_decoder_architecture:
        raise ValueError(f"tensor_parallel.autotp_size: {where} (FalconAttention) is multi-query: its one key/value "
                         "head, fused into query_key_value, is read by every query head, so no rank can hold whole "
                         "heads of it; use a config with new_decoder_architecture (grouped key/value heads) or "
                         "multi_query=False, or leave autotp_size at 1 for this model")
    if getattr(owner, "slow_but_exact", False) and getattr(owner, "pretraining_tp", 1) > 1:
        # BLOOM's slow path multiplies slices of the row projection's weight itself: no all-reduce
        raise ValueError(f"tensor_parallel.autotp_size: {where} ({cls}) has slow_but_exact with pretraining_tp = "
                         f"{owner.pretraining_tp}: its forward multiplies slices of its output projection's weight "
                         "itself, bypassing the sharded layer; set config.slow_but_exact = False")


def _this_ranks_heads(t, dim: int, heads: int, rank: int, world: int):
    per_rank = heads // world
    if not isinstance(t, torch.Tensor):
        return t
    if dim == 0:  # (batch x heads, ...): BLOOM's alibi
        return t.unflatten(0, (-1, heads))[:, rank * per_rank:(rank + 1) * per_rank].flatten(0, 1)
    if t.dim() > dim and t.shape[dim] == heads:  # a mask broadcast over the heads (size 1) is everyone's
        return t.narrow(dim, rank * per_rank, per_rank)
    return t


def keep_head_inputs(owner: nn.Module, heads: int, rank: int, world: int) -> None:
    """Hand `owner` this rank's heads of its per-head inputs (note: per-head inputs); `heads` is the
    whole model's head count."""
    if type(owner).__name__ not in HEAD_INPUTS:
        return
    argument, dim = HEAD_INPUTS[type(owner).__name__]
    signature = inspect.signature(owner.forward)

    def pre_hook(module, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        if argument not in bound.arguments:
            return None
        bound.arguments[argument] = _this_ranks_heads(bound.arguments[argument], dim, heads, rank, world)
        return bound.args, bound.kwargs
    owner.register_forward_pre_hook(pre_hook, with_kwargs=True)
