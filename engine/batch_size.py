"""Changing the batch size during training (DeepSpeed's `set_train_batch_size` and
`set_train_micro_batch_size`, used for batch-size warm-up and curricula).

DeepSpeed's semantics: `set_train_batch_size(n)` keeps the micro-batch and changes the number of
micro-batches per step, gradient_accumulation_steps = n / (micro × data-parallel world), a ValueError
when that does not divide; `set_train_micro_batch_size(m)` keeps gradient_accumulation_steps and sets
train_batch_size = m × gas × world. DeepSpeed overwrites its config in place; here the typed config is
frozen, so the engine gets a copy with the three batch keys replaced, and everything that reads them
follows from the next micro-step: the accumulation boundary and the loss's 1/gas in `backward`, the
pipeline's micro-batches per `train_batch`, the samples counted per step (and in the step log and the
monitors' rates), and what a checkpoint records (its sampler position is in micro-batches).

Where dstrain differs, and why:
- Called inside an accumulation window it is an error. DeepSpeed just changes gas: the micro-steps
  already taken were scaled by the old 1/gas and the boundary moves to wherever the step counter
  happens to divide the new gas (a window of 1 micro-step, or one mixing two global batches). Here a
  window starts at the change (Engine.micro_steps' note), so the new gas counts from there.
- The data loader `initialize()` built yields the new micro-batch from its next pass; DeepSpeed leaves
  its loader at the old size, so the samples a step counts and those it trains on disagree. Changing
  the micro-batch while a pass of that loader is under way is an error (its position, and a
  checkpoint's record of it, are counted in micro-batches of one size); a position loaded from a
  checkpoint and not yet reached is kept in samples (a resumed warm-up that sets its micro-batch again).
"""
from __future__ import annotations


def _positive(what: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"engine.{what}({n!r}): expected a positive integer")
    return n


def _require_boundary(eng, what: str, n: int) -> None:
    done = eng.micro_steps_in_window()
    if done:
        raise RuntimeError(f"engine.{what}({n}) was called inside a gradient-accumulation window ({done} of "
                           f"{eng.config.gradient_accumulation_steps} micro-steps taken); call it after the "
                           "engine.step() that ends the window (engine.is_gradient_accumulation_boundary() was "
                           "True for that micro-step)")


def _apply(eng, train_batch_size: int, micro: int, gas: int) -> None:
    eng.config = eng.config.model_copy(update={"train_batch_size": train_batch_size,
                                               "train_micro_batch_size_per_gpu": micro,
                                               "gradient_accumulation_steps": gas})
    eng.logger.train_batch_size = train_batch_size  # the step log's samples/s
    eng.metrics.train_batch_size = train_batch_size  # the monitors' samples/s
    eng.start_window()


def set_train_batch_size(eng, train_batch_size: int) -> None:
    """gradient_accumulation_steps = train_batch_size / (micro × data-parallel world); micro unchanged."""
    what = "set_train_batch_size"
    _positive(what, train_batch_size)
    cfg = eng.config
    micro, world = cfg.train_micro_batch_size_per_gpu, cfg.world_size
    if train_batch_size % (micro * world):
        raise ValueError(f"engine.{what}({train_batch_size}): the train batch size must be divisible by "
                         f"train_micro_batch_size_per_gpu {micro} × data-parallel world size {world} = "
                         f"{micro * world} (it changes gradient_accumulation_steps only); pass a multiple of "
                         f"{micro * world}, or change the micro batch with engine.set_train_micro_batch_size")
    _require_boundary(eng, what, train_batch_size)
    _apply(eng, train_batch_size, micro, train_batch_size // (micro * world))


def set_train_micro_batch_size(eng, micro_batch_size: int) -> None:
    """train_batch_size = micro_batch_size × gradient_accumulation_steps × data-parallel world."""
    what = "set_train_micro_batch_size"
    _positive(what, micro_batch_size)
    _require_boundary(eng, what, micro_batch_size)
    cfg = eng.config
    loader = eng.training_dataloader
    if loader is not None and hasattr(loader, "set_micro_batch_size"):  # the loader initialize() built
        loader.set_micro_batch_size(micro_batch_size, f"engine.{what}")
    gas = cfg.gradient_accumulation_steps
    _apply(eng, micro_batch_size * gas * cfg.world_size, micro_batch_size, gas)
