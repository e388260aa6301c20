"""examples/gpt.py's GPT written as a layer list for `engine.pipe.PipelineModule`: the token and
position embedding (tied to the LM head by `TiedLayerSpec`), the blocks, the final LayerNorm, the head.
Same modules and initialisation as `GPT`, so a pipeline run is the same model split into stages.

`gpt_layers(cfg, tensor_parallel=True)` builds the blocks from engine.tensor_parallel's layers
(heads and MLP features split over the module topology's model group, Megatron's layout): the same
numbers as the dense blocks, each rank holding its slices."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.pipe import LayerSpec, TiedLayerSpec
from engine.tensor_parallel import ColumnParallelLinear, ParallelMLP, ParallelSelfAttention, RowParallelLinear
from engine.tensor_parallel.layers import shard
from examples.gpt import GPT, Block, GPTConfig


class Embeddings(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.apply(GPT._init)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class BlockLayer(Block):
    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg)
        self.apply(GPT._init)


class ParallelBlockLayer(nn.Module):
    """`BlockLayer` with split heads and MLP features: one all-reduce after attention, one after the MLP."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = ParallelSelfAttention(cfg.d_model, cfg.n_head, dropout=cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = ParallelMLP(cfg.d_model, 4 * cfg.d_model)
        _init_like_gpt(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


@torch.no_grad()
def _init_like_gpt(module: nn.Module) -> None:
    """`GPT._init` on the full shapes, in the dense block's order, each rank keeping its slice: the
    draws are the dense BlockLayer's, so both hold the same numbers."""
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            w = m.weight
            full = torch.empty(w.tensor_parallel_full_shape, dtype=w.dtype, device=w.device).normal_(std=0.02)
            w.copy_(shard(full, w.tensor_parallel_dim, m.comm.rank, m.comm.world_size, w.tensor_parallel_parts))
            if m.bias is not None:
                m.bias.zero_()


def lm_head(embeddings: Embeddings, x: torch.Tensor) -> torch.Tensor:
    return x @ embeddings.tok.weight.t()


def gpt_layers(cfg: GPTConfig, layer_spec=LayerSpec, tied_layer_spec=TiedLayerSpec,
               tensor_parallel: bool = False) -> list:
    """The layer list; the spec classes can be DeepSpeed's (the benchmark suite's DeepSpeed peer), the
    blocks engine.tensor_parallel's (`tensor_parallel=True`)."""
    block = ParallelBlockLayer if tensor_parallel else BlockLayer
    return [tied_layer_spec("embeddings", Embeddings, cfg, tied_weight_attr="tok.weight"),
            *(layer_spec(block, cfg) for _ in range(cfg.n_layer)),
            layer_spec(nn.LayerNorm, cfg.d_model),
            tied_layer_spec("embeddings", Embeddings, cfg, forward_fn=lm_head, tied_weight_attr="tok.weight")]


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
