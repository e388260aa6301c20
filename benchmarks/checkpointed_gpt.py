"""The benchmark GPT with each block in an activation-checkpoint region, for bench_first_backward.py's
dstrain ranks and its DeepSpeed peer alike (torch and examples/gpt.py only): `checkpoint(block, x)`
is whichever region function the caller names."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from examples.gpt import GPT, GPTConfig


class CheckpointedGPT(GPT):
    def __init__(self, cfg: GPTConfig, checkpoint):
        super().__init__(cfg)
        self.checkpoint = checkpoint

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = self.checkpoint(block, x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def torch_region(reentrant: bool):
    return lambda block, x: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
