"""Example inputs and outputs of every chunk, for torch's stages in static mode, and the structure
(boundary.py) of what each chunk receives and produces.

torch's PipelineStage can infer what a stage receives by running it on placeholder tensors; ours
cannot be, because rebuilding the nest a chunk's layers expect needs the structure the previous
chunk produced, which only a real run tells. So, for each new input signature, one micro-batch is
run once through the chunks in order (chunk c hands its real output and its structure to chunk c+1,
on whatever rank holds it); every chunk keeps
the structures it saw (`in_structure`, `out_structure`) and every stage is built with the examples
(`input_args`/`output_args`: whole tensors; partitioned_wire.py slices them for the receive buffers).
The cost is one extra forward per distinct input signature.

[Note: the probe leaves no trace] The probe's forward is not a training step, so nothing it could
change may stay changed: the default RNG (dropout) is forked, the model-parallel RNG streams
(`engine.checkpointing.get_cuda_rng_tracker`) and every module buffer (BatchNorm's running statistics
and `num_batches_tracked`, spectral norm's vectors, quantisation observers) are put back as they were.
A probe runs again for every new signature and after the cache dropped one (engine.py), so without
this the statistics would depend on how often shapes changed, not on the micro-batches trained.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..activation_checkpointing.rng import get_cuda_rng_tracker
from .boundary import Structure


def _peer(group, stage: int) -> int:
    return dist.get_global_rank(group, stage) if group is not None else stage


def _tensors_to_wire(flat: tuple) -> list:
    return [(t.detach().cpu(), t.requires_grad) for t in flat]


def _to_wire(mod, flat: tuple) -> tuple:
    return mod.out_structure.to_wire(), _tensors_to_wire(flat)


def _from_wire(items: list, device: torch.device, training: bool) -> tuple:
    out = []
    for t, needs_grad in items:
        t = t.to(device)
        if training and needs_grad:
            t.requires_grad_(True)
        out.append(t)
    return tuple(out)


def _copy(flat: tuple, device: torch.device, training: bool) -> tuple:
    return _from_wire(_tensors_to_wire(flat), device, training)


@contextlib.contextmanager
def _leaving_no_trace(modules, device: torch.device):
    """Everything the probe's forward could change, restored on exit (module note)."""
    buffers = list({id(b): b for m in modules for b in m.buffers()}.values())  # tied modules appear twice
    saved = [b.detach().clone() for b in buffers]
    tracker = get_cuda_rng_tracker()
    streams = tracker.get_states()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        tracker.set_states(streams)
        with torch.no_grad():
            for b, value in zip(buffers, saved):
                b.copy_(value)


def chunk_examples(chunk_modules: dict, first_input: tuple | None, num_stages: int, num_chunks: int,
                   group, my_stage: int, device: torch.device, training: bool) -> dict[int, tuple]:
    """{chunk: (example input, example output)} for this rank's chunks (module docstring); chunk 0's
    `in_structure` must be set by the caller. Collective over the pipe group."""
    examples: dict[int, tuple] = {}
    carried = None
    with _leaving_no_trace(chunk_modules.values(), device), torch.set_grad_enabled(training):
        for c in range(num_chunks):
            owner = c % num_stages
            if owner != my_stage:
                continue
            mod = chunk_modules[c]
            if c == 0:
                x = first_input
            elif (c - 1) % num_stages == my_stage:
                mod.in_structure, x = carried
            else:
                received = [None]
                dist.recv_object_list(received, src=_peer(group, (c - 1) % num_stages), group=group, device=device)
                wire, items = received[0]
                mod.in_structure, x = Structure.from_wire(wire), _from_wire(items, device, training)
            mod.out_structure = None  # the probe's run sets it (engine.py's _ChunkModule)
            y = mod(*x)
            examples[c] = (tuple(x), tuple(y))
            if c + 1 < num_chunks:
                if (c + 1) % num_stages == my_stage:
                    carried = (mod.out_structure, _copy(y, device, training))
                else:
                    dist.send_object_list([_to_wire(mod, y)], dst=_peer(group, (c + 1) % num_stages),
                                          group=group, device=device)
    return {c: (_copy(x, device, training), _copy(y, device, training)) for c, (x, y) in examples.items()}
