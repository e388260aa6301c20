"""`PipelineEngine`: the engine of a `PipelineModule` (DeepSpeed's `PipelineEngine`).

`train_batch(data_iter)` pulls `gradient_accumulation_steps` micro-batches (first and last stage
both read the iterator: inputs go in at the first, labels to the loss at the last), agrees with the
world that the batch can run (batch_agreement.py: an iterator that ran out stops every rank), runs
them through torch's schedule named by `pipeline.schedule` (schedule.py), then, once per step:
1. tied weights' gradients are summed over their tie group (they stay equal after the step);
2. the ZeRO optimizer of the data axis reduces what the micro-batches accumulated, once
   (stage 0 all-reduce, stages 1/2 reduce-scatter; reduction.py);
3. the gradient norm is agreed over the whole world (reduction.py's note): every stage clips with
   the same norm and skips the same steps;
4. the step, LR schedule and counters, as `Engine.step` at a boundary.
The loss returned — the mean over micro-batches and data-parallel ranks — is the same value on
every stage; it reaches the other stages on the step's norm all-reduce (reduction.py's note), and the
batch's input signature reaches them in the batch's agreement (batch_agreement.py's note), and whether
a stage's user code raised inside the schedule rides on the norm's all-reduce too (stage_failure.py's
notes: every rank raises, none waits for the failed stage's sends; the outcome rides on the norm): per
step a pipeline adds two small collectives to the schedule's own sends (three with several data-parallel
replicas: their data axis agrees on the outcome first; with the optimizer on NVMe the step's status is
gathered over the world: stage_failure.py's note, a step failing on one stage). `forward`/`backward`/`step`
are errors here: the schedule owns them.
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist
from torch.distributed import pipelining as tp
from torch.utils import _pytree as pytree

import schemas

from ..comm import Communicator
from ..engine import Engine
from ..tensor_parallel import collective_ledger as ledger
from . import boundary, zero3
from .batch_agreement import (MIXED_BATCH, READ_FAILED, DataExhausted,  # DataExhausted: its old home, kept
                              DataReadFailed, agree_on_batch)
from .partitioned_wire import PartitionedWire, partitioned
from .probe import ProbeFailed, chunk_examples
from .reduction import LossRider, TiedGradients, WorldNorm, reduce_accumulated
from .schedule import schedule_class
from .stage_failure import (BatchFailed, FailureRecord, agree_on_outcome, failed_in_data_group, raise_failure,
                            substitute_outputs)
from .stage_clock import StageClock, pipeline_idle
from .tensor_peers import TensorPeerStage, ledgered_loss

_CACHE_LIMIT = 8  # distinct input shapes kept built (sequence-length buckets); the oldest is dropped


def _repeating(loader):
    """The loader's epochs one after another (DeepSpeed's RepeatingLoader around the loader it builds);
    each `iter()` of a DistributedDataLoader starts its next epoch. An empty loader ends it."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            return


