"""The frame of dstrain's own one-stage-per-rank schedules (eager_1f1b.py, zb_h1.py): torch's input
checks and stage set-up before the loop, its loss bookkeeping and gradient scaling after, and the two
computations every loop orders (a forward with the last stage's loss, a backward), each returning the
send ops it leaves for the loop to post."""
from __future__ import annotations

from torch.distributed.pipelining.schedules import PipelineScheduleSingle


class StageLoop(PipelineScheduleSingle):
    """Subclasses order the micro-batches in `_loop()`; torch's stage does the computing and the messages."""

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                           return_outputs=True, loss_kwargs=None):
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs is not None else None,
                               loss_kwargs)
        self._batch = (arg_mbs, kwarg_mbs, target_mbs, return_outputs, loss_kwargs)
        try:
            self._loop()
        finally:
            self._batch = None  # the micro-batches are the caller's: not held past the step
        self._update_losses(self._stage, losses)
        if self._has_backward:
            self._stage.perform_reduce_grad(self._n_microbatches if self.scale_grads else 1)

    def _loop(self) -> None:
        raise NotImplementedError

    def _forward(self, k: int) -> list:
        """Micro-batch k's forward (and loss, on the last stage); its activation's send ops."""
        arg_mbs, kwarg_mbs, target_mbs, return_outputs, loss_kwargs = self._batch
        stage = self._stage
        output = stage.forward_one_chunk(k, arg_mbs[k], kwarg_mbs[k], save_forward_output=return_outputs)
        self._maybe_compute_loss(stage, output, target_mbs, k, loss_kwargs)
        return stage.get_fwd_send_ops(k)

    def _backward(self, k: int, full: bool = True) -> list:
        """Micro-batch k's backward, whole or its input-gradient half (`full=False`: the weight half is
        `backward_weight_one_chunk` later); its gradient's send ops."""
        stage = self._stage
        stage.backward_one_chunk(k, loss=self._maybe_get_loss(stage, k), full_backward=full,
                                 last_backward=full and k == self._n_microbatches - 1)
        return stage.get_bwd_send_ops(k)
