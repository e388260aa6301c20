"""What a checkpoint records so that a load which would not continue the saving run says so.

- The accumulation window: a checkpoint holds no gradients, so one saved after micro-step k of a
  window of n (0 < k < n) resumes with a new window after the k micro-batches already drawn; their
  gradients are lost and the resumed run is a step behind the one that went on (tested: 3 global
  steps against 4 after the same 5 micro-steps). DeepSpeed allows such saves, so this is a warning,
  at the save (where the caller can move it) and at the load (where the difference shows).
- The optimizer's state keys (its declared layout, ops/state_layout.py): state of another optimizer
  (Lion's exp_avg into AdamW) raised a KeyError at the next step, or was taken silently (AdamW's
  moments and betas as Lion's). Optimizers with the same keys (Adam, AdamW) load each other's state.
"""
from __future__ import annotations

import warnings
from pathlib import Path

from ops.state_layout import declared_layout

from . import format as fmt
from .placement import global_rank_and_world


def window_record(eng) -> dict:
    """Micro-steps taken in the current accumulation window (0 at a boundary), and the window's size."""
    return {"micro_step": eng.micro_steps_in_window(), "of": eng.config.gradient_accumulation_steps}


def _window_text(window: dict) -> str:
    k, n = window["micro_step"], window["of"]
    return (f"micro-step {k} of {n} of a gradient accumulation window: a checkpoint holds no gradients, so "
            f"a run resumed from it starts a new window after the {k} micro-batch(es) already drawn, whose "
            "gradients are lost (it differs from the run that went on)")


def warn_if_mid_window_save(eng, tag: str) -> None:
    window = window_record(eng)
    if window["micro_step"] and global_rank_and_world()[0] == 0:
        warnings.warn(f"save_checkpoint (tag {tag!r}) at {_window_text(window)}; save after a window's last "
                      "micro-step", stacklevel=4)


def warn_if_mid_window_load(path: Path, state: dict) -> None:
    window = state.get("window")  # absent in checkpoints saved before it was recorded
    if window and window["micro_step"] and global_rank_and_world()[0] == 0:
        warnings.warn(f"{path}: saved at {_window_text(window)}", stacklevel=4)


def optimizer_record(eng) -> dict | None:
    """The saving optimizer's class and declared state keys, or None (no optimizer, or no declaration)."""
    optimizer = getattr(eng.zero_optimizer, "optimizer", None)
    layout = declared_layout(optimizer) if optimizer is not None else None
    if layout is None:
        return None
    return {"class": type(optimizer).__name__, "state_keys": sorted(layout)}


def check_optimizer(path: Path, meta: dict, eng) -> None:
    """Refuse optimizer state whose keys are not the ones this engine's optimizer keeps."""
    saved, now = meta.get("optimizer"), optimizer_record(eng)
    if saved is None or now is None or saved["state_keys"] == now["state_keys"]:
        return
    raise fmt.CheckpointError(
        f"{path / fmt.METADATA}: the checkpoint's optimizer state is {saved['class']}'s "
        f"({', '.join(saved['state_keys'])}), this engine's optimizer {now['class']} keeps "
        f"{', '.join(now['state_keys'])}; load with load_optimizer_states=False to take the weights only "
        "(the optimizer starts fresh)")
