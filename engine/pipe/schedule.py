"""Pipeline schedules by our key `pipeline.schedule`, and their bubble accounting.

| key | torch class | stages per rank | bubble (p stages, m micro-batches) |
|---|---|---|---|
| "1f1b" (default) | Schedule1F1B | 1 | (p−1)/(m+p−1); holds ≤ p micro-batches of activations |
| "eager_1f1b" | eager_1f1b.py's Eager1F1B (gloo only) | 1 | (p−1)/(m+p−1), no round trip per micro-batch; holds ≤ 2(p−s)−1 on stage s |
| "zb_h1" | zb_h1.py's ZeroBubbleH1 | 1 | (p−1)/(3m+p−1) for m ≥ p (zb_h1.py: weight gradients fill the drain); holds ≤ p |
| "gpipe" | ScheduleGPipe | 1 | (p−1)/(m+p−1); holds m |
| "interleaved_1f1b" | ScheduleInterleaved1F1B | V ≥ 2 | (p−1)/(V·m+p−1) |
| "zero_bubble" | ScheduleInterleavedZeroBubble | V ≥ 2 | below interleaved: weight gradients fill the bubble |

`idle_fractions` replays the actions the stages executed (`LoggedStage` records every forward,
backward, input-gradient and weight-gradient call torch's runtime makes, in order; torch's own
`pipeline_order` of Schedule1F1B is a drawing that differs from what it runs) on a unit-cost clock —
forward 1, full backward 2, input-gradient and weight-gradient halves 1 each, all divided by the
chunks per rank — where an action starts once its rank is free and its data has arrived (the previous
stage's forward, the next stage's input gradient). The idle fraction of a rank is its idle time over
the makespan. Counting slots, not wall time, makes the number a property of the schedule, which is
what the formula describes. The same fraction measured in wall-clock time is stage_clock.py's.
"""
from __future__ import annotations

from torch.distributed import pipelining as tp

from .eager_1f1b import Eager1F1B
from .early_receive import EarlyReceives
from .stage_failure import skipped_backward
from .zb_h1 import ZeroBubbleH1, zb_h1_bubble

SCHEDULES = {
    "1f1b": (tp.Schedule1F1B, False),
    "eager_1f1b": (Eager1F1B, False),
    "zb_h1": (ZeroBubbleH1, False),
    "gpipe": (tp.ScheduleGPipe, False),
    "interleaved_1f1b": (tp.ScheduleInterleaved1F1B, True),
    "zero_bubble": (tp.ScheduleInterleavedZeroBubble, True),
}


def schedule_class(name: str, virtual_stages: int, backend: str | None):
    """The torch schedule for `pipeline.schedule: name` on the pipe group's `backend`; a mismatch with the
    model or the backend is a one-line error."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline.schedule: {name!r} is not a schedule; use one of {', '.join(SCHEDULES)}")
    if name == "eager_1f1b" and backend not in (None, "gloo"):
        raise ValueError(f"pipeline.schedule: \"eager_1f1b\" runs on gloo only (engine/pipe/eager_1f1b.py's note: "
                         f"on {backend} its early sends would deadlock against the next stage's); use \"1f1b\"")
    cls, multi = SCHEDULES[name]
    if multi and virtual_stages < 2:
        raise ValueError(f"pipeline.schedule: {name!r} runs several stages per rank; build the model with "
                         "PipelineModule(..., virtual_stages=2) (or more), or use \"1f1b\"")
    if not multi and virtual_stages != 1:
        raise ValueError(f"pipeline.schedule: {name!r} runs one stage per rank, but the PipelineModule has "
                         f"virtual_stages={virtual_stages}; use \"interleaved_1f1b\" or \"zero_bubble\"")
    return cls, multi


def formula_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The textbook bubble of `name` (the table above); zero-bubble's is bounded by interleaved's."""
    if name in ("1f1b", "eager_1f1b", "gpipe"):
        return (p - 1) / (m + p - 1)
    if name == "zb_h1":
        return zb_h1_bubble(p, m)
    return (p - 1) / (v * m + p - 1)


_COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def _p2p_bytes(ops) -> int:
    return sum(op.tensor.numel() * op.tensor.element_size() for op in ops)


# The partitioned wire hooks torch's stage where it sends (get_*_send_ops) and where it takes what it
# received (two private methods). If a torch release renamed one, its override would never run and the
# stage would compute on slices; so a wire refuses to start without them.
_WIRE_HOOKS = ("get_fwd_send_ops", "get_bwd_send_ops", "_retrieve_recv_activations", "_retrieve_recv_grads")


def _check_wire_hooks() -> None:
    import torch
    for name in _WIRE_HOOKS:
        if not callable(getattr(tp.PipelineStage, name, None)):
            raise RuntimeError(f"pipeline.pipe_partitioned / grad_partitioned need torch's PipelineStage.{name}, "
                               f"which torch {torch.__version__} does not have (written against torch 2.13): "
                               "set both keys to false, or use torch 2.13")


class LoggedStage(tp.PipelineStage):
    """torch's PipelineStage, recording each computation it runs as (kind, stage, micro-batch), timing it
    on the rank's `clock` (stage_clock.py: the measured bubble), and counting the bytes it sends to the
    neighbouring stages (into `sent_bytes`: activations "forward", gradients "backward"). With a `wire`
    (partitioned_wire.py) what it sends and receives in each direction is this tensor rank's slice."""

    def __init__(self, *args, action_log: list, sent_bytes: dict, clock, wire=None, early_receives=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.action_log = action_log
        self.sent_bytes = sent_bytes
        self.clock = clock
        self.wire = wire
        if wire is not None:
            _check_wire_hooks()
        self.early = EarlyReceives(self) if early_receives else None

    def clear_runtime_states(self) -> None:
        super().clear_runtime_states()
        if self.early is not None:
            self.early.start_step()

    def get_fwd_recv_ops(self, fwd_chunk_id):
        if self.early is not None and self.early.posted("forward", fwd_chunk_id):
            return []  # already posted (early_receive.py); forward_one_chunk waits for it
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id):
        if self.early is not None and self.early.posted("backward", bwd_chunk_id):
            return []
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if self.wire is not None:
            ops = self.wire.outgoing(ops, self.wire.activations_sent)
        self.sent_bytes["forward"] += _p2p_bytes(ops)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        if self.wire is not None:
            ops = self.wire.outgoing(ops, self.wire.gradients_sent)
        self.sent_bytes["backward"] += _p2p_bytes(ops)
        release_input_grads(self.args_recv_info.get(bwd_chunk_id, ()))
        return ops

    def _retrieve_recv_activations(self, fwd_chunk_id):
        received = super()._retrieve_recv_activations(fwd_chunk_id)
        return received if self.wire is None else self.wire.activations_in(received)

    def _retrieve_recv_grads(self, bwd_chunk_id):
        received = super()._retrieve_recv_grads(bwd_chunk_id)
        return received if self.wire is None else self.wire.gradients_in(received)

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        if self.has_backward:  # [Note: what a training step releases]
            kwargs["save_forward_output"] = False
        self.action_log.append(("F", self.stage_index, fwd_chunk_id))
        if self.early is not None and not self.is_first:
            self.early.arrived("forward", fwd_chunk_id)  # outside the clock: waiting is not computing
        with self.clock.busy():
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        if self.has_backward:
            self.action_log.append(("B" if full_backward else "I", self.stage_index, bwd_chunk_id))
            if self.early is not None and not self.is_last:
                self.early.arrived("backward", bwd_chunk_id)
        with self.clock.busy():
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                              last_backward=last_backward)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        """torch's one entry into autograd for this stage: user code that raises there is kept, and the
        stage sends zero gradients on (stage_failure.py's note: a failing backward)."""
        failure = getattr(self.submod, "failure", None)
        if failure is not None and failure.in_backward:
            return skipped_backward(bwd_kwargs)
        try:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        except Exception as err:  # noqa: BLE001 - kept and raised after the schedule (stage_failure.py)
            if failure is None:
                raise
            failure.keep_backward(err)
            return skipped_backward(bwd_kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        if self.has_backward:
            self.action_log.append(("W", self.stage_index, bwd_chunk_id))
        state = self.backward_state.get(bwd_chunk_id) if self.stage_index != 0 else None
        nodes = list(dict.fromkeys(node for group in (state[1] or ()) for node in group["params"])) \
            if state is not None else []  # each parameter once, in torch's order
        with self.clock.busy():
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            _after_accumulation(nodes)


def _after_accumulation(nodes: list) -> None:
    """[Note: the weight half's hooks] torch's weight-gradient half (`stage_backward_weight`, the split
    backward of "zb_h1" and "zero_bubble") computes the gradients with autograd.grad and assigns `.grad`
    itself, so the parameters' post-accumulate-grad hooks never run there, and the engine's are where it
    takes a gradient: into an fp32 accumulation buffer (`data_types.grad_accum_dtype`: the update was
    lost), into ZeRO's partitions, and into the arrival log (`ignore_unused_parameters: false` said the
    parameters got no gradient). They run here, once per parameter whose AccumulateGrad node was in the
    micro-batch's weight groups (`nodes`: each node's `variable` is its parameter), as AccumulateGrad
    would have run them. Stage index 0 is skipped by the caller: torch runs a whole backward there,
    through AccumulateGrad. The hooks' registry (a Tensor attribute) and the weight groups' place in the
    stage's `backward_state` are private to torch 2.13; `tests/test_pipeline_zb_h1_compose.py` fails if
    either moves (no hook would run)."""
    for node in nodes:
        p = node.variable
        if p.grad is not None:
            for hook in tuple((getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()):
                hook(p)


def release_input_grads(recv_infos) -> None:
    """[Note: what a training step releases] torch's stage keeps, per micro-batch, until the next step's
    `clear_runtime_states`: on the last stage each output (`output_chunks`, for `step()`'s merged return,
    which train_batch never reads; eval_batch's return_logits does, so only training drops them), and
    after the zero-bubble schedule's input-gradient backward the gradient of each received activation
    (the receive buffer's `.grad`; torch's full backward drops it itself): m activation-sized tensors a
    stage held between steps for nothing (docs/pipeline_measurements.md, 2026-12-07: what it did not
    change is the page faults per step, which follow glibc's heap, not these). The gradient is dropped
    once its send op is built: the op, and the work posting it returns, hold the tensor until the
    transport has read it (gloo's send work keeps it; NCCL's records it on its stream), so dropping this
    reference frees nothing early, and the next micro-batch's gradient is a tensor of its own."""
    for info in recv_infos:
        buffer = None if getattr(info, "is_root_arg", True) else info.buffer
        if buffer is not None:
            buffer.grad = None


def idle_fractions(actions: dict[int, list[tuple]], num_chunks: int) -> dict[int, float]:
    """Idle fraction per rank of the executed actions {rank: [(kind, stage, mb), ...]} (module docstring)."""
    per_rank_chunks = num_chunks / len(actions)
    done: dict[tuple, float] = {}  # (kind, stage, microbatch) -> finish time
    queues = {r: list(acts) for r, acts in actions.items()}
    clock = {r: 0.0 for r in queues}
    busy = {r: 0.0 for r in queues}
    last = num_chunks - 1
    while any(queues.values()):
        progressed = False
        for r, queue in queues.items():
            while queue:
                kind, s, mb = queue[0]
                needs = []
                if kind == "F" and s > 0:
                    needs.append(("F", s - 1, mb))
                if kind in ("B", "I"):
                    needs.append(("F", s, mb))
                    if s < last:
                        needs.append(("I", s + 1, mb))
                if kind == "W":
                    needs.append(("I", s, mb))
                if any(n not in done for n in needs):
                    break
                cost = _COST[kind] / per_rank_chunks
                start = max([clock[r]] + [done[n] for n in needs])
                clock[r] = start + cost
                busy[r] += cost
                done[(kind, s, mb)] = clock[r]
                if kind == "B":  # a full backward also produces the input gradient
                    done[("I", s, mb)] = clock[r]
                queue.pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError("schedule replay stalled: the action lists wait on each other")
    makespan = max(clock.values())
    return {r: 1.0 - busy[r] / makespan for r in queues}
