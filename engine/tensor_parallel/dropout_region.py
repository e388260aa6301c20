"""Dropout inside the layers AutoTP shards draws a different mask on every tensor rank.

[Note: AutoTP's parallel regions] Between a column-parallel projection's output and the input of its
row-parallel partner every tensor is partitioned: rank r holds heads (or hidden features) the other
ranks do not. Dropout there must draw a different mask on every tensor rank, as the dense model draws
independent masks per head; dropout on the replicated tensors outside must draw the same one (Megatron's
rule; `ParallelSelfAttention` forks the tracker around its attention for the same reason). An
unmodified model's forward (HF GPT-2's eager attention dropout, examples/gpt.py's SDPA `dropout_p`)
cannot be edited, so the region is marked with hooks on the layers: a column-parallel layer's output
switches the default generator to a region stream, a row-parallel layer's input (and the end of their
owner's forward, even one that raised) switches it back. Only in training, and only once
`model_parallel_cuda_manual_seed` seeded the tensor-parallel streams (`initialize` does).
[Note: the region stream is a function of the default stream] At the region's entry one number is
drawn from the default CPU generator (the same on the ranks of one model, so they stay in step) and,
with the tensor rank mixed in, seeds the region's generator. Every activation-checkpoint recompute
restores the default generators before it replays the forward — torch.utils.checkpoint's (HF's
`gradient_checkpointing_enable`) as well as `engine.checkpointing`'s — so a recompute draws the
forward's masks whichever one runs it. (A stream kept in the tracker, as before, advanced in the forward
and was not rewound by torch's checkpoint: HF gradient checkpointing recomputed with other masks.)
Not covered: dropout on a partitioned tensor that a model draws before its first column-parallel
projection or after a row-parallel one (no such tensor exists in the layouts AutoTP knows), or between
layers that no one module's forward runs together (a PipelineModule's stages: mark_layer_regions' note;
docs/parallelism.md).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from ..activation_checkpointing.rng import MODEL_PARALLEL_RNG, _get_state, _set_state, get_cuda_rng_tracker
from .own_params import watch_own_parameters
from .region_params import close_region, column_widths, open_region, watch_region_children

_SEED_RANGE = 2**62
_RANK_STRIDE = 0x9E3779B97F4A7C15  # odd: distinct tensor ranks get distinct seeds from one draw


class _Region:
    """The default generator's state while a region stream is current, else None."""

    outer: torch.Tensor | None = None


_REGION = _Region()


def region_seed(tensor_rank: int) -> int:
    """Draws once from the default CPU generator (replayed by every recompute): this rank's seed."""
    draw = int(torch.randint(_SEED_RANGE, (1,), device="cpu").item())
    return (draw + _RANK_STRIDE * tensor_rank) % 2**63


def _seed_default_stream(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)  # the current device's: where the dropout draws
    else:
        torch.default_generator.manual_seed(seed)


def _enter(module: nn.Module, args, output) -> None:
    if module.training and _REGION.outer is None and MODEL_PARALLEL_RNG in get_cuda_rng_tracker().states:
        seed = region_seed(module.comm.rank)  # before the outer state is kept: the draw stays consumed
        _REGION.outer = _get_state()
        _seed_default_stream(seed)


def _leave(*_) -> None:
    if _REGION.outer is not None:
        _set_state(_REGION.outer)
        _REGION.outer = None


class _OwnerRunning:
    """Whether the owner's forward is running: a column-parallel layer called outside it (a user
    inspecting its output) opens no region, so it neither marks the block's layer norms
    (region_params.py) nor switches the random stream for the user's next draws."""

    on = False


