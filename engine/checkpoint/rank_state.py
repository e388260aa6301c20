"""Optimizer state that belongs to one rank, not to a parameter's rows: saved in that rank's file.

The row layout (state.py) stores per-parameter state once, cut into rows over the ranks, which is
right when every rank holds the same values. The 1-bit optimizers (ops/compressed_optimizer.py) also
keep per-rank error-feedback buffers and phase counters, and 0/1 Adam's local steps make parameters
and moments differ between ranks until the next synchronisation (ops/zero_one_adam.py). An optimizer
with such state offers `rank_state()` / `load_rank_state(saved, same_world)`; the snapshot puts the
former in the rank file ("optimizer") and a load hands rank r its own file's entry. At another world
size there is no telling which saved rank a new rank continues: rank 0's entry goes to every rank with
`same_world=False` (DeepSpeed's choice), and the optimizer decides what survives (counters do; error
buffers restart at zero, with a warning; 0/1 Adam's ranks all continue rank 0's local steps). Before this file existed a resume through save/load_checkpoint lost the counters and errors
(1-bit Adam resumed 0.3 away from the uninterrupted run; tests/test_compression_optimizers.py).
"""
from __future__ import annotations


def _optimizer(eng):
    opt = getattr(eng.zero_optimizer, "optimizer", None)
    return opt if hasattr(opt, "rank_state") else None


def save_rank_state(eng):
    """This rank's entry (copies: an async save's writer reads it after the next step), or None."""
    opt = _optimizer(eng)
    return opt.rank_state() if opt is not None else None


def load_rank_state(eng, src, rank: int, world: int) -> None:
    opt = _optimizer(eng)
    if opt is None:
        return
    same_world = src.meta["world_size"] == world
    saved = src.rank_extras(rank if same_world else 0).get("optimizer")
    if saved is not None:
        opt.load_rank_state(saved, same_world=same_world)
