"""zero.Init and a parameter changed in place after its module was partitioned (engine/zero/init_edits.py).

The oracle is the model built normally from the same seed: torch.equal for every parameter, and the
random state after construction (the next draw) equal too. Changes Init cannot make whole are errors
naming the parameter; an edit inside GatheredParameters is not one of them. torch's own
`nn.MultiheadAttention`, which initialises its child's bias with an init function imported by name, is
built equal to the plain layer. Hugging Face models
(transformers' `post_init` walk, `smart_apply`) are built equal to the plain model too, and
`from_pretrained` inside Init (a model on the meta device) loads as outside it and trains the same.
"""
from __future__ import annotations

import torch
import torch.nn as nn

import engine
from tests.harness import run_distributed

CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 10)
        self.proj = nn.Linear(10, 6)


class NanoStyle(nn.Module):
    """nanoGPT's pattern: the parent re-initialises its children's weights in its own __init__."""

    def __init__(self, edit: str = "init"):
        super().__init__()
        self.h = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(6, 3)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                if edit == "init":
                    torch.nn.init.normal_(p, mean=0.0, std=0.02)
                elif edit == "tensor_method":
                    with torch.no_grad():
                        p.mul_(2.0)
        torch.nn.init.zeros_(self.head.bias)
        torch.nn.init.xavier_uniform_(self.head.weight)


def _full(model: nn.Module) -> dict:
    with engine.zero.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.named_parameters()}


def _error(build) -> str:
    try:
        build()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _hf_models() -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    return {"gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                                        n_head=4, bos_token_id=0, eos_token_id=0)),
            "llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                          num_hidden_layers=2, num_attention_heads=4,
                                                          num_key_value_heads=2, bos_token_id=0, eos_token_id=0))}


def _differing(make) -> list[str]:
    """The parameters of `make()` built in Init that differ from the plain model built from the same seed."""
    torch.manual_seed(0)
    plain = {k: v.detach().clone() for k, v in make().named_parameters()}
    torch.manual_seed(0)
    with engine.zero.Init(config=CONFIG):
        model = make()
    built = _full(model)
    return [k for k, v in plain.items() if not torch.equal(built[k], v)] + [k for k in built if k not in plain]


def _pretrained_step(saved: str, in_init: bool) -> tuple:
    """(loss, parameters after one step) of `saved` loaded by from_pretrained, inside Init or not."""
    from transformers import GPT2LMHeadModel
    with engine.zero.Init(config=CONFIG, enabled=in_init):
        model = GPT2LMHeadModel.from_pretrained(saved)
    eng, _, _, _ = engine.initialize(model=model, config=CONFIG)
    ids = torch.arange(16).reshape(2, 8) + 8 * torch.distributed.get_rank()
    loss = eng(input_ids=ids, labels=ids).loss
    eng.backward(loss)
    eng.step()
    return loss.item(), _full(eng.module)


def _initialized_inside() -> bool:
    """engine.initialize inside the Init block (its Engine.__init__ is wrapped too), then an edit: kept?"""
    from engine.utils import safe_get_full_fp32_param
    config = {**CONFIG, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    with engine.zero.Init(config=config):
        model = NanoStyle("none")
        engine.initialize(model=model, config=config)
        with engine.zero.GatheredParameters([model.head.bias], modifier_rank=0):
            with torch.no_grad():
                model.head.bias.fill_(2.0)
    return torch.equal(safe_get_full_fp32_param(model.head.bias), torch.full((3,), 2.0))


def _cases(saved: str):
    torch.manual_seed(0)
    plain = {k: v.detach().clone() for k, v in NanoStyle().named_parameters()}
    plain_next = torch.rand(4)
    torch.manual_seed(0)
    with engine.zero.Init(config=CONFIG):
        model = NanoStyle()
    init_next = torch.rand(4)
    built = _full(model)

    def method_edit():
        with engine.zero.Init(config=CONFIG):
            NanoStyle("tensor_method")

    def block_edit():
        with engine.zero.Init(config=CONFIG):
            m = NanoStyle("none")
            with torch.no_grad():
                m.head.bias.add_(1.0)

    with engine.zero.Init(config=CONFIG):
        gathered_edit = NanoStyle("none")
        with engine.zero.GatheredParameters([gathered_edit.head.bias], modifier_rank=0):
            with torch.no_grad():
                gathered_edit.head.bias.fill_(3.0)
    return {"equal": {k: torch.equal(built[k], v) for k, v in plain.items()},
            "rng": torch.equal(plain_next, init_next),
            "method_edit": _error(method_edit), "block_edit": _error(block_edit),
            "gathered_edit": _full(gathered_edit)["head.bias"],
            "hf": {name: _differing(make) for name, make in _hf_models().items()},
            "torch_layer": _differing(lambda: nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)),
            "initialized_inside": _initialized_inside(),
            "pretrained": [_pretrained_step(saved, in_init) for in_init in (True, False)]}


def test_init_edits_after_partition_are_made_whole_or_refused(tmp_path):
    torch.manual_seed(1)
    _hf_models()["gpt2"]().save_pretrained(tmp_path)
    for r in run_distributed(_cases, 2, args=(str(tmp_path),), timeout=120):
        assert all(r["equal"].values()), r["equal"]  # the parent's torch.nn.init calls reached the weights
        assert r["rng"]
        assert "'h.0.proj.weight' in place" in r["method_edit"] and "NanoStyle.__init__" in r["method_edit"]
        assert "of shape (3,) in place" in r["block_edit"], r["block_edit"]
        assert torch.equal(r["gathered_edit"], torch.full((3,), 3.0))
        assert r["hf"] == {"gpt2": [], "llama": []}, r["hf"]
        assert r["initialized_inside"]  # the engine's own writes to its placeholders are not lost edits
        assert r["torch_layer"] == [], r["torch_layer"]  # MultiheadAttention zeroes out_proj.bias by an imported constant_
        (loss_init, after_init), (loss, after) = r["pretrained"]
        assert loss_init == loss and after_init.keys() == after.keys()
        assert all(torch.equal(after_init[k], v) for k, v in after.items())
