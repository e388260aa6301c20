"""Example inputs and outputs of every chunk, for torch's stages in static mode.

torch's PipelineStage can infer what a stage receives by running it on placeholder tensors; ours
cannot be run on placeholders, because the first tensor of every boundary is the structure header
(boundary.py), whose bytes must be real. So, for each new input shape, one micro-batch is run once
through the chunks in order (chunk c hands its real output to chunk c+1, on whatever rank holds
it), under a forked RNG so dropout streams are untouched, and every stage is built with those
examples (`input_args`/`output_args`). The cost is one extra forward per distinct input shape.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _peer(group, stage: int) -> int:
    return dist.get_global_rank(group, stage) if group is not None else stage


def _to_wire(flat: tuple) -> list:
    return [(t.detach().cpu(), t.requires_grad) for t in flat]


def _from_wire(items: list, device: torch.device, training: bool) -> tuple:
    out = []
    for t, needs_grad in items:
        t = t.to(device)
        if training and needs_grad:
            t.requires_grad_(True)
        out.append(t)
    return tuple(out)


def chunk_examples(chunk_modules: dict, first_input: tuple | None, num_stages: int, num_chunks: int,
                   group, my_stage: int, device: torch.device, training: bool) -> dict[int, tuple]:
    """{chunk: (example input, example output)} for this rank's chunks (module docstring). Collective
    over the pipe group."""
    examples: dict[int, tuple] = {}
    carried = None
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(training):
        for c in range(num_chunks):
            owner = c % num_stages
            if owner != my_stage:
                continue
            if c == 0:
                x = first_input
            elif (c - 1) % num_stages == my_stage:
                x = carried
            else:
                received = [None]
                dist.recv_object_list(received, src=_peer(group, (c - 1) % num_stages), group=group, device=device)
                x = _from_wire(received[0], device, training)
            y = chunk_modules[c](*x)
            examples[c] = (tuple(x), tuple(y))
            if c + 1 < num_chunks:
                if (c + 1) % num_stages == my_stage:
                    carried = _from_wire(_to_wire(y), device, training)
                else:
                    dist.send_object_list([_to_wire(y)], dst=_peer(group, (c + 1) % num_stages), group=group,
                                          device=device)
    return {c: (_from_wire(_to_wire(x), device, training), _from_wire(_to_wire(y), device, training))
            for c, (x, y) in examples.items()}
