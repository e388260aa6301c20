"""AutoTP of the HF families beyond GPT-2 and Llama (engine/tensor_parallel/autotp_layouts.py):
OPT (q/k/v_proj, out_proj; fc1/fc2 in the decoder layer), GPT-J (q/k/v_proj, out_proj; fc_in/fc_out),
GPT-NeoX and BLOOM (query_key_value fused head by head, dense; dense_h_to_4h/dense_4h_to_h; BLOOM's
ALiBi bias handed to its attention per head of the whole model, with and without a padding mask),
Falcon with key/value groups (new_decoder_architecture), with per-head q|k|v, and with ALiBi in its
attention mask, Persimmon and Phi (dense), XGLM (out_proj; its attention reshapes to `embed_dim`),
Phi-3 under grouped-query attention (`qkv_proj` fused q|k|v of unequal widths, `gate_up_proj`), Llama
and Qwen3 (its k_norm) with one key/value head on 2 ranks and Llama with 2 on 4 ranks (kv_heads.py).
Each, sharded on 2 ranks, against the dense model in one process on the same batches, SGD without
momentum (the update is linear in the gradient), fp32: every loss, every gradient of every step (this
rank's slice of a sharded one) and every parameter after STEPS steps within ATOL (summation order
only), and the shards joined as a checkpoint joins them equal the dense state dict. Refused at sharding, naming the module and why: Falcon's multi-query layout (one key/value head
every rank's heads read), BLOOM's slow_but_exact (its forward multiplies slices of the sharded weight
itself), a `query_key_value` of a class whose layout is not listed and Phi-3 with fewer key/value heads
than ranks. One family end to end through
`engine.initialize` with `tensor_parallel.autotp_size: 2`.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from tests.harness import run_distributed

ATOL, STEPS, LR = 1e-5, 2, 0.5
V, H, NH, L, I = 64, 32, 4, 2, 64
DROPOUTS = ("hidden_dropout", "attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout",
            "activation_dropout", "residual_dropout")


def _build(cls_config: str, cls_model: str, **kw) -> nn.Module:
    import transformers
    config = getattr(transformers, cls_config)(**kw)
    for key in DROPOUTS:  # the dense model and the shards draw different masks
        if hasattr(config, key):
            setattr(config, key, 0.0)
    return getattr(transformers, cls_model)(config)


COMMON = dict(vocab_size=V, hidden_size=H, num_attention_heads=NH, num_hidden_layers=L, max_position_embeddings=32)
FAMILIES = {
    "opt": ("OPTConfig", "OPTForCausalLM", dict(COMMON, ffn_dim=I, word_embed_proj_dim=H)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(vocab_size=V, n_embd=H, n_head=NH, n_layer=L, n_positions=32,
                                                   rotary_dim=4)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(COMMON, intermediate_size=I)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=V, hidden_size=H, n_head=NH, n_layer=L)),
    "falcon_groups": ("FalconConfig", "FalconForCausalLM", dict(COMMON, new_decoder_architecture=True, num_kv_heads=2)),
    "falcon_heads": ("FalconConfig", "FalconForCausalLM", dict(COMMON, multi_query=False, parallel_attn=False)),
    "falcon_alibi": ("FalconConfig", "FalconForCausalLM", dict(COMMON, multi_query=False, alibi=True)),
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", dict(COMMON, intermediate_size=I, qk_layernorm=True)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(COMMON, intermediate_size=I, num_key_value_heads=NH)),
    # one key/value head on 2 ranks (kv_heads.py), with biases; Qwen3's k_norm on the key head
    "llama_kv1": ("LlamaConfig", "LlamaForCausalLM", dict(COMMON, intermediate_size=I, num_key_value_heads=1,
                                                          attention_bias=True)),
    "qwen3_kv1": ("Qwen3Config", "Qwen3ForCausalLM", dict(COMMON, intermediate_size=I, num_key_value_heads=1,
                                                          head_dim=8)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(COMMON, intermediate_size=I, num_key_value_heads=2, pad_token_id=0)),
    "xglm": ("XGLMConfig", "XGLMForCausalLM", dict(vocab_size=V, d_model=H, attention_heads=NH, num_layers=L,
                                                   ffn_dim=I)),
}
# projections replaced per layer: attention and MLP pairs (OPT's and Phi's MLP: fc1/fc2)
REPLACED = {"opt": 6, "gptj": 6, "phi": 6, "xglm": 6, "llama_kv1": 7, "qwen3_kv1": 7}
PADDED = {"bloom_padded": "bloom", "falcon_alibi_padded": "falcon_alibi"}  # ALiBi built from the mask
REFUSED = {
    "phi3_kv_heads": ("Phi3Config", "Phi3ForCausalLM", dict(COMMON, intermediate_size=I, num_key_value_heads=1,
                                                            pad_token_id=0)),
    "falcon_multi_query": ("FalconConfig", "FalconForCausalLM", dict(COMMON, multi_query=True)),
    "bloom_slow_but_exact": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=V, hidden_size=H, n_head=NH, n_layer=L,
                                                                     pretraining_tp=2, slow_but_exact=True)),
}


def _dense_slice(p: nn.Parameter, full: torch.Tensor, comm) -> torch.Tensor:
    from engine.tensor_parallel import is_partitioned
    from engine.tensor_parallel.layers import shard
    return shard(full, p.tensor_parallel_dim, comm.rank, comm.world_size, p.tensor_parallel_parts) \
        if is_partitioned(p) else full


def _mask(ids: torch.Tensor, padded: bool) -> torch.Tensor | None:
    if not padded:
        return None
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on one row: BLOOM and Falcon build ALiBi from the mask
    return mask


def _equals_dense(name: str) -> dict:
    from engine.comm import Communicator
    from engine.tensor_parallel import is_partitioned
    from engine.tensor_parallel.autotp import shard_model
    from engine.tensor_parallel.dense_state import dense_state_dict
    comm = Communicator(None)
    torch.manual_seed(0)
    model = _build(*FAMILIES[PADDED.get(name, name)][:2], **FAMILIES[PADDED.get(name, name)][2])
    reference = copy.deepcopy(model)
    replaced = shard_model(model, comm)
    dense = dict(reference.named_parameters())
    g = torch.Generator().manual_seed(1)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (model, reference)]
    grad_err, loss_err = 0.0, 0.0
    for _ in range(STEPS):
        ids = torch.randint(1, V, (2, 12), generator=g)
        mask = _mask(ids, name in PADDED)
        losses = [m(input_ids=ids, labels=ids, attention_mask=mask).loss for m in (model, reference)]
        for loss in losses:
            loss.backward()
        loss_err = max(loss_err, abs(losses[0].item() - losses[1].item()))
        for n, p in model.named_parameters():
            grad_err = max(grad_err, (p.grad - _dense_slice(p, dense[n].grad, comm)).abs().max().item())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    param_err = max((p.detach() - _dense_slice(p, dense[n].detach(), comm)).abs().max().item()
                    for n, p in model.named_parameters())
    joined = dense_state_dict(model.state_dict(), model, comm)  # the shards joined as a checkpoint joins them
    state_err = max((joined[n] - t).abs().max().item() for n, t in reference.state_dict().items())
    return {"loss": loss_err, "grad": grad_err, "param": param_err, "state": state_err, "replaced": len(replaced),
            "sharded_params": sum(is_partitioned(p) for p in model.parameters())}


class _OtherFusedAttention(nn.Module):
    """A `query_key_value` of a class AutoTP has no layout for (ChatGLM's is q|k|v blocks of unequal width)."""

    def __init__(self):
        super().__init__()
        self.query_key_value, self.dense = nn.Linear(H, 2 * H), nn.Linear(H, H)

    def forward(self, x):
        return self.dense(self.query_key_value(x)[..., :H])


def _refusal(name: str) -> str:
    from engine.comm import Communicator
    from engine.tensor_parallel.autotp import shard_model
    model = nn.Sequential(_OtherFusedAttention()) if name == "unknown_fused" else _build(*REFUSED[name][:2],
                                                                                          **REFUSED[name][2])
    try:
        shard_model(model, Communicator(None))
        return "no error"
    except ValueError as err:
        return str(err)


def _initialize_route(family: str = "gpt_neox", clip: float = 0.0, zero: int = 0) -> dict:
    """A family through engine.initialize (autotp_size 2) against the dense model's SGD, clipped at `clip`
    (0: not clipped) as torch's clip_grad_norm_ clips it."""
    import engine
    torch.manual_seed(0)
    model = _build(*FAMILIES[family][:2], **FAMILIES[family][2])
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    eng, *_ = engine.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": clip,
        "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": zero},
        "zero_allow_untested_optimizer": True, "tensor_parallel": {"autotp_size": 2}})
    g = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    for _ in range(STEPS + 1):
        ids = torch.randint(1, V, (2, 12), generator=g)
        loss = eng(input_ids=ids, labels=ids).loss
        eng.backward(loss)
        eng.step()
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    from engine.comm import Communicator
    comm = Communicator(None)
    dense = dict(reference.named_parameters())
    param_err = max((p.detach() - _dense_slice(p, dense[n].detach(), comm)).abs().max().item()
                    for n, p in eng.module.named_parameters())
    sharded = type(eng.module.gpt_neox.layers[0].attention.query_key_value).__name__ if family == "gpt_neox" else ""
    eng.destroy()
    return {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)), "param": param_err, "qkv": sharded}