class _ChunkModule(torch.nn.Module):
    """One chunk of the PipelineModule as torch's stage sees it: flat tensors in, flat tensors out; the
    nest around them is the structure the probe saw (boundary.py's note)."""

    def __init__(self, pipe_module, chunk: int, device: torch.device):
        super().__init__()
        self.layers = torch.nn.ModuleList(f for f in pipe_module._forward_funcs[chunk] if isinstance(f, torch.nn.Module))
        self.tied = torch.nn.ModuleList(f.module for f in pipe_module._forward_funcs[chunk] if hasattr(f, "forward_fn"))
        self.pipe_module, self.chunk, self.device = pipe_module, chunk, device
        self.in_structure: boundary.Structure | None = None
        self.out_structure: boundary.Structure | None = None
        self.out_examples: tuple | None = None  # the probe's outputs: a failed forward's stand-in's shapes
        self.failure: FailureRecord | None = None  # set for each schedule run (stage_failure.py)
        # (phase, input signature) -> the tensor-parallel collectives of a run that did not raise, and the
        # signature of the last forward (tensor_parallel/collective_ledger.py)
        self.ledgers: dict = {}
        groups = pipe_module.process_groups
        self.model_comm = Communicator(groups.model_group) if groups.topology.model > 1 else None
        self.last_signature: tuple = ()

    def forward(self, *tensors):
        self.last_signature = ledger.signature(tensors)
        key = ("forward", self.last_signature)
        probe = self.out_examples is None or self.failure is None  # the probe's run (probe.py)
        with ledger.recording() as posted:
            try:
                with ledger.guarded(self.model_comm if probe else None):  # collective_ledger.py's note
                    out = self.pipe_module.run_chunk(self.chunk, boundary.unflatten(self.in_structure, tensors))
            except Exception as err:  # noqa: BLE001 - kept and raised after the schedule (stage_failure.py's note)
                if probe:  # no shapes to stand in yet
                    raise
                self.failure.keep(err)
                ledger.post_rest(self.ledgers.get(key), len(posted))  # for the tensor peers (ledger's note)
                return substitute_outputs(self.out_examples, tensors, self.parameters())
        self.ledgers[key] = posted
        structure, flat = boundary.flatten(out)
        if self.out_structure is None:  # the probe's run (probe.py)
            self.out_structure = structure
        elif structure != self.out_structure:
            raise ValueError(f"pipeline chunk {self.chunk} returned a different nest or constants than it did for "
                             f"the same input shapes ({structure.to_wire()} vs {self.out_structure.to_wire()}); "
                             "what a stage passes on may depend on the input's shapes, not on its values")
        # An output that is a view (nn.Linear on a 3-d activation returns one) cannot be detached in place,
        # which torch's zero-bubble input-gradient backward does to every stage output: re-aliased without
        # the view relation (no copy; the gradient flows through as through the view).
        return type(flat)(torch.ops.aten._unsafe_view(t, t.shape) if isinstance(t, torch.Tensor) and t._is_view()
                          and t.requires_grad else t for t in flat)


