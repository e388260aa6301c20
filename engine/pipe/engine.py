"""`PipelineEngine`: the engine of a `PipelineModule` (DeepSpeed's `PipelineEngine`).

`train_batch(data_iter)` pulls `gradient_accumulation_steps` micro-batches (first and last stage
both read the iterator: inputs go in at the first, labels to the loss at the last), runs them
through torch's schedule named by `pipeline.schedule` (schedule.py), then, once per step:
1. tied weights' gradients are summed over their tie group (they stay equal after the step);
2. the ZeRO optimizer of the data axis reduces what the micro-batches accumulated, once
   (stage 0 all-reduce, stages 1/2 reduce-scatter; reduction.py);
3. the gradient norm is agreed over the whole world (reduction.py's note): every stage clips with
   the same norm and skips the same steps;
4. the step, LR schedule and counters, as `Engine.step` at a boundary.
The loss returned — the mean over micro-batches and data-parallel ranks — is the same tensor on
every stage. `forward`/`backward`/`step` are errors here: the schedule owns them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import pipelining as tp
from torch.utils import _pytree as pytree

from ..comm import Communicator
from ..engine import Engine
from . import boundary
from .probe import chunk_examples
from .reduction import TiedGradients, agree_norm_over_world, reduce_accumulated
from .schedule import LoggedStage, schedule_class

_CACHE_LIMIT = 8  # distinct input shapes kept built (sequence-length buckets); the oldest is dropped


class _ChunkModule(torch.nn.Module):
    """One chunk of the PipelineModule as torch's stage sees it: flat tensors in, flat tensors out."""

    def __init__(self, pipe_module, chunk: int, device: torch.device):
        super().__init__()
        self.layers = torch.nn.ModuleList(f for f in pipe_module._forward_funcs[chunk] if isinstance(f, torch.nn.Module))
        self.tied = torch.nn.ModuleList(f.module for f in pipe_module._forward_funcs[chunk] if hasattr(f, "forward_fn"))
        self.pipe_module, self.chunk, self.device = pipe_module, chunk, device

    def forward(self, *flat):
        return boundary.flatten(self.pipe_module.run_chunk(self.chunk, boundary.unflatten(flat)), self.device)


