"""The benchmark GPT with each block in an activation-checkpoint region, for bench_first_backward.py's
dstrain ranks and its DeepSpeed peer alike (torch and examples/gpt.py only): `checkpoint(block, x)`
is whichever region function the caller names; `measured_steps` trains it and measures each step the
same way in both."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from benchmarks.peak_rss import current_mb, peak_mb, restart_peak
from examples.gpt import GPT, GPTConfig, RandomTokens


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


def measured_steps(eng, cfg: GPTConfig, steps: int, rank: int, micro: int = 8) -> list[tuple[float, float]]:
    """(peak RSS MB above the step's start, ms) of each of `steps` steps of `eng` (dstrain's or DeepSpeed's:
    the same backward/step calls) on random tokens seeded by `rank`."""
    data = RandomTokens(micro * steps, cfg.seq_len, cfg.vocab_size, seed=rank)
    rows = []
    for i in range(steps):
        x, y = (torch.stack(t) for t in zip(*(data[micro * i + j] for j in range(micro))))
        restart_peak()
        before, t0 = current_mb(), time.perf_counter()
        eng.backward(eng(x, y))
        eng.step()
        rows.append((peak_mb() - before, (time.perf_counter() - t0) * 1e3))
    return rows
