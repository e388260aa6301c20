"""Cross-entropy over logits whose vocabulary is split across the tensor-parallel group, without ever
gathering the vocabulary (Megatron's `vocab_parallel_cross_entropy`, arXiv:1909.08053 §3).

Per token, with rank r holding logits z[r·V/T : (r+1)·V/T]:
  m = max_v z_v                    one all-reduce (MAX) of one number per token
  S = Σ_v exp(z_v − m),  z_t − m   one all-reduce (SUM) of two numbers per token; z_t only on its owner
  loss = log S − (z_t − m)
and the gradient is softmax(z) − onehot(t), each rank computing its own slice from the saved local
exponentials and S: no communication in backward. What moves is 3 numbers per token, not V/T.
"""
from __future__ import annotations

import torch

from ..comm import Communicator
from .collective_ledger import note
from .group import tensor_parallel_comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, comm: Communicator, ignore_index: int):
        z = logits.float()
        local_vocab = z.shape[-1]
        start = comm.rank * local_vocab
        peak = z.max(dim=-1).values
        note("all_reduce", comm, peak, torch.distributed.ReduceOp.MAX)  # collective_ledger.py
        comm.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        z = z - peak.unsqueeze(-1)
        owned = (target >= start) & (target < start + local_vocab)
        local_target = (target - start).masked_fill(~owned, 0)
        target_logit = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        exp = z.exp()
        sums = torch.stack([exp.sum(dim=-1), target_logit])  # one all-reduce for both
        note("all_reduce", comm, sums, torch.distributed.ReduceOp.SUM)
        comm.all_reduce(sums)
        total, target_logit = sums[0], sums[1]
        valid = target != ignore_index
        loss = (total.log() - target_logit).masked_fill(~valid, 0.0)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), owned & valid, local_target, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, hit, local_target, valid = ctx.saved_tensors
        grad = softmax.clone()  # the saved one stays intact for a retain_graph second backward
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """`F.cross_entropy(full_logits.view(-1, V), target.view(-1), ignore_index=, reduction=)` from this
    rank's vocabulary slice `logits` (..., V/T); `target` holds global token ids (..., )."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}: use 'mean', 'sum' or 'none'")
    comm = tensor_parallel_comm(group)
    losses = _VocabParallelCrossEntropy.apply(logits, target, comm, ignore_index)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (target != ignore_index).sum()
