"""How each optimizer-state key is laid out in a checkpoint: the class's declaration (ops/state_layout.py).

ELEMENTWISE state is saved as rows of its parameter, cut and reassembled like the weights, so it
reshards across stages and world sizes; SCALAR and PER_TENSOR state is saved whole with every fragment
and loaded as is. A client optimizer that declares no layout can only be used where every rank holds
whole tensors (ZeRO stage 0; stages >= 1 refuse it at initialize): there all its state is saved whole,
PER_TENSOR, which is right whatever its shapes — nothing is inferred from them — at the cost of
writing each state tensor once per fragment (a warning names the class).
"""
from __future__ import annotations

import logging

from ops.state_layout import (ELEMENTWISE, PER_TENSOR, SCALAR, STATE_LAYOUTS,  # noqa: F401 (re-exported)
                              check_state, declared_layout)

logger = logging.getLogger(__name__)
_warned: set = set()


def state_layout(optimizer) -> dict[str, str]:
    """key -> ELEMENTWISE / SCALAR / PER_TENSOR for every state key `optimizer` holds (module docstring)."""
    declared = declared_layout(optimizer)
    held = {k for state in optimizer.state.values() for k in state}
    if declared is None:
        name = type(optimizer).__name__
        if name not in _warned:
            _warned.add(name)
            logger.warning("optimizer %s declares no STATE_LAYOUT; checkpoints save all its state whole with "
                           "every fragment (set %s.STATE_LAYOUT to save per-element state as rows)", name, name)
        return dict.fromkeys(held, PER_TENSOR)
    for owner, state in optimizer.state.items():  # undeclared keys, and values of another shape, refused
        check_state(optimizer, owner, state)
    return {k: declared[k] for k in held}


def elementwise_kinds(optimizer) -> set[str]:
    return {k for k, layout in state_layout(optimizer).items() if layout == ELEMENTWISE}
