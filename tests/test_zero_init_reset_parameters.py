"""zero.Init and a module's reset_parameters() or an index into its weight after the module was partitioned
(engine/zero/init_edits.py).

torch's `nn.Embedding(..., padding_idx=k).reset_parameters()` zeroes row k by indexing the weight; called by
a parent after the embedding was partitioned it raised IndexError on the placeholder's 0 rows. Now it runs
with the module's parameters gathered. The oracle is the model built normally from the same seed
(torch.equal for every parameter, and the next random draw). The same row zeroed through `.data[k]` in an
`apply(fn)` walk (transformers 4's `_init_weights`) or by transformers 5's `init.zeros_(weight[k])` equals
the plain model too; an index into a placeholder anywhere else is an error naming zero.Init and the fix.
"""
from __future__ import annotations

import torch
import torch.nn as nn

import engine
from tests.harness import run_distributed
from tests.test_zero_init_edits import _error

CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}


def _init_weights(module: nn.Module) -> None:
    """transformers 4's `_init_weights` for an embedding: through `.data`, the padding row by index."""
    if isinstance(module, nn.Embedding):
        module.weight.data.normal_(mean=0.0, std=0.5)
        if module.padding_idx is not None:
            module.weight.data[module.padding_idx].zero_()


class Parent(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=3)
        self.lin = nn.Linear(4, 4)
        if how == "reset":
            self.emb.reset_parameters()
            self.lin.reset_parameters()
        elif how == "apply":
            self.apply(_init_weights)
        elif how == "index":  # outside any walk: the placeholder has no row 3
            self.emb.weight.data[self.emb.padding_idx].zero_()


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=5,
                                        bos_token_id=0, eos_token_id=0))


def _built(make) -> tuple[dict, torch.Tensor]:
    torch.manual_seed(0)
    with engine.zero.Init(config=CONFIG):
        model = make()
    after = torch.rand(4)
    with engine.zero.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.named_parameters()}, after


def _plain(make) -> tuple[dict, torch.Tensor]:
    torch.manual_seed(0)
    model = make()
    return {k: v.detach().clone() for k, v in model.named_parameters()}, torch.rand(4)


def _in_block_index():
    with engine.zero.Init(config=CONFIG):
        model = Parent("none")
        model.emb.weight.data[3].zero_()


def _cases() -> dict:
    out = {}
    for name, make in {"reset": lambda: Parent("reset"), "apply": lambda: Parent("apply"), "llama": _llama}.items():
        (built, built_next), (plain, plain_next) = _built(make), _plain(make)
        out[name] = {"differing": [k for k, v in plain.items() if not torch.equal(built[k], v)],
                     "rng": torch.equal(built_next, plain_next)}
    out["index"] = _error(lambda: _built(lambda: Parent("index")))
    out["in_block_index"] = _error(_in_block_index)
    return out


def test_reset_parameters_and_padding_rows_after_partition():
    for r in run_distributed(_cases, 2, timeout=150):
        for name in ("reset", "apply", "llama"):
            assert r[name] == {"differing": [], "rng": True}, (name, r[name])
        assert r["index"].startswith("engine.zero.Init: Parent.__init__ indexed a parameter"), r["index"]
        assert "GatheredParameters(param, modifier_rank=0)" in r["index"]
        assert r["in_block_index"].startswith("engine.zero.Init: the code inside engine.zero.Init indexed"), \
            r["in_block_index"]