def mark_parallel_region(owner: nn.Module, column: list[nn.Module], row: list[nn.Module]) -> None:
    """Hook `owner`'s sharded layers: between them dropout draws a stream of this tensor rank, and a
    replicated parameter used there gets the dense gradient (region_params.py)."""
    if getattr(owner, "_tensor_parallel_region", False):  # marked already: one pair of hooks is enough
        return
    owner._tensor_parallel_region = True
    running = _OwnerRunning()

    def start(*_) -> None:
        running.on = True

    def opened(module, args, output) -> None:
        if running.on:
            open_region()
            _enter(module, args, output)

    def closed(*_) -> None:
        close_region()
        _leave()

    def end(*_) -> None:
        running.on = False
        closed()
    owner.register_forward_pre_hook(start)
    for layer in column:
        layer.register_forward_hook(opened)
    for layer in row:
        layer.register_forward_pre_hook(closed)
    owner.register_forward_hook(end, always_call=True)
    widths = column_widths(column)
    watch_region_children(owner, column, row, widths)
    watch_own_parameters(owner, column, row, widths)


def mark_layer_regions(model: nn.Module) -> list[str]:
    """A model built from this package's layers gets AutoTP's regions. [Note: the smallest module that
    runs the pair] A `ColumnParallelLinear(gather_output=False)` and a `RowParallelLinear(input_is_parallel=
    True)` are paired by the smallest module whose forward runs both: their common parent (a user's block,
    an `nn.Sequential` MLP) or one above (BERT's layout: an `Intermediate` holding the column layer and an
    `Output` holding a dropout and the row layer, both in one `nn.Sequential`; the dropout on the split
    hidden features drew one mask on every tensor rank when only a common parent could own the pair).
    `ParallelSelfAttention` forks its own stream and `ParallelMLP` draws nothing. A `ModuleList` or
    `ModuleDict` has no forward: the module holding it runs its entries, so a pair split over the entries
    is that module's (a column layer, a gain on its output and the row layer as three entries: the gain's
    gradient was each rank's half's share, and a dropout there drew one mask on every tensor rank, when
    the list ended the search with a warning). A `PipelineModule` runs its stages on other ranks, so no
    hook could close a region there: the pairs left open below one are not paired across it, and a row
    layer among them beside a dropout is warned about (its split input cannot be told from a replicated
    one), as at a model that is a ModuleList itself. Returns the names of the modules marked.
    An unpaired column layer is not warned about: it is most often a vocabulary-parallel LM head beside an
    embedding dropout."""
    marked: list[str] = []
    _, unpaired = _pair_below(model, "", marked)
    _warn_unpaired_rows(unpaired)
    return marked


def _pair_below(module: nn.Module, name: str, marked: list[str]) -> tuple[list, list]:
    """The column layers and the (row layer, its parent's name, its parent) of `module`'s subtree that no
    smaller module pairs; marks `module` as their owner when it holds both kinds (note: the smallest
    module that runs the pair). `module` is no parallel layer itself."""
    from ..pipe.module import PipelineModule
    from .attention import ParallelMLP, ParallelSelfAttention
    from .layers import ColumnParallelLinear, RowParallelLinear
    if isinstance(module, (ParallelSelfAttention, ParallelMLP)):  # the model itself may be one
        return [], []
    column, row = [], []
    for child_name, child in module.named_children():
        if isinstance(child, ColumnParallelLinear):
            column += [] if child.gather_output else [child]
        elif isinstance(child, RowParallelLinear):
            row += [(child, name, module)] if child.input_is_parallel else []
        else:
            c, r = _pair_below(child, f"{name}.{child_name}" if name else child_name, marked)
            column, row = column + c, row + r
    if isinstance(module, PipelineModule):
        _warn_unpaired_rows(row)
        return [], []
    if column and row and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):  # note: its holder runs them
        mark_parallel_region(module, column, [layer for layer, _, _ in row])
        marked.append(name)
        return [], []
    return column, row


def _warn_unpaired_rows(rows: list) -> None:
    for _, parent_name, parent in rows:
        if any(isinstance(c, nn.Dropout) and c.p > 0 for c in parent.children()):
            warnings.warn(f"tensor parallelism: {parent_name or 'the model'} ({type(parent).__name__}) holds a dropout "
                          "and a RowParallelLinear(input_is_parallel=True) whose column-parallel partner no one "
                          "module's forward runs with it (across a PipelineModule's stages): "
                          "a dropout on its split input draws the same mask on every tensor rank; put the pair in one "
                          "module, or draw it inside engine.checkpointing.get_cuda_rng_tracker().fork()", stacklevel=3)
