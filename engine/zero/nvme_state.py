"""The swapped optimizer state seen through the in-memory state APIs (`offload_optimizer.device: nvme`).

With NVMe offload the configured optimizer's `state` stays empty (nvme_tier.py's note), so everything
that reads it would see no state: `eng.optimizer.state_dict()` / `load_state_dict()`, and
`engine.utils.safe_get_full_optimizer_state` / `safe_get_local_optimizer_state`. Here they read and
write the swap files instead, through torch's own optimizer state-dict hooks, which is where a user
of the optimizer looks. These APIs return whole tensors by definition, so each call holds the state it
returns in host memory (one flat per state kind); the training step and checkpoints never call them.
"""
from __future__ import annotations

import torch


def assembled_state(tier, key, kinds: set[str] | None = None) -> dict:
    """Flat `key`'s optimizer state as the in-memory optimizer would hold it: {kind: flat-sized fp32
    tensor} for the elementwise kinds (only `kinds` if given), plus the per-step scalars."""
    numel = tier.parts[key].numel
    state: dict = {}
    for chunk in tier.state_chunks(key):
        for kind, value in chunk["state"].items():
            if kinds is None or kind in kinds:
                if kind not in state:
                    state[kind] = torch.zeros(numel, dtype=torch.float32, device="cpu")
                state[kind][chunk["start"]:chunk["end"]].copy_(value)
        for kind, value in chunk["scalars"].items():
            state.setdefault(kind, value)  # equal in every sub-group (Adam's step)
        if kinds is not None and not chunk["state"]:
            break  # no state yet: every chunk is empty
    return state


def state_value(tier, key, name: str):
    """One state entry of flat `key`: a flat-sized tensor, a scalar, or None when there is none."""
    return assembled_state(tier, key, {name}).get(name)


def install_state_dict_hooks(tier) -> list:
    """`optimizer.state_dict()` includes the swapped state; `load_state_dict()` writes it to the swap
    files (with the host flats as master weights: set them first). Returns the hook handles."""
    optimizer = tier.optimizer
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}

    def with_swapped_state(_optimizer, state_dict: dict) -> dict:
        for key, flat in tier.partition.flat.items():
            state = assembled_state(tier, key)
            if state:
                state_dict["state"][index[id(flat)]] = state
        return state_dict

    def into_swap_files(_optimizer) -> None:
        for key, flat in tier.partition.flat.items():
            loaded = optimizer.state.pop(flat, {})
            per_element = tier.parts[key].state_keys  # the declared layout's (ops/state_layout.py), not shapes
            rows = {k: v.reshape(-1) for k, v in loaded.items() if k in per_element}
            scalars = {k: v for k, v in loaded.items() if k not in rows}
            tier.load_chunks(key, _one_chunk(tier, key, flat.numel(), rows, scalars))

    return [optimizer.register_state_dict_post_hook(with_swapped_state),
            optimizer.register_load_state_dict_post_hook(into_swap_files)]


def _one_chunk(tier, key, numel: int, rows: dict, scalars: dict):
    """The loaded partition as one chunk, its master read where load_state_dict wrote it (the store) once
    `load_chunks` runs: a load reads an image a failed step left half-updated (nvme_tier.py's load_chunks)."""
    yield {"start": 0, "end": numel, "master": tier.partition.store.read(key, 0, numel), "state": rows,
           "scalars": scalars}
