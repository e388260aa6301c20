"""A small GPT (pre-LayerNorm decoder, tied embeddings) and a byte-level corpus for the demo,
tests and benchmarks.

The corpus is the Python standard library's own source text, which exists on every machine that has
Python: no download, same bytes everywhere for the same Python version.
"""
from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0
    # An `ops.sparse_attention` sparsity pattern (e.g. from the config's `sparse_attention` section):
    # attention over its blocks, causal inside them; None: dense causal SDPA.
    sparsity: object = None


# The benchmark workload of shared/reference/baselines.md: 25.12M parameters.
BENCH_CONFIG = GPTConfig(vocab_size=12_000, seq_len=128, n_layer=6, n_head=8, d_model=512)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout
        self.sparse = None
        if cfg.sparsity is not None:
            from ops.sparse_attention import SparseSelfAttention
            self.sparse = SparseSelfAttention(cfg.sparsity, max_seq_length=cfg.seq_len)
            self.register_buffer("causal", torch.tril(torch.ones(cfg.seq_len, cfg.seq_len)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # chunk/-1 rather than the full width: AutoTP (engine/tensor_parallel) runs this on n_head/T heads
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=2)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        if self.sparse is not None:
            y = self.sparse(q, k, v, attn_mask=self.causal[:t, :t])
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """`forward(idx, targets=None)`: logits, or the mean cross-entropy when targets are given."""

    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def stdlib_text(max_bytes: int = 2_000_000) -> bytes:
    """Concatenated source of the standard library's top-level modules, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        out.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(out)[:max_bytes]


class ByteCorpus(torch.utils.data.Dataset):
    """Non-overlapping windows of `seq_len + 1` bytes → (input, target) pairs."""

    def __init__(self, seq_len: int = 128, max_bytes: int = 2_000_000):
        data = torch.frombuffer(bytearray(stdlib_text(max_bytes)), dtype=torch.uint8).long()
        n = (len(data) - 1) // seq_len
        self.x = data[: n * seq_len].view(n, seq_len)
        self.y = data[1: n * seq_len + 1].view(n, seq_len)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class RandomTokens(torch.utils.data.Dataset):
    """Fixed pseudo-random token windows (for benchmarks, where content does not matter)."""

    def __init__(self, n: int, seq_len: int, vocab_size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab_size, (n, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return self.data[i, :-1], self.data[i, 1:]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def uniform_loss(vocab_size: int) -> float:
    return math.log(vocab_size)