def _all() -> dict:
    out = {name: _equals_dense(name) for name in (*FAMILIES, *PADDED)}
    out.update({name: _refusal(name) for name in REFUSALS})
    out["initialize"] = _initialize_route()
    out["initialize_kv1_clipped"] = _initialize_route("llama_kv1", clip=0.05, zero=2)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all, 2, timeout=300)


@pytest.mark.parametrize("name", [*FAMILIES, *PADDED])
def test_family_trains_as_the_dense_model(results, name):
    for r in results:
        got = r[name]
        assert got["replaced"] == REPLACED.get(PADDED.get(name, name), 4) * L and got["sharded_params"] > 0, got
        assert got["loss"] < ATOL and got["grad"] < ATOL and got["param"] < ATOL and got["state"] < ATOL, got


# refusal -> how its one-line error starts: the module and why
REFUSALS = {"phi3_kv_heads": "2 does not divide the head counts of model.layers.0.self_attn",
            "falcon_multi_query": "transformer.h.0.self_attention (FalconAttention) is multi-query",
            "bloom_slow_but_exact": "transformer.h.0.self_attention (BloomAttention) has slow_but_exact",
            "unknown_fused": "0.query_key_value (_OtherFusedAttention) fuses q, k and v in a layout AutoTP does not "
                             "know"}