class PipelineEngine(Engine):
    def __init__(self, module, zero_optimizer, lr_scheduler, dataloader, config, comm):
        super().__init__(module, zero_optimizer, lr_scheduler, dataloader, config, comm)
        groups = module.process_groups
        self.groups = groups
        self.pipe_comm = Communicator(groups.pipe_group)
        self.stage_id = groups.coord.pipe
        self.num_stages = module.num_stages
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.num_stages - 1
        self.schedule_name = config.pipeline.schedule
        self._schedule_cls, self._multi = schedule_class(self.schedule_name, module.virtual_stages)
        self.tied = TiedGradients(module, groups, comm)
        if zero_optimizer is not None:
            zero_optimizer.norm_reduce = agree_norm_over_world(Communicator(groups.model_parallel_group), self.tied)
        self._built: dict[tuple, tuple] = {}
        self._data_iterator = None
        self._actions: list[tuple] = []  # what this rank's stages ran in the last batch (schedule.py)
        self._loss_factor = 1.0  # set per batch: the fp16 loss scale / micro-batches (see _loss)

    # -- the schedule ---------------------------------------------------------------------------
    def _schedule_for(self, key: tuple, training: bool, m: int, first_input):
        entry = self._built.get((key, training, m))
        if entry is None:
            if len(self._built) >= _CACHE_LIMIT:
                self._built.pop(next(iter(self._built)))
            pm = self.module
            chunks = pm.num_stages * pm.virtual_stages
            mods = {c: _ChunkModule(pm, c, self.device) for c in pm.chunk_ids}
            examples = chunk_examples(mods, first_input, pm.num_stages, chunks, self.groups.pipe_group,
                                      self.stage_id, self.device, training)
            stages = [LoggedStage(mods[c], c, chunks, self.device, input_args=examples[c][0],
                                  output_args=examples[c][1], group=self.groups.pipe_group, action_log=self._actions)
                      for c in pm.chunk_ids]
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
            entry = (stages, sched)
            self._built[(key, training, m)] = entry
        return entry

    def _loss(self, flat_output, labels):
        """torch's loss hook on the last stage: the user's loss of the rebuilt output, divided by the
        micro-batch count (the mean over micro-batches) and times the fp16 loss scale when training."""
        loss = self.module.loss_fn(boundary.unflatten(tuple(flat_output)), labels)
        return loss * self._loss_factor if self._loss_factor != 1.0 else loss

    def _pull(self, data_iter, m: int):
        """m micro-batches of (inputs, labels) on the first and last stage; nothing elsewhere."""
        if not (self.is_first_stage or self.is_last_stage):
            return None, None
        if data_iter is None:
            if self.training_dataloader is None:
                raise RuntimeError("engine.train_batch() needs a data_iter, or training_data= in engine.initialize()")
            if self._data_iterator is None:
                self._data_iterator = iter(self.training_dataloader)
            data_iter = self._data_iterator
        inputs, labels = [], []
        for _ in range(m):
            batch = next(data_iter)
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise TypeError("a pipeline's data iterator yields (inputs, labels) pairs, as DeepSpeed's does; "
                                f"got {type(batch).__name__}")
            x, y = pytree.tree_map(lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t, tuple(batch))
            inputs.append(boundary.flatten(x, self.device))
            labels.append(y)
        return inputs, labels

    def _run(self, data_iter, training: bool):
        m = self.config.gradient_accumulation_steps
        inputs, labels = self._pull(data_iter, m)
        # The first stage's input shapes pick the built stages on every stage (boundary.py's note).
        key = [tuple(boundary.signature(x) for x in inputs) if self.is_first_stage else None]
        if self.num_stages > 1:
            src = dist.get_global_rank(self.groups.pipe_group, 0) if self.groups.pipe_group is not None else 0
            dist.broadcast_object_list(key, src=src, group=self.groups.pipe_group, device=self.device)
        stages, sched = self._schedule_for(key[0], training, m, inputs[0] if self.is_first_stage else None)
        self._actions.clear()
        for st in stages:
            st.has_backward = training
            st.clear_runtime_states()
        losses: list = []
        sched._step_microbatches(inputs if self.is_first_stage else None, None,
                                 labels if self.is_last_stage else None, losses if self.is_last_stage else None)
        return stages, losses

    def _agreed_loss(self, losses: list) -> torch.Tensor:
        """Mean over micro-batches and data-parallel ranks, sent from the last stage to every stage."""
        loss = self.comm.zeros()
        if self.is_last_stage:
            loss += torch.stack([l.detach().float() for l in losses]).sum() / self._loss_factor / len(losses)
            self.comm.all_reduce(loss)
            loss /= self.comm.world_size
        self.pipe_comm.broadcast(loss, src=self.num_stages - 1)
        return loss

    def schedule_actions(self) -> dict[int, list[tuple]]:
        """Every stage's executed actions of the last batch, {pipe rank: [(kind, stage, mb), ...]}
        (collective over the pipe group; for `schedule.idle_fractions`)."""
        return dict(enumerate(self.pipe_comm.all_gather_object(list(self._actions))))

    # -- the public API -------------------------------------------------------------------------
    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One optimizer step over gradient_accumulation_steps micro-batches; returns the mean loss."""
        self._require_optimizer("train_batch")
        self.module.train()
        m = self.config.gradient_accumulation_steps
        self._loss_factor = self.zero_optimizer.guard.scaler.loss_scale / m
        self.timers.start("forward")  # the schedule interleaves forward and backward: one timer
        _, losses = self._run(data_iter, training=True)
        self.timers.stop("forward")
        self.timers.start("allreduce")
        self.tied.all_reduce_grads()
        self.tied.measure_duplicates(self.zero_optimizer.guard.scaler.loss_scale)
        reduce_accumulated(self.zero_optimizer)
        self.timers.stop("allreduce")
        self._last_loss = self._agreed_loss(losses)
        self.micro_steps += m - 1
        self._boundary_step()
        self.micro_steps += 1
        return self._last_loss

    @torch.no_grad()
    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str = "avg"):
        """Forward only over gradient_accumulation_steps micro-batches; the mean loss on every stage
        (and, with return_logits, the last stage's outputs per micro-batch; None elsewhere)."""
        self.module.eval()
        self._loss_factor = 1.0 / self.config.gradient_accumulation_steps
        stages, losses = self._run(data_iter, training=False)
        loss = self._agreed_loss(losses) if compute_loss else None
        if reduce_output is None and compute_loss and self.is_last_stage:
            loss = [l.detach() / self._loss_factor for l in losses]
        if not return_logits:
            return loss
        outputs = [boundary.unflatten(tuple(o)) for o in stages[-1].output_chunks] if self.is_last_stage else None
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
