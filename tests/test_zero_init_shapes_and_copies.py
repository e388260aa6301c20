"""zero.Init and construction code that reads a partitioned parameter's shape or copies it
(engine/zero/stage3_params.py `placeholder`, engine/zero/param_copy.py).

`nn.Transformer` is the canonical case of both: `nn.TransformerEncoder` deep-copies its partitioned
layer (`_get_clones`), and `_reset_parameters` re-initialises `if p.dim() > 1`. Oracles: the model built
normally from the same seed (torch.equal per parameter; also a parent calling its child's
`reset_parameters()`), nanoGPT-style weight-decay groups chosen by `p.dim()` (same parameters in each),
and plain single-process SGD on the global batch (weight decay on the decay group, gradient_clipping 0),
fp32 atol 1e-6 after STEPS steps. A copy made inside Init before
initialize (an EMA) equals the model as built and is untouched by training; a deepcopy of the engine's
module is refused, and the way its message names gives the trained weights.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

import engine
from tests.harness import run_distributed
from tests.test_zero_init_edits import _error, _full, _hf_models
from tests.models import make_batches, micro_batches

STEPS = 2
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0, "zero_allow_untested_optimizer": True,
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 5)

    def forward(self, x, y):
        src = x.view(x.shape[0], 4, 8)
        return nn.functional.mse_loss(self.head(self.body(src, src).mean(1)), y)


class ResetChild(nn.Module):
    """A parent re-running its partitioned child's own init: torch's fan-in reads the placeholder's dim 1."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.a.reset_parameters()


def _groups(model: nn.Module, decay: float = 0.5) -> list[dict]:
    """nanoGPT's configure_optimizers: weight decay on the parameters with 2 or more dimensions."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _train(eng, batches) -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for x, y in batches:
        for xm, ym in micro_batches(x, y, rank, world, 1):
            eng.backward(eng(xm, ym))
        eng.step()


def _cases(batches):
    torch.manual_seed(0)
    plain_model = TinyTransformer()
    plain = {k: v.detach().clone() for k, v in plain_model.named_parameters()}
    plain_decay = len(_groups(plain_model)[0]["params"])
    torch.manual_seed(0)
    with engine.zero.Init(config=CONFIG):
        model = TinyTransformer()
        ema = copy.deepcopy(model)  # an EMA / reference copy made before initialize
    decay = len(_groups(model)[0]["params"])
    built, ema_built = _full(model), _full(ema)
    eng, _, _, _ = engine.initialize(model=model, model_parameters=_groups(model), config=CONFIG)
    _train(eng, batches)
    plain_eng, _, _, _ = engine.initialize(model=TinyTransformer(), config=CONFIG)  # built outside Init
    refused = [_error(lambda: copy.deepcopy(eng.module)), _error(lambda: copy.deepcopy(plain_eng.module))]
    rebuilt = TinyTransformer()  # the way the refusal names
    with engine.zero.GatheredParameters(list(eng.module.parameters())):
        rebuilt.load_state_dict(eng.module.state_dict())
    torch.manual_seed(1)
    plain_reset = ResetChild().state_dict()
    torch.manual_seed(1)
    with engine.zero.Init(config=CONFIG):
        reset = _full(ResetChild())
    return {"built": [k for k, v in plain.items() if not torch.equal(built[k], v)],
            "reset": [k for k, v in plain_reset.items() if not torch.equal(reset[k], v)],
            "ema": [k for k, v in plain.items() if not torch.equal(ema_built[k], v)],
            "ema_after": [k for k, v in _full(ema).items() if not torch.equal(plain[k], v)],
            "decay": (decay, plain_decay), "refused": refused,
            "trained": _full(eng.module), "rebuilt": dict(rebuilt.named_parameters())}


def test_transformer_built_in_init_equals_plain_and_copies_are_exact_or_refused():
    batches = make_batches(STEPS, 4, d_in=32)
    torch.manual_seed(0)
    plain = TinyTransformer()
    opt = torch.optim.SGD(_groups(plain), lr=0.1)  # the single-process reference on the global batch
    for x, y in batches:
        plain(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ref = dict(plain.named_parameters())
    for r in run_distributed(_cases, 2, args=(batches,), timeout=180):
        assert r["built"] == [], r["built"]  # _reset_parameters' xavier_uniform_ reached every weight
        assert r["reset"] == [], r["reset"]  # nn.Linear.reset_parameters on a partitioned child
        assert r["decay"][0] == r["decay"][1] > 0, r["decay"]  # p.dim() of a placeholder is the weight's
        assert r["ema"] == [] and r["ema_after"] == [], (r["ema"], r["ema_after"])
        assert all("copy.deepcopy" in e and "GatheredParameters" in e for e in r["refused"]), r["refused"]
        for k, v in ref.items():
            torch.testing.assert_close(r["trained"][k], v.detach(), rtol=0, atol=1e-6, msg=k)
            torch.testing.assert_close(r["rebuilt"][k].detach(), v.detach(), rtol=0, atol=1e-6, msg=k)


RESIZE_CONFIG = {**CONFIG, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _gpt2():
    """tests/test_zero_init_edits.py's GPT-2 without dropout, so that training is deterministic."""
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _models() -> dict:
    return {**_hf_models(), "gpt2": _gpt2}


