"""examples/gpt.py's GPT written as a layer list for `engine.pipe.PipelineModule`: the token and
position embedding (tied to the LM head by `TiedLayerSpec`), the blocks, the final LayerNorm, the head.
Same modules and initialisation as `GPT`, so a pipeline run is the same model split into stages."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.pipe import LayerSpec, TiedLayerSpec
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


def lm_head(embeddings: Embeddings, x: torch.Tensor) -> torch.Tensor:
    return x @ embeddings.tok.weight.t()


def gpt_layers(cfg: GPTConfig, layer_spec=LayerSpec, tied_layer_spec=TiedLayerSpec) -> list:
    """The layer list; the spec classes can be DeepSpeed's (the benchmark suite's DeepSpeed peer)."""
    return [tied_layer_spec("embeddings", Embeddings, cfg, tied_weight_attr="tok.weight"),
            *(layer_spec(BlockLayer, cfg) for _ in range(cfg.n_layer)),
            layer_spec(nn.LayerNorm, cfg.d_model),
            tied_layer_spec("embeddings", Embeddings, cfg, forward_fn=lm_head, tied_weight_attr="tok.weight")]


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
