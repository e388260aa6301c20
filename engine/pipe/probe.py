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
[Note: a probe that fails] User code that raises in a chunk's probe forward would leave the next
stages waiting for its output: the failing chunk passes `_FAILED` on instead, every later chunk passes
it on without running, and the pipe group then agrees in one all-reduce (one int64, once per probe)
whether any chunk failed. If one did, `ProbeFailed` tells the engine, which runs no schedule for the
batch and lets the world learn of it with the schedule's other failures (stage_failure.py's note).

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

_FAILED = "failed"  # what a chunk whose probe forward raised sends on (module note)


class ProbeFailed(Exception):
    """A chunk's probe forward raised on this pipe group; `error`: this rank's own error, or None."""

    def __init__(self, error: BaseException | None):
        super().__init__("a chunk's probe forward raised")
        self.error = error


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
    carried, failed, error = None, False, None
    with _leaving_no_trace(chunk_modules.values(), device), torch.set_grad_enabled(training):
        for c in range(num_chunks):
            owner = c % num_stages
            if owner != my_stage:
                continue
            mod = chunk_modules[c]
            if c == 0:
                x = first_input
            elif (c - 1) % num_stages != my_stage:
                received = [None]
                dist.recv_object_list(received, src=_peer(group, (c - 1) % num_stages), group=group, device=device)
                failed = failed or received[0] == _FAILED
                if not failed:
                    wire, items = received[0]
                    mod.in_structure, x = Structure.from_wire(wire), _from_wire(items, device, training)
            elif not failed:
                mod.in_structure, x = carried
            if not failed:
                mod.out_structure = None  # the probe's run sets it (engine.py's _ChunkModule)
                try:
                    y = mod(*x)
                    examples[c] = (tuple(x), tuple(y))
                except Exception as err:  # noqa: BLE001 - raised once the pipe group knows (module note)
                    failed, error = True, err
            if c + 1 < num_chunks:
                if (c + 1) % num_stages == my_stage:
                    carried = None if failed else (mod.out_structure, _copy(y, device, training))
                else:
                    dist.send_object_list([_FAILED if failed else _to_wire(mod, y)],
                                          dst=_peer(group, (c + 1) % num_stages), group=group, device=device)
    vote = torch.tensor([1 if error is not None else 0], dtype=torch.int64, device=device)
    if num_stages > 1:  # one stage: no one waits for it
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group)
    if vote.item():
        raise ProbeFailed(error)
    return {c: (_copy(x, device, training), _copy(y, device, training)) for c, (x, y) in examples.items()}