class PipelineEngine(Engine):
    def __init__(self, module, zero_optimizer, lr_scheduler, dataloader, config, comm):
        super().__init__(module, zero_optimizer, lr_scheduler, dataloader, config, comm)
        groups = module.process_groups
        self.groups = groups
        self.pipe_comm = Communicator(groups.pipe_group)
        self._world_comm = Communicator(None)  # the topology's world: every batch's agreement (batch_agreement.py)
        self.stage_id = groups.coord.pipe
        self.num_stages = module.num_stages
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.num_stages - 1
        self.schedule_name = config.pipeline.schedule
        self._pipe_backend = dist.get_backend(groups.pipe_group) if dist.is_initialized() else None
        self._schedule_cls, self._multi = schedule_class(self.schedule_name, module.virtual_stages, self._pipe_backend)
        self.tied = TiedGradients(module, groups, comm)
        self.loss_rider = LossRider()
        # pipeline.pipe_partitioned / grad_partitioned: slices over the model axis (partitioned_wire.py)
        self._model_comm = (Communicator(groups.model_group) if partitioned(config.pipeline, groups.topology.model)
                            else None)
        if zero_optimizer is not None:
            if getattr(zero_optimizer, "self_communicating", False):  # as with tensor parallel (its norm.py)
                name = type(zero_optimizer.optimizer).__name__
                raise schemas.ConfigError([f"optimizer.type: {name} (a 1-bit optimizer) with a pipeline is not built "
                                           "yet in dstrain: its compressed steps agree the norm and overflow over "
                                           "the data axis only, so stages would clip and skip apart; use Adam, "
                                           "AdamW or SGD"])
            model_parallel = Communicator(groups.model_parallel_group)
            zero_optimizer.norm_reduce = WorldNorm(model_parallel, self.tied, self.loss_rider)
            # a step failing on one rank fails on every stage (stage_failure.py's note: a step failing on one stage)
            zero_optimizer.step_status_comm = self._world_comm
        self._built: dict[tuple, tuple] = {}
        self._fingerprints: dict[tuple, int] = {}  # input signature -> its broadcast key (first stage)
        self._data_iterator = None
        self._sent_bytes = {"forward": 0, "backward": 0}  # what the stages sent (boundary_bytes)
        self._actions: list[tuple] = []  # what this rank's stages ran in the last batch (schedule.py)
        self._clock = StageClock(self.device)  # the last batch's span and computations (stage_clock.py)
        self._last_chunk = None  # the last chunk's module on the last stage (its out_structure feeds the loss)
        self._loss_factor = 1.0  # set per batch: the fp16 loss scale / micro-batches (see _loss)
        self._failure = FailureRecord()  # user code's error in this batch's schedule (stage_failure.py)

    # -- the schedule ---------------------------------------------------------------------------
    def _schedule_for(self, key: int, training: bool, m: int, first_input):
        """(stages, schedule, chunk modules) built for batches of signature `key`; built (and probed,
        probe.py) the first time `key` is seen. `first_input`: (structure, tensors) on the first stage."""
        entry = self._built.get((key, training, m))
        if entry is None:
            if len(self._built) >= _CACHE_LIMIT:
                self._built.pop(next(iter(self._built)))
            pm = self.module
            chunks = pm.num_stages * pm.virtual_stages
            mods = {c: _ChunkModule(pm, c, self.device) for c in pm.chunk_ids}
            if first_input is not None:
                mods[0].in_structure = first_input[0]
            examples = chunk_examples(mods, first_input[1] if first_input else None, pm.num_stages, chunks,
                                      self.groups.pipe_group, self.stage_id, self.device, training)
            stages = [self._stage(mods[c], c, chunks, *examples[c]) for c in pm.chunk_ids]
            cls = self._schedule_cls
            if cls is tp.Schedule1F1B and m < pm.num_stages:
                cls = tp.ScheduleGPipe  # with fewer micro-batches than stages 1F1B's order is GPipe's
            try:
                sched = cls(stages if self._multi else stages[0], n_microbatches=m, loss_fn=self._loss,
                            scale_grads=False)
            except ValueError as err:
                raise ValueError(f"pipeline.schedule: {self.schedule_name!r} with gradient_accumulation_steps={m} "
                                 f"on {pm.num_stages} stages: {err}") from None
            sched._has_backward = training  # eval: the same schedule, forward actions only
            entry = (stages, sched, mods)
            self._built[(key, training, m)] = entry
        return entry

    def _stage(self, mod, chunk: int, chunks: int, inputs: tuple, outputs: tuple) -> TensorPeerStage:
        """torch's stage of one chunk, built from the probe's examples; with partitioned boundaries its
        receive buffers are slices (partitioned_wire.py)."""
        wire, examples = None, {"input_args": inputs, "output_args": outputs}
        mod.out_examples = outputs
        if self._model_comm is not None:
            pipe = self.config.pipeline
            wire = PartitionedWire(self._model_comm, pipe.pipe_partitioned, pipe.grad_partitioned)
            examples = wire.buffer_examples(inputs, outputs, receives=chunk > 0, sends=chunk < chunks - 1)
        return TensorPeerStage(mod, chunk, chunks, self.device, **examples, group=self.groups.pipe_group,
                           action_log=self._actions, sent_bytes=self._sent_bytes, clock=self._clock, wire=wire,
                           early_receives=not self._multi and self._pipe_backend == "gloo")  # early_receive.py

    def _loss(self, flat_output, labels):
        """torch's loss hook on the last stage: the user's loss of the rebuilt output, divided by the
        micro-batch count (the mean over micro-batches) and times the fp16 loss scale when training."""
        chunk = self._last_chunk
        with self._clock.busy():  # its own collectives (vocab-parallel CE) recorded for the tensor peers
            loss = ledgered_loss(chunk, self._failure, flat_output, lambda: self.module.loss_fn(
                boundary.unflatten(chunk.out_structure, tuple(flat_output)), labels))
        return loss * self._loss_factor if self._loss_factor != 1.0 else loss

    def _pull(self, data_iter, m: int):
        """m micro-batches on the first and last stage, all before the schedule starts: ((structure,
        tensors) of each input on the first stage, else None; labels on the last, else None; None, or how
        many micro-batches there were when the iterator ran out: every rank learns it, _next_batch)."""
        if not (self.is_first_stage or self.is_last_stage):
            return None, None, None
        if data_iter is None:
            if self.training_dataloader is None:
                raise RuntimeError("engine.train_batch() needs a data_iter, or training_data= in engine.initialize()")
            if self._data_iterator is None:
                self._data_iterator = _repeating(self.training_dataloader)
            data_iter = self._data_iterator
        inputs, labels = [], []
        for pulled in range(m):
            try:
                batch = next(data_iter)
            except StopIteration:
                return None, None, pulled
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise TypeError("a pipeline's data iterator yields (inputs, labels) pairs, as DeepSpeed's does; "
                                f"got {type(batch).__name__}")
            x, y = pytree.tree_map(lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t, tuple(batch))
            if self.is_first_stage:
                inputs.append(boundary.flatten(x))
            labels.append(y)
        return (inputs if self.is_first_stage else None), labels, None

    def _fingerprint(self, signature) -> int:
        """boundary.fingerprint, once per distinct signature (it serialises the structure)."""
        value = self._fingerprints.get(signature)
        if value is None:
            if len(self._fingerprints) >= _CACHE_LIMIT:
                self._fingerprints.pop(next(iter(self._fingerprints)))
            value = self._fingerprints[signature] = boundary.fingerprint(signature)
        return value

    def _batch_key(self, inputs, short: int | None) -> int | None:
        """This first stage's key of the batch (its input signature, boundary.py's note), None elsewhere;
        agreed with the world in _next_batch, so it is the same on every stage of this pipe group."""
        if not (self.is_first_stage and short is None):
            return None
        signatures = {boundary.signature(*x) for x in inputs}
        return self._fingerprint(signatures.pop()) if len(signatures) == 1 else MIXED_BATCH

    def _next_batch(self, data_iter, m: int) -> tuple:
        """(key, inputs, labels) of the next batch, or DataExhausted on every rank (nothing changed yet).
        A reader whose iterator raises, or whose batch has no key (a namedtuple's tree spec cannot be
        serialised), tells the world first, which would otherwise wait for it (batch_agreement.py's note)."""
        try:
            inputs, labels, short = self._pull(data_iter, m)
            key = self._batch_key(inputs, short)
        except Exception:
            try:
                agree_on_batch(self._world_comm, self.groups, None, READ_FAILED, m)
            except DataReadFailed:
                pass  # the others raise that; this rank its own error
            raise
        return agree_on_batch(self._world_comm, self.groups, key, short, m), inputs, labels

    def _run(self, batch: tuple, training: bool):
        key, inputs, labels = batch
        m = self.config.gradient_accumulation_steps
        self._failure = FailureRecord()
        try:
            stages, sched, mods = self._schedule_for(key, training, m, inputs[0] if self.is_first_stage else None)
        except ProbeFailed as failed:  # no schedule for this batch; the world learns of it after (probe.py)
            if failed.error is not None:
                self._failure.keep(failed.error)
            self._failure.no_schedule = True
            return [], []
        self._last_chunk = mods.get(self.module.num_stages * self.module.virtual_stages - 1)
        self._actions.clear()
        for mod in mods.values():
            mod.failure = self._failure
        for st in stages:
            st.has_backward = training
            st.clear_runtime_states()
        losses: list = []
        self._clock.start_step()
        sched._step_microbatches([x for _, x in inputs] if self.is_first_stage else None, None,
                                 labels if self.is_last_stage else None, losses if self.is_last_stage else None)
        self._clock.stop_step()
        return stages, losses

    def _stage_loss(self, losses: list) -> torch.Tensor:
        """The mean over micro-batches and data-parallel ranks on the last stage; zeros elsewhere."""
        loss = self.comm.zeros()
        if self.is_last_stage:
            loss += torch.stack([l.detach().float() for l in losses]).sum() / self._loss_factor / len(losses)
            self.comm.all_reduce(loss)
            loss /= self.comm.world_size
        return loss

    def _broadcast_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.num_stages > 1:
            self.pipe_comm.broadcast(loss, src=self.num_stages - 1)
        return loss

    def boundary_bytes(self) -> dict[str, int]:
        """Bytes this rank's stages sent to neighbouring stages so far: activations "forward", gradients
        "backward" (the probe's one-off objects not counted)."""
        return dict(self._sent_bytes)

    def schedule_actions(self) -> dict[int, list[tuple]]:
        """Every stage's executed actions of the last batch, {pipe rank: [(kind, stage, mb), ...]}
        (collective over the pipe group; for `schedule.idle_fractions`)."""
        return dict(enumerate(self.pipe_comm.all_gather_object(list(self._actions))))

    def stage_idle_fraction(self) -> float:
        """This rank's measured idle fraction of the last batch over its own schedule run (no collective;
        shorter than the pipeline's span on all but the last rank to finish: stage_clock.py's note)."""
        return self._clock.idle_fraction()

    def idle_record(self) -> tuple[str, tuple[float, float], float]:
        """This rank's (host, (start, end) of its schedule run, seconds computing) of the last batch: what
        `stage_clock.pipeline_idle` takes from every stage (no collective: gather them when convenient)."""
        return socket.gethostname(), self._clock.edges(), self._clock.busy_seconds()

    def measured_idle(self) -> dict[int, float]:
        """Every stage's measured idle fraction of the last batch over the pipeline's span (the first
        start to the last end over the stages: the bubble formula's quantity, stage_clock.py's note),
        {pipe rank: fraction} (collective over the pipe group; never on the step's path)."""
        return dict(enumerate(pipeline_idle(self.pipe_comm.all_gather_object(self.idle_record()))))

    # -- the public API -------------------------------------------------------------------------
    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One optimizer step over gradient_accumulation_steps micro-batches; returns the mean loss."""
        self._require_optimizer("train_batch")
        m = self.config.gradient_accumulation_steps
        batch = self._next_batch(data_iter, m)  # first: an iterator that ran out leaves every state as it was
        self.module.train()
        self._loss_factor = self.zero_optimizer.guard.scaler.loss_scale / m
        self.timers.start("forward")  # the schedule interleaves forward and backward: one timer
        held = zero3.hold(self.zero_optimizer)  # ZeRO-3: gathered once for all m micro-batches (zero3.py's note)
        _, losses = self._run(batch, training=True)
        if held is not None:  # a parameter read failed: this stage's failure (zero3.hold)
            self._failure.keep(held)
        self.timers.stop("forward")
        try:
            return self._reduce_and_step(losses, m)
        except BatchFailed:  # a stage failed: every rank drops the batch (stage_failure.py's note) ...
            self._drop_batch()
        raise_failure(self._world_comm, self.groups, self._failure)  # ... and raises (outside the except: no
        raise AssertionError("unreachable")  # BatchFailed chained to the user's error)

    def _drop_batch(self) -> None:
        """The batch leaves nothing behind: its gradients, ZeRO-3's gathered parameters, the loss riding."""
        self.loss_rider.load(None, contributes=False)
        self.zero_optimizer.zero_grad()
        zero3.release(self.zero_optimizer)

    def _reduce_and_step(self, losses: list, m: int) -> torch.Tensor:
        """After the schedule: tied gradients, the data axis's reduction, the world's norm (carrying the loss
        and the batch's outcome) and the step; BatchFailed before any of it is applied when a stage failed
        (stage_failure.py's note: the outcome rides on the norm)."""
        if self.zero_optimizer.reductions_keep_state:  # stage_failure.py's note: PowerSGD's error feedback
            try:
                agree_on_outcome(self._world_comm, self.groups, self._failure)  # raises on every rank if failed
            except Exception:
                self._drop_batch()
                raise
            known = False
        else:
            known = failed_in_data_group(self.comm, self._failure)
        self.timers.start("allreduce")
        self.tied.all_reduce_grads(self.zero_optimizer)  # tie groups span data groups: posted either way
        if known:  # the data axis's reductions and the step are this data group's alone: skipped
            self.zero_optimizer.norm_reduce.post_failure()
        self.tied.measure_duplicates(self.zero_optimizer, self.zero_optimizer.guard.scaler.loss_scale)
        reduce_accumulated(self.zero_optimizer)
        zero3.release(self.zero_optimizer)
        self.timers.stop("allreduce")
        # the loss reaches every stage on the step's norm all-reduce (reduction.py's note)
        loss = self._stage_loss(losses)
        self.loss_rider.load(loss, contributes=self.is_last_stage and self.groups.coord.model == 0)
        previous, self._last_loss = self._last_loss, loss  # the step's log line reads it, once agreed
        steps = self.global_steps
        try:
            self.micro_steps += m - 1
            self._boundary_step()
        except Exception:
            if self.global_steps == steps:  # the step raised (BatchFailed in the norm's all-reduce, or a step
                self.micro_steps -= m - 1  # failed on some rank: stage_failure.py's notes): it moved only these
                self._last_loss = previous
            raise
        self.micro_steps += 1
        if self.loss_rider.loss is not None:  # the optimizer reduced no norm: send the loss on its own
            self.loss_rider.loss = None
            self._broadcast_loss(self._last_loss)
        return self._last_loss

    @torch.no_grad()
    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str = "avg"):
        """Forward only over gradient_accumulation_steps micro-batches; the mean loss on every stage
        (and, with return_logits, the last stage's outputs per micro-batch; None elsewhere)."""
        self._offloaded.require_for_forward("eval_batch")  # before the batch's agreement: every rank raises
        batch = self._next_batch(data_iter, self.config.gradient_accumulation_steps)
        self.module.eval()
        self._loss_factor = 1.0 / self.config.gradient_accumulation_steps
        held = zero3.hold(self.zero_optimizer)
        try:
            stages, losses = self._run(batch, training=False)
            if held is not None:  # as train_batch's
                self._failure.keep(held)
            agree_on_outcome(self._world_comm, self.groups, self._failure)
        finally:
            zero3.release(self.zero_optimizer)
        loss = self._broadcast_loss(self._stage_loss(losses)) if compute_loss else None
        if reduce_output is None and compute_loss and self.is_last_stage:
            loss = [l.detach() / self._loss_factor for l in losses]
        if not return_logits:
            return loss
        outputs = ([boundary.unflatten(self._last_chunk.out_structure, tuple(o)) for o in stages[-1].output_chunks]
                   if self.is_last_stage else None)
        return loss, outputs

    def forward(self, *args, **kwargs):
        raise RuntimeError("engine.forward() is not used with a PipelineModule: call engine.train_batch(data_iter) "
                           "(or engine.eval_batch(data_iter)); the schedule runs forward and backward itself")

    def backward(self, *args, **kwargs):
        raise RuntimeError("engine.backward() is not used with a PipelineModule: call engine.train_batch(data_iter)")

    def step(self, *args, **kwargs):
        raise RuntimeError("engine.step() is not used with a PipelineModule: engine.train_batch(data_iter) steps")

    def is_gradient_accumulation_boundary(self) -> bool:
        return True  # a train_batch is always a whole accumulation window