def _resized(make, config: dict):
    """`make()` built in Init and resized to 80 tokens inside GatheredParameters, as the refusal says."""
    with engine.zero.Init(config=config):
        model = make()
    with engine.zero.GatheredParameters([model.get_input_embeddings().weight,
                                         *model.get_output_embeddings().parameters()], modifier_rank=0):
        model.resize_token_embeddings(80)
    return model


def _resize_cases(ids: torch.Tensor) -> dict:
    rank, out = torch.distributed.get_rank(), {}
    for name, make in _models().items():
        torch.manual_seed(0)
        model = _resized(make, RESIZE_CONFIG)
        out[name] = {"built": _full(model), "vocab": model.config.vocab_size}
        with engine.zero.Init(config=RESIZE_CONFIG):
            unwrapped = make()
        unwrapped.resize_token_embeddings(80)
        out[name]["unwrapped"] = _error(lambda: engine.initialize(model=unwrapped, config=RESIZE_CONFIG))
    torch.manual_seed(0)
    eng = engine.initialize(model=_resized(_gpt2, RESIZE_CONFIG), config=RESIZE_CONFIG)[0]
    eng.backward(eng(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1]).loss)
    eng.step()
    out["trained"] = _full(eng.module)
    after = {}
    for persist in (0, 100000):  # the embedding partitioned, or kept whole (persistent)
        config = {**CONFIG, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": persist}}
        late = engine.initialize(model=_gpt2(), config=config)[0]

        def resize_and_train():
            late.module.resize_token_embeddings(90)
            late.backward(late(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1]).loss)
        after[persist] = _error(resize_and_train)
    out["after_initialize"] = after
    return out


def test_resize_token_embeddings_of_a_model_built_in_init():
    """transformers' resize_token_embeddings reads the old size from `weight.size()` (DeepSpeed's own path
    needs `import deepspeed`): inside GatheredParameters(modifier_rank=0) it sees the full weight, and the
    parameter is partitioned at its new shape on exit (equal to the plain resized model, and trains as
    it does with SGD); without it, or after initialize, a one-line error names that way."""
    ids = torch.tensor([[1, 70, 5, 79, 64, 3, 2, 66], [75, 4, 71, 9, 78, 0, 65, 7]])  # new tokens >= 64
    plain = {}
    for name, make in _models().items():
        torch.manual_seed(0)
        model = make()
        model.resize_token_embeddings(80)
        plain[name] = model
    gpt2 = plain["gpt2"]
    want = {k: v.detach().clone() for k, v in gpt2.named_parameters()}
    gpt2(input_ids=ids, labels=ids).loss.backward()  # single-process SGD on the global batch
    with torch.no_grad():
        trained = {k: (p - 0.1 * p.grad) for k, p in gpt2.named_parameters()}
    for r in run_distributed(_resize_cases, 2, args=(ids,), timeout=240):
        for name, model in plain.items():
            ref = want if name == "gpt2" else {k: v.detach() for k, v in model.named_parameters()}
            assert [k for k, v in ref.items() if not torch.equal(r[name]["built"][k], v)] == [], name
            assert r[name]["vocab"] == 80
            assert "resize_token_embeddings" in r[name]["unwrapped"] and "GatheredParameters" in r[name]["unwrapped"]
        for k, v in trained.items():
            torch.testing.assert_close(r["trained"][k], v, rtol=0, atol=1e-6, msg=k)
        assert all("resize_token_embeddings" in e and "after engine.initialize" in e
                   for e in r["after_initialize"].values()), r["after_initialize"]