@pytest.mark.parametrize("name", REFUSALS)
def test_layout_that_cannot_be_cut_is_refused_naming_the_module(results, name):
    for r in results:
        assert r[name].startswith(f"tensor_parallel.autotp_size: {REFUSALS[name]}"), r[name]


def _four_ranks() -> dict:
    FAMILIES["llama_kv2"] = ("LlamaConfig", "LlamaForCausalLM", dict(COMMON, intermediate_size=I,
                                                                     num_key_value_heads=2, attention_bias=True))
    return _equals_dense("llama_kv2")


def test_key_value_heads_shared_by_two_of_four_ranks_train_as_the_dense_model():
    """2 key/value heads on 4 ranks: ranks 0-1 keep head 0, ranks 2-3 head 1 (kv_heads.py)."""
    for got in run_distributed(_four_ranks, 4, timeout=200):
        assert got["replaced"] == 7 * L and got["sharded_params"] > 0, got
        assert got["loss"] < ATOL and got["grad"] < ATOL and got["param"] < ATOL and got["state"] < ATOL, got


def test_one_key_value_head_through_initialize_clips_with_the_dense_norm(results):
    """Llama with one key/value head at ZeRO-2, clipping active (the norm counts each key/value weight
    slice once, the replicated bias once)."""
    for r in results:
        got = r["initialize_kv1_clipped"]
        assert got["loss"] < ATOL and got["param"] < ATOL, got


def test_gpt_neox_through_initialize_trains_as_the_dense_model(results):
    for r in results:
        got = r["initialize"]
        assert got["qkv"] == "ColumnParallelLinear", got
        assert got["loss"] < ATOL and got["param"] < ATOL, got
