"""Tensor parallelism equals the dense model.

Layers (2 ranks over gloo): each parallel layer's forward output, its input's gradient and its
parameters' gradients (this rank's slice of the dense gradient) equal the dense layer built from the
same seed. fp32 throughout; the only difference is the order a split matmul sums in (two half-sums
added by the all-reduce), so atol 1e-6 on values of order 1 (measured: below 3e-7).
Vocab-parallel cross-entropy equals `F.cross_entropy` (loss and gradient, with ignored targets), and
moves 3 floats per token in forward and nothing in backward: the vocabulary is never gathered.
Replicated parameters' gradients are bit-identical on both ranks (grads.py's note). Dropout: the
tracked stream differs per rank and leaves the default stream alone; the default stream agrees.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.harness import run_distributed

ATOL = 1e-6


def _slice(full: torch.Tensor, dim: int, rank: int, world: int, parts: int = 1) -> torch.Tensor:
    return torch.cat([s.chunk(world, dim=dim)[rank] for s in full.chunk(parts, dim=dim)], dim=dim)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _linear_cases(comm, errors: dict, replicated: dict) -> None:
    from engine.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    rank, world = comm.rank, comm.world_size
    for name, parts, gather in (("column", 1, False), ("column_gathered", 1, True), ("column_fused_qkv", 3, False)):
        torch.manual_seed(1)
        dense = nn.Linear(8, 12)
        torch.manual_seed(1)
        layer = ColumnParallelLinear(8, 12, gather_output=gather, parts=parts, group=comm)
        x = torch.randn(3, 5, 8, requires_grad=True)
        xd = x.detach().clone().requires_grad_()
        y, yd = layer(x), dense(xd)
        expected = yd if gather else _slice(yd, -1, rank, world, parts)
        weights = torch.randn_like(expected)  # a loss that weights every output differently
        (y * weights).sum().backward()
        upstream = torch.zeros_like(yd)  # the dense loss: every rank's weights in their places
        upstream_parts = [torch.zeros_like(weights) for _ in range(world)]
        torch.distributed.all_gather(upstream_parts, weights.contiguous())
        upstream = upstream_parts[0] if gather else _unslice(upstream_parts, parts)
        (yd * upstream).sum().backward()
        errors[name] = max(_err(y, expected), _err(x.grad, xd.grad),
                           _err(layer.weight.grad, _slice(dense.weight.grad, 0, rank, world, parts)),
                           _err(layer.bias.grad, _slice(dense.bias.grad, 0, rank, world, parts)))
        replicated[f"{name}.input_grad"] = x.grad
    for name, parallel_input in (("row", False), ("row_parallel_input", True)):
        torch.manual_seed(2)
        dense = nn.Linear(12, 6)
        torch.manual_seed(2)
        layer = RowParallelLinear(12, 6, input_is_parallel=parallel_input, group=comm)
        x_full = torch.randn(3, 5, 12)
        x = (_slice(x_full, -1, rank, world) if parallel_input else x_full).clone().requires_grad_()
        xd = x_full.clone().requires_grad_()
        y, yd = layer(x), dense(xd)
        weights = torch.randn_like(yd)
        (y * weights).sum().backward()
        (yd * weights).sum().backward()
        expected_xgrad = _slice(xd.grad, -1, rank, world) if parallel_input else xd.grad
        errors[name] = max(_err(y, yd), _err(x.grad, expected_xgrad),
                           _err(layer.weight.grad, _slice(dense.weight.grad, 1, rank, world)),
                           _err(layer.bias.grad, dense.bias.grad))
        replicated[f"{name}.bias_grad"] = layer.bias.grad


def _unslice(per_rank: list, parts: int) -> torch.Tensor:
    """Inverse of _slice over the ranks' pieces (each holding `parts` sections)."""
    sections = [p.chunk(parts, dim=-1) for p in per_rank]
    return torch.cat([torch.cat([s[i] for s in sections], dim=-1) for i in range(parts)], dim=-1)


def _embedding_case(comm, errors: dict) -> None:
    from engine.tensor_parallel import VocabParallelEmbedding
    torch.manual_seed(3)
    dense = nn.Embedding(10, 4)
    torch.manual_seed(3)
    layer = VocabParallelEmbedding(10, 4, group=comm)
    ids = torch.tensor([[0, 9, 4, 5, 5], [7, 1, 2, 3, 8]])
    weights = torch.randn(2, 5, 4)
    (layer(ids) * weights).sum().backward()
    (dense(ids) * weights).sum().backward()
    errors["embedding"] = max(_err(layer(ids), dense(ids)),
                              _err(layer.weight.grad, _slice(dense.weight.grad, 0, comm.rank, comm.world_size)))


def _block_cases(comm, errors: dict, replicated: dict) -> None:
    from engine.tensor_parallel import ParallelMLP, ParallelSelfAttention
    rank, world = comm.rank, comm.world_size
    torch.manual_seed(4)
    qkv, proj = nn.Linear(16, 48), nn.Linear(16, 16)
    torch.manual_seed(4)
    attn = ParallelSelfAttention(16, n_head=4, group=comm)
    x = torch.randn(2, 6, 16, requires_grad=True)
    xd = x.detach().clone().requires_grad_()
    q, k, v = (z.view(2, 6, 4, 4).transpose(1, 2) for z in qkv(xd).chunk(3, dim=-1))
    yd = proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 6, 16))
    y = attn(x)
    weights = torch.randn_like(yd)
    (y * weights).sum().backward()
    (yd * weights).sum().backward()
    errors["attention"] = max(_err(y, yd), _err(x.grad, xd.grad),
                              _err(attn.qkv.weight.grad, _slice(qkv.weight.grad, 0, rank, world, 3)),
                              _err(attn.proj.weight.grad, _slice(proj.weight.grad, 1, rank, world)),
                              _err(attn.proj.bias.grad, proj.bias.grad))
    torch.manual_seed(5)
    fc, out = nn.Linear(16, 64), nn.Linear(64, 16)
    torch.manual_seed(5)
    mlp = ParallelMLP(16, 64, group=comm)
    yd = out(F.gelu(fc(xd)))
    errors["mlp"] = _err(mlp(x), yd)
    replicated["attention.input_grad"] = x.grad


def _cross_entropy_case(comm, errors: dict, counts: dict) -> None:
    from engine.tensor_parallel import vocab_parallel_cross_entropy
    rank, world = comm.rank, comm.world_size
    torch.manual_seed(6)
    full = (torch.randn(4, 7, 20) * 3).requires_grad_()
    target = torch.randint(0, 20, (4, 7))
    target[0, :3] = -100  # ignored, as F.cross_entropy's default ignore_index
    local = _slice(full.detach(), -1, rank, world).requires_grad_()
    comm.stats.reset()
    loss = vocab_parallel_cross_entropy(local, target, group=comm)
    counts["forward"] = dict(comm.stats.bytes)
    comm.stats.reset()
    loss.backward()
    counts["backward"] = dict(comm.stats.bytes)
    reference = F.cross_entropy(full.view(-1, 20), target.view(-1))
    reference.backward()
    errors["cross_entropy"] = max(abs(loss.item() - reference.item()),
                                  _err(local.grad, _slice(full.grad, -1, rank, world)))


def _dropout_case(comm, out: dict) -> None:
    import engine.checkpointing as ac
    from engine.tensor_parallel import ModelParallelUnit, ParallelSelfAttention
    ac.configure(mpu_=ModelParallelUnit(comm))
    ac.model_parallel_cuda_manual_seed(1234)
    with ac.get_cuda_rng_tracker().fork():
        out["partitioned"] = torch.rand(16)
    out["replicated"] = F.dropout(torch.ones(16), p=0.5)
    attn = ParallelSelfAttention(16, n_head=4, dropout=0.5, group=comm)
    before = torch.get_rng_state()
    attn(torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0)))
    out["default_stream_untouched"] = torch.equal(before, torch.get_rng_state())
    ac.reset()


def _layers_on_rank():
    from engine.comm import Communicator
    comm = Communicator(None)
    errors, replicated, counts, dropout = {}, {}, {}, {}
    _linear_cases(comm, errors, replicated)
    _embedding_case(comm, errors)
    _block_cases(comm, errors, replicated)
    _cross_entropy_case(comm, errors, counts)
    _dropout_case(comm, dropout)
    return {"errors": errors, "replicated": replicated, "counts": counts, "dropout": dropout}


def _refusals() -> dict:
    """initialize()'s one-line errors for what does not compose with AutoTP yet."""
    import engine
    import schemas
    found = {}
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "tensor_parallel": {"autotp_size": 2}}
    cases = {"zero_init": {"zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True},
             "onebit": {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}, "stale_parameters": {},
             "odd_kv_heads": {}}
    for name, extra in cases.items():
        with engine.zero.Init(enabled=name == "zero_init"):  # AutoTP cannot cut what Init partitioned
            model = _tiny_llama(num_key_value_heads=3, heads=6) if name == "odd_kv_heads" else _tiny_gpt()
        params = list(model.parameters()) if name == "stale_parameters" else None
        try:
            engine.initialize(model=model, model_parameters=params, config={**base, **extra})
        except (schemas.ConfigError, ValueError) as err:
            found[name] = str(err)
    from transformers import Olmo2Config, Olmo2ForCausalLM  # q_norm over the whole query projection
    olmo = Olmo2ForCausalLM(Olmo2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=0,
                                        eos_token_id=0))
    from transformers import GptOssConfig, GptOssForCausalLM  # attention sinks: one per head, held directly
    oss = GptOssForCausalLM(GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                                         num_experts_per_tok=1, pad_token_id=0, bos_token_id=0, eos_token_id=0))
    try:
        engine.initialize(model=oss, config=base)
    except ValueError as err:
        found["head_sized_own_parameter"] = str(err)
    from transformers import StableLmConfig, StableLmForCausalLM  # q_layernorm: one LayerNorm per head
    stablelm = StableLmForCausalLM(StableLmConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=4, num_key_value_heads=2, qk_layernorm=True))
    for name, model in (("whole_width_norm", olmo), ("per_head_norms", stablelm)):
        eng, _, _, _ = engine.initialize(model=model, config=base)
        try:
            eng(input_ids=torch.zeros(1, 4, dtype=torch.long))
        except ValueError as err:
            found[name] = str(err)
    return found


def _guarded(check, *args):
    """A check's result, or its traceback: one broken check fails its own tests, not the whole spawn
    (the checks fail deterministically, so both ranks leave a check at the same collective)."""
    import traceback
    try:
        return check(*args)
    except Exception:  # noqa: BLE001 - reported by the test that reads this check
        return {"error": traceback.format_exc()}


def _two_rank_checks():
    """Everything that runs on 2 plain ranks, in one spawn (each spawn costs a torch import per rank)."""
    return {"layers": _guarded(_layers_on_rank), "gpt": _guarded(_autotp_model_on_rank, "gpt"),
            "gpt_sparse": _guarded(_autotp_model_on_rank, "gpt_sparse"),
            "hf_gpt2": _guarded(_autotp_model_on_rank, "hf_gpt2"),
            "hf_llama": _guarded(_autotp_model_on_rank, "hf_llama"),
            "hf_bigcode": _guarded(_autotp_model_on_rank, "hf_bigcode"),
            "hf_qwen3": _guarded(_autotp_model_on_rank, "hf_qwen3"),
            "stray_projection_call": _guarded(_stray_projection_call),
            "dropout": _guarded(_autotp_dropout_on_rank),
            "hf_gpt2_cross": _guarded(_autotp_cross_attention_on_rank),
            "refusals": _guarded(_refusals),
            "initialize": {0: _initialize_on_rank(0)}}


def _checked(result: dict) -> dict:
    assert "error" not in result, result.get("error")
    return result


@pytest.fixture(scope="module")
def two_rank_results():
    return run_distributed(_two_rank_checks, world_size=2, timeout=240)


@pytest.fixture(scope="module")
def layer_results(two_rank_results):
    return [_checked(r["layers"]) for r in two_rank_results]


@pytest.mark.parametrize("layer", ["column", "column_gathered", "column_fused_qkv", "row", "row_parallel_input",
                                   "embedding", "attention", "mlp", "cross_entropy"])
def test_parallel_layer_equals_dense(layer_results, layer):
    for rank, result in enumerate(layer_results):
        assert result["errors"][layer] < ATOL, f"rank {rank}: {layer} max error {result['errors'][layer]:.3g}"


def test_replicated_gradients_are_identical_on_every_rank(layer_results):
    first, second = (r["replicated"] for r in layer_results)
    assert first.keys() == second.keys() and first
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_vocab_parallel_cross_entropy_never_gathers_the_vocabulary(layer_results):
    tokens = 4 * 7
    for result in layer_results:
        # max (1 float) + [sum-exp, target logit] (2 floats) per token, all-reduced; backward is local
        assert result["counts"]["forward"] == {"all_reduce": 3 * tokens * 4}
        assert result["counts"]["backward"] == {}


def test_dropout_streams(layer_results):
    first, second = (r["dropout"] for r in layer_results)
    assert torch.equal(first["replicated"], second["replicated"])  # replicated region: same mask
    assert not torch.equal(first["partitioned"], second["partitioned"])  # partitioned: different
    assert first["default_stream_untouched"] and second["default_stream_untouched"]


# -- whole models: AutoTP on an unmodified model equals the dense model after 5 SGD steps ---------------
# SGD without momentum or clipping: the update is linear in the gradient, so a gradient off by the
# tensor-parallel size (or a replicated parameter's gradient counted twice) moves the weights.
# Both ranks see the same batch (tensor parallelism splits the model, not the data). fp32, atol 1e-5
# after 5 steps at lr 0.5 (summation order only; measured below 1e-6); norms rtol 1e-5.
MODEL_ATOL, STEPS, LR = 1e-5, 5, 0.5


def _tiny_gpt():
    from examples.gpt import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32))


def _tiny_sparse_gpt():
    """Sparse attention with a different layout per head: each rank must attend with its own heads' part."""
    from examples.gpt import GPT, GPTConfig
    from ops.sparse_attention import FixedSparsityConfig
    sparsity = FixedSparsityConfig(num_heads=4, block=2, num_local_blocks=4, different_layout_per_head=True,
                                   num_different_global_patterns=4)  # head h: its own global block per window
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32, sparsity=sparsity))


def _tiny_hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _tiny_hf_bigcode():
    """GPTBigCode with multi-head attention: its fused c_attn is laid out head by head (autotp.py's note)."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM
    cfg = GPTBigCodeConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, multi_query=False,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPTBigCodeForCausalLM(cfg)


def _tiny_qwen3():
    """Qwen3: a per-head RMSNorm (q_norm, k_norm) inside the attention region (region_params.py's note)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=16)
    return Qwen3ForCausalLM(cfg)


def _tiny_llama(num_key_value_heads: int = 2, heads: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=8 * heads, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=heads,
                      num_key_value_heads=num_key_value_heads, max_position_embeddings=16)
    return LlamaForCausalLM(cfg)


def _loss(model, kind: str, x, y):
    return model(x, y) if kind.startswith("gpt") else model(input_ids=x, labels=x).loss


def _full_of(reference: nn.Module, name: str) -> torch.Tensor:
    from engine.tensor_parallel.layers import dense_weight
    module_path, _, leaf = name.rpartition(".")
    module = reference.get_submodule(module_path)
    return dense_weight(module) if leaf == "weight" else getattr(module, leaf)


def _autotp_model_on_rank(kind: str):
    import copy

    from engine.comm import Communicator
    from engine.tensor_parallel import is_partitioned, tensor_parallel_grad_norm
    from engine.tensor_parallel.autotp import shard_model
    from engine.tensor_parallel.layers import shard
    comm = Communicator(None)
    torch.manual_seed(0)
    model = {"gpt": _tiny_gpt, "gpt_sparse": _tiny_sparse_gpt, "hf_gpt2": _tiny_hf_gpt2, "hf_llama": _tiny_llama,
             "hf_bigcode": _tiny_hf_bigcode, "hf_qwen3": _tiny_qwen3}[kind]()
    reference = copy.deepcopy(model)
    replaced = shard_model(model, comm)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 64, (4, 17), generator=g) for _ in range(STEPS)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (model, reference)]
    loss_err = norm_err = 0.0
    for batch in data:
        x, y = batch[:, :-1], batch[:, 1:]
        losses = [_loss(m, kind, x, y) for m in (model, reference)]
        for loss in losses:
            loss.backward()
        loss_err = max(loss_err, abs(losses[0].item() - losses[1].item()))
        norm = tensor_parallel_grad_norm(list(model.parameters()), comm).item()
        ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
        norm_err = max(norm_err, abs(norm - ref_norm) / ref_norm)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    param_err = 0.0
    for name, p in model.named_parameters():
        full = _full_of(reference, name)
        if is_partitioned(p):
            full = shard(full, p.tensor_parallel_dim, comm.rank, comm.world_size, p.tensor_parallel_parts)
        param_err = max(param_err, _err(p.detach(), full.detach()))
    return {"replaced": replaced, "loss": loss_err, "norm": norm_err, "params": param_err,
            "partitioned": sum(is_partitioned(p) for p in model.parameters())}


def _stray_projection_call() -> dict:
    """A sharded projection called outside its block's forward (inspecting its output) leaves no region
    open for the block's next forward: its layer norms' gradients stay the dense ones (summed over the
    ranks they would be T times too large; the whole-width check would refuse ln1)."""
    import copy

    from engine.comm import Communicator
    from engine.tensor_parallel.autotp import shard_model
    torch.manual_seed(0)
    model = _tiny_gpt()
    reference = copy.deepcopy(model)
    shard_model(model, Communicator(None))
    with torch.no_grad():
        model.blocks[0].qkv(torch.randn(2, 8, model.blocks[0].ln1.normalized_shape[0]))
    x = torch.randint(0, 64, (2, 8))
    losses = []
    for m in (model, reference):
        loss = m(x, x)
        loss.backward()
        losses.append(loss.item())
    pairs = zip(model.blocks[0].ln1.parameters(), reference.blocks[0].ln1.parameters())
    return {"ln1_grad": max(_err(a.grad, b.grad) for a, b in pairs), "losses": losses}


def _autotp_cross_attention_on_rank() -> dict:
    """HF GPT-2 with cross-attention (`q_attn` apart, `c_attn` fusing only k|v): AutoTP leaves that
    attention whole and shards the rest; the loss and its input gradient equal the dense model's."""
    import copy

    from engine.comm import Communicator
    from engine.tensor_parallel.autotp import shard_model
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=48, n_layer=1, n_head=4,
                                       add_cross_attention=True, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0))
    reference = copy.deepcopy(model)
    replaced = shard_model(model, Communicator(None))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    encoder = [torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(2), requires_grad=True) for _ in range(2)]
    losses = [m(input_ids=ids, labels=ids, encoder_hidden_states=e).loss for m, e in zip((model, reference), encoder)]
    for loss in losses:
        loss.backward()
    return {"replaced": replaced, "loss": abs(losses[0].item() - losses[1].item()),
            "encoder_grad": (encoder[0].grad - encoder[1].grad).abs().max().item()}


def _autotp_dropout_on_rank() -> dict:
    """AutoTP'd HF GPT-2 (eager attention: `F.dropout` on the probabilities of this rank's 2 heads,
    then on the replicated output), its block checkpointed: every dropout mask of one training step,
    drawn in the forward and again in the recompute; and the generator state examples/gpt.py's SDPA
    dropout drew from, and the default one after its forward."""
    import engine.checkpointing as ac
    from engine.comm import Communicator
    from engine.tensor_parallel import ModelParallelUnit
    from engine.tensor_parallel.autotp import shard_model
    from examples.gpt import GPT, GPTConfig
    from schemas.features import ActivationCheckpointingConfig
    from transformers import GPT2Config, GPT2LMHeadModel
    comm = Communicator(None)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4, attn_pdrop=0.5,
                                       resid_pdrop=0.5, embd_pdrop=0.0, attn_implementation="eager"))
    gpt = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=4, d_model=32, dropout=0.5))
    shard_model(model, comm)
    shard_model(gpt, comm)
    ac.checkpoint_blocks(model, ActivationCheckpointingConfig(checkpoint_module_classes=["GPT2Block"]))
    ac.configure(mpu_=ModelParallelUnit(comm))
    ac.model_parallel_cuda_manual_seed(7)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    masks, dropout = [], F.dropout

    def recording(t, p=0.5, training=True, inplace=False):
        y = dropout(t, p, training, inplace)
        if p > 0:  # not the embedding's (embd_pdrop 0)
            masks.append(y == 0)
        return y

    torch.nn.functional.dropout = recording
    try:
        model(input_ids=x, labels=x).loss.backward()
    finally:
        torch.nn.functional.dropout = dropout
    sdpa_states, sdpa = [], F.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        sdpa_states.append(torch.get_rng_state())  # what its dropout_p draws from
        return sdpa(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = recording_sdpa
    try:
        gpt(x, x)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    masks += [sdpa_states[0], torch.get_rng_state()]  # the region's stream, then the default one after
    gathered = [[torch.empty_like(m) for _ in range(comm.world_size)] for m in masks]
    for out, m in zip(gathered, masks):
        torch.distributed.all_gather(out, m)
    ac.reset()
    return {"shapes": [tuple(m.shape) for m in masks[:-2]], "recompute_same": [torch.equal(m, masks[i + 3])
            for i, m in enumerate(masks[:2])], "ranks_same": [torch.equal(*g) for g in gathered[:3]],
            "sdpa_stream_same": torch.equal(*gathered[-2]), "default_stream_same_after": torch.equal(*gathered[-1])}


def test_autotp_dropout_differs_per_rank_inside_the_split_heads_and_replays_in_the_recompute(two_rank_results):
    """The dense model draws independent masks per head: on its heads each tensor rank draws its own
    (dropout_region.py); on the replicated output both draw the same; a recompute draws the forward's."""
    for rank, r in enumerate(_checked(r["dropout"]) for r in two_rank_results):
        # the forward: attention probabilities (2 local heads), then the attention's and the MLP's outputs;
        # the recompute stops after the last tensor backward needs (torch's early stop): the first two again
        assert r["shapes"] == [(2, 2, 16, 16), (2, 16, 32), (2, 16, 32), (2, 2, 16, 16), (2, 16, 32)], r
        assert r["recompute_same"] == [True, True], (rank, r)
        assert r["ranks_same"] == [False, True, True], (rank, r)
        # examples/gpt.py's SDPA dropout: a stream of its own per rank; the default stream agrees after
        assert not r["sdpa_stream_same"] and r["default_stream_same_after"], (rank, r)


def test_autotp_leaves_gpt2_cross_attention_whole(two_rank_results):
    for rank, r in enumerate(_checked(r["hf_gpt2_cross"]) for r in two_rank_results):
        assert r["replaced"] == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
                                 "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"], r["replaced"]
        assert r["loss"] < MODEL_ATOL and r["encoder_grad"] < MODEL_ATOL, (rank, r)


AUTOTP_FIRST_BLOCK = {
    "gpt": ["blocks.0.qkv", "blocks.0.proj", "blocks.0.fc", "blocks.0.out"],
    "gpt_sparse": ["blocks.0.qkv", "blocks.0.proj", "blocks.0.fc", "blocks.0.out"],
    "hf_gpt2": ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
                "transformer.h.0.mlp.c_proj"],
    "hf_bigcode": ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
                   "transformer.h.0.mlp.c_proj"],
    "hf_qwen3": [f"model.layers.0.self_attn.{n}_proj" for n in "qkvo"]
                + [f"model.layers.0.mlp.{n}_proj" for n in ("gate", "up", "down")],
    "hf_llama": [f"model.layers.0.self_attn.{n}_proj" for n in "qkvo"]
                + [f"model.layers.0.mlp.{n}_proj" for n in ("gate", "up", "down")]}
# sharded parameters of the 2-layer models: weights, plus column-parallel biases (row biases stay whole)
AUTOTP_PARTITIONED = {"gpt": 2 * (4 + 2), "gpt_sparse": 2 * (4 + 2), "hf_gpt2": 2 * (4 + 2), "hf_bigcode": 2 * (4 + 2),
                      "hf_qwen3": 2 * 7, "hf_llama": 2 * 7}


@pytest.mark.parametrize("kind", ["gpt", "gpt_sparse", "hf_gpt2", "hf_bigcode", "hf_qwen3", "hf_llama"])  # transformers is a test extra: never skipped
def test_autotp_model_equals_dense_after_sgd_steps(two_rank_results, kind):
    results = [_checked(r[kind]) for r in two_rank_results]
    expected = AUTOTP_FIRST_BLOCK[kind]
    for rank, r in enumerate(results):
        assert r["replaced"][:len(expected)] == expected and len(r["replaced"]) == 2 * len(expected), r["replaced"]
        assert r["partitioned"] == AUTOTP_PARTITIONED[kind], r["partitioned"]
        assert r["loss"] < MODEL_ATOL and r["params"] < MODEL_ATOL, (rank, r)
        assert r["norm"] < 1e-5, (rank, r)


# -- from the config: initialize() with tensor_parallel.autotp_size -----------------------------------
# The reference trains the dense GPT in one process on the global batch (both data ranks' samples),
# with SGD: unclipped (a wrong gradient scale moves the weights), and clipped by torch's
# clip_grad_norm_ at CLIP, below every step's norm (checked), so every step is scaled by CLIP / norm
# and a norm counted wrong (a replicated parameter T times, a shard once) moves the weights and the
# reported norm. ZeRO-1, 2 and 3 partition over the data axis only (stage 3 also gathers over it, and
# its save_16bit_model joins the shards). AdamW (clipped) at ZeRO-2 and 3: Adam's
# update barely depends on the gradient's scale, so there the reported norm is the norm's oracle and
# the weights check everything else (moments, bias correction, decay on the right shards). Adam divides
# each gradient element by its own running magnitude, so the summation-order noise of near-zero
# elements becomes visible: ADAM_ATOL 1e-4 (measured 2.5e-5) against 5 steps that move weights by ~5e-2.
CLIP = 0.05
OPTIMIZERS = {"SGD": {"lr": LR}, "AdamW": {"lr": 1e-2, "weight_decay": 0.1}}
ADAM_ATOL = 1e-4


# Stage 3: matrices partitioned and gathered around their use, norms and biases (at most 64 elements)
# kept whole (both kinds exercised); save_16bit_model gathers them.
STAGE3 = {"stage3_param_persistence_threshold": 64, "stage3_gather_16bit_weights_on_model_save": True}


def _whole_params(eng) -> dict:
    """name -> this rank's parameter (its shard, or a replicated one) as a tensor: at stage 3 gathered
    over the data axis (between uses it is a placeholder), elsewhere as it is."""
    import engine
    params = dict(eng.module.named_parameters())
    with engine.zero.GatheredParameters(list(params.values())):
        return {n: p.detach().clone() for n, p in params.items()}


def _saved_16bit_error(eng, reference: nn.Module) -> float | None:
    """`save_16bit_model` writes the dense model's state dict (shards joined, dense_state.py): on global
    rank 0, loaded strictly into the dense GPT, its largest distance to `reference`; None elsewhere."""
    import tempfile

    import torch.distributed as dist
    with tempfile.TemporaryDirectory() as d:
        assert eng.save_16bit_model(d)
        if dist.get_rank() != 0:
            return None
        dense = _tiny_gpt()
        dense.load_state_dict(torch.load(f"{d}/pytorch_model.bin", weights_only=True))
    return max(_err(p.detach(), q.detach()) for p, q in zip(dense.parameters(), reference.parameters()))


def _config(stage: int, data: int, clip: float = 0.0, fp16: bool = False, optimizer: str = "SGD") -> dict:
    return {"train_micro_batch_size_per_gpu": 4 // data, "gradient_accumulation_steps": 1,
            "gradient_clipping": clip, "optimizer": {"type": optimizer, "params": OPTIMIZERS[optimizer]},
            "zero_allow_untested_optimizer": True, "fp16": {"enabled": fp16, "initial_scale_power": 8, "hysteresis": 1},
            "zero_optimization": {"stage": stage, **(STAGE3 if stage == 3 else {})},
            "tensor_parallel": {"autotp_size": 2}}


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (4, 17), generator=g) for _ in range(STEPS)]


def _reference_run(model_state: dict, clip: float, optimizer: str = "SGD") -> dict:
    reference = _tiny_gpt()
    reference.load_state_dict(model_state)
    ref_opt = getattr(torch.optim, optimizer)(reference.parameters(), **OPTIMIZERS[optimizer])
    losses, norms = [], []
    for batch in _batches():
        loss = reference(batch[:, :-1], batch[:, 1:])
        loss.backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip).item())
        else:
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item())
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())
    return {"model": reference, "losses": losses, "norms": norms}


def _train_on_rank(stage: int, clip: float, optimizer: str = "SGD") -> dict:
    import torch.distributed as dist

    import engine
    from engine.tensor_parallel import is_partitioned
    from engine.tensor_parallel.layers import shard
    from engine.topology import current
    torch.manual_seed(0)
    model = _tiny_gpt()
    ref = _reference_run(model.state_dict(), clip, optimizer)
    data = dist.get_world_size() // 2
    eng, *_ = engine.initialize(model=model, config=_config(stage, data, clip, optimizer=optimizer))
    coord = current().coord
    micro = 4 // data
    losses, norms = [], []
    for batch in _batches():
        mine = batch[coord.data * micro:(coord.data + 1) * micro]
        loss = eng(mine[:, :-1], mine[:, 1:])
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
        norms.append(eng.get_global_grad_norm())
    err = 0.0
    for name, value in _whole_params(eng).items():
        p, full = dict(eng.module.named_parameters())[name], _full_of(ref["model"], name)
        if is_partitioned(p):
            full = shard(full, p.tensor_parallel_dim, coord.model, 2, p.tensor_parallel_parts)
        err = max(err, _err(value, full.detach()))
    saved = _saved_16bit_error(eng, ref["model"]) if optimizer == "SGD" and not clip else None
    placeholders = sum(p.numel() == 0 for p in eng.module.parameters())  # stage 3: partitioned between uses
    eng.destroy()
    return {"coord": tuple(coord), "stage": stage, "placeholders": placeholders, "losses": losses,
            "ref_losses": ref["losses"], "params": err, "saved16": saved,
            "norms": norms, "ref_norms": ref["norms"], "atol": ADAM_ATOL if optimizer == "AdamW" else MODEL_ATOL}


INF_STEP = 1  # the step whose gradient is made Inf, on tensor rank 1 of data rank 0 only


def _overflow_on_rank(stage: int) -> dict:
    """fp16 with a dynamic loss scale; one column-parallel weight's gradient made Inf on one rank."""
    import torch.distributed as dist

    import engine
    from engine.tensor_parallel import is_partitioned
    from engine.topology import current
    torch.manual_seed(0)
    data = dist.get_world_size() // 2
    eng, *_ = engine.initialize(model=_tiny_gpt(), config=_config(stage, data, CLIP, fp16=True))
    coord = current().coord
    poisoned = next(p for p in eng.module.parameters() if is_partitioned(p))
    micro = 4 // data
    changed, scales = [], []
    for step, batch in enumerate(_batches()[:3]):
        hook = None
        if step == INF_STEP and coord.model == 1 and coord.data == 0:
            hook = poisoned.register_hook(lambda g: torch.full_like(g, float("inf")))
        before = _whole_params(eng)
        mine = batch[coord.data * micro:(coord.data + 1) * micro]
        eng.backward(eng(mine[:, :-1], mine[:, 1:]))
        eng.step()
        if hook is not None:
            hook.remove()
        changed.append(any(not torch.equal(before[n], p) for n, p in _whole_params(eng).items()))
        scales.append(eng.zero_optimizer.guard.scaler.loss_scale)
    result = {"coord": tuple(coord), "changed": changed, "scales": scales, "skipped": eng.skipped_steps}
    eng.destroy()
    return result


CLIPPED_WITH = {0: "SGD", 1: "SGD", 2: "AdamW", 3: "AdamW"}


def _initialize_on_rank(stage: int, overflow: bool = True) -> dict:
    """Every from-the-config case of one ZeRO stage (the overflow skip: stages 0, 1 and 3; stage 2's norm
    code is stage 1's, engine/zero/partitioned.py, and stage 3 inherits it with its own parameters)."""
    cases = {"sgd": _guarded(_train_on_rank, stage, 0.0),
             "clipped": _guarded(_train_on_rank, stage, CLIP, CLIPPED_WITH[stage])}
    if overflow:
        cases["overflow"] = _guarded(_overflow_on_rank, stage)
    return cases


def _fp16_clipped(tensor_parallel: bool) -> dict:
    """fp16 with clipping active at every step, ZeRO-2: on 2 model × 2 data (`tensor_parallel`), or the
    same config on this process alone, the same-precision reference. The fp32 masters (this rank's
    shards, whole over the data axis), losses and the norms clipped with."""
    import torch.distributed as dist

    import engine
    from engine.topology import current
    from engine.utils import safe_get_full_fp32_param
    torch.manual_seed(0)
    data = dist.get_world_size() // 2 if tensor_parallel else 1
    config = _config(2, data, CLIP, fp16=True)
    if not tensor_parallel:
        config.pop("tensor_parallel")
    eng, *_ = engine.initialize(model=_tiny_gpt(), config=config)
    start = {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters()}
    coord = current().coord if tensor_parallel else None
    micro = 4 // data
    losses, norms = [], []
    for batch in _batches():
        mine = batch[coord.data * micro:(coord.data + 1) * micro] if tensor_parallel else batch
        loss = eng(mine[:, :-1], mine[:, 1:])
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
        norms.append(eng.get_global_grad_norm())
    result = {"coord": tuple(coord) if coord else None, "losses": losses, "norms": norms, "start": start,
              "masters": {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters()},
              "layouts": {n: (p.tensor_parallel_dim, p.tensor_parallel_parts) for n, p in eng.module.named_parameters()
                          if getattr(p, "tensor_parallel_dim", None) is not None},
              "skipped": eng.skipped_steps}
    eng.destroy()
    return result


class _DenseMLP(nn.Module):
    """`ParallelMLP`'s dense counterpart: the same two layers, built in the same order (the same weights
    from the same seed: each parallel layer cuts its shard from such a dense layer, layers.py)."""

    def __init__(self, d_model: int, d_hidden: int):
        super().__init__()
        self.fc, self.out = nn.Linear(d_model, d_hidden), nn.Linear(d_hidden, d_model)

    def forward(self, x):
        return self.out(F.gelu(self.fc(x)))


class _LayerNet(nn.Module):
    """An embedding, an MLP from engine.tensor_parallel's layers (`parallel`) or dense, a norm, a head."""

    def __init__(self, parallel: bool):
        super().__init__()
        from engine.tensor_parallel import ParallelMLP
        self.tok = nn.Embedding(64, 32)
        self.mlp = (ParallelMLP if parallel else _DenseMLP)(32, 64)
        self.norm, self.head = nn.LayerNorm(32), nn.Linear(32, 64)

    def forward(self, x, y):
        h = self.tok(x)
        return F.cross_entropy(self.head(self.norm(h + self.mlp(h))).flatten(0, 1), y.flatten())


def _layers_in_zero_init() -> dict:
    """The Megatron-layer route at ZeRO-3: the topology set first, the model built from ParallelMLP inside
    `engine.zero.Init` (each dense layer gathered for its cut, the shards partitioned over the data axis
    only), trained 5 steps with SGD unclipped against the dense net on the global batch."""
    import engine
    from engine.tensor_parallel import is_partitioned
    from engine.tensor_parallel.layers import shard
    from engine.topology import ProcessGroups, Topology, set_current
    groups = ProcessGroups(Topology.for_world(4, model=2))
    set_current(groups)
    torch.manual_seed(0)
    reference = _LayerNet(parallel=False)
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    config = _config(3, 2)
    torch.manual_seed(0)
    with engine.zero.Init(config=config):
        model = _LayerNet(parallel=True)
    placeholders = sum(p.numel() == 0 for p in model.parameters())  # partitioned as built
    eng, *_ = engine.initialize(model=model, config=config)
    coord = groups.coord
    for batch in _batches():
        loss = reference(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mine = batch[coord.data * 2:(coord.data + 1) * 2]
        eng.backward(eng(mine[:, :-1], mine[:, 1:]))
        eng.step()
    err, sharded = 0.0, 0
    ref_params = dict(reference.named_parameters())
    for name, value in _whole_params(eng).items():
        p, full = dict(eng.module.named_parameters())[name], ref_params[name].detach()
        if is_partitioned(p):
            full, sharded = shard(full, p.tensor_parallel_dim, coord.model, 2, p.tensor_parallel_parts), sharded + 1
        err = max(err, _err(value, full))
    eng.destroy()
    return {"params": err, "sharded": sharded, "placeholders": placeholders}


def _four_rank_checks():
    """2 model × 2 data: ZeRO-1, ZeRO-2 and ZeRO-3 (AutoTP; Megatron layers built inside zero.Init) in
    one spawn; then rank 0 alone (tests/worlds.py) for the same-precision reference of fp16 with clipping."""
    import torch.distributed as dist

    from tests.worlds import new_world
    rank = dist.get_rank()
    out = {"initialize": {stage: _initialize_on_rank(stage, overflow=stage != 2) for stage in (1, 2, 3)},
           "layers_zero_init": _guarded(_layers_in_zero_init), "fp16_clipped": _guarded(_fp16_clipped, True)}
    new_world(None, 0, 1)
    if rank == 0:
        out["fp16_reference"] = _guarded(_fp16_clipped, False)
    return out


@pytest.fixture(scope="module")
def four_rank_results():
    return run_distributed(_four_rank_checks, world_size=4, timeout=300)


RESULTS_OF_WORLD = {2: "two_rank_results", 4: "four_rank_results"}


@pytest.fixture(scope="module", params=[(2, 0), (4, 1), (4, 2), (4, 3)],
                ids=["tp2", "tp2xdp2-zero1", "tp2xdp2-zero2", "tp2xdp2-zero3"])
def initialized(request):
    world, stage = request.param
    results = request.getfixturevalue(RESULTS_OF_WORLD[world])
    return world, [r["initialize"][stage] for r in results]


def _check_equals_reference(world: int, results: list) -> None:
    assert sorted(r["coord"] for r in results) == sorted((0, d, m) for d in range(world // 2) for m in range(2))
    for r in results:
        assert (r["placeholders"] > 0) == (r["stage"] == 3), r  # ZeRO-3 really partitions (the matrices)
        assert r["params"] < r["atol"], r
        if world == 2:  # one data rank: its loss is the global batch's
            assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) < MODEL_ATOL, r
    if world == 4:  # the mean of the two data ranks' losses is the global batch's
        by_data = {r["coord"][1]: r["losses"] for r in results}
        mean = [(a + b) / 2 for a, b in zip(by_data[0], by_data[1])]
        assert max(abs(a - b) for a, b in zip(mean, results[0]["ref_losses"])) < MODEL_ATOL


def test_initialize_with_autotp_equals_reference(initialized):
    world, results = initialized
    _check_equals_reference(world, [_checked(r["sgd"]) for r in results])
    # save_16bit_model: one file, the dense model's state dict (global rank 0 wrote it and read it back)
    assert [r["sgd"]["saved16"] is not None for r in results] == [True] + [False] * (world - 1)
    assert results[0]["sgd"]["saved16"] < MODEL_ATOL, results[0]["sgd"]["saved16"]


def test_megatron_layers_built_in_zero_init_equal_dense_at_zero3(four_rank_results):
    for r in four_rank_results:
        got = _checked(r["layers_zero_init"])
        assert got["placeholders"] == 9 and got["sharded"] == 3, got  # 9 parameters; fc.weight, fc.bias, out.weight cut
        assert got["params"] < MODEL_ATOL, got


def test_clipping_uses_the_whole_models_norm(initialized):
    world, results = initialized
    clipped = [_checked(r["clipped"]) for r in results]
    assert min(clipped[0]["ref_norms"]) > 2 * CLIP, clipped[0]["ref_norms"]  # clipping active every step
    _check_equals_reference(world, clipped)
    for r in clipped:  # get_global_grad_norm(): the reference's norm before clipping, on every rank
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5), r


@pytest.mark.parametrize("world, stage", [(2, 0), (4, 1), (4, 3)], ids=["tp2", "tp2xdp2-zero1", "tp2xdp2-zero3"])
def test_an_inf_on_one_tensor_rank_skips_the_step_everywhere(request, world, stage):
    results = [r["initialize"][stage] for r in request.getfixturevalue(RESULTS_OF_WORLD[world])]
    overflow = [_checked(r["overflow"]) for r in results]
    for r in overflow:
        assert r["changed"] == [True, False, True] and r["skipped"] == 1, r
        assert r["scales"][INF_STEP] == r["scales"][0] / 2, r  # the dynamic loss scale backed off
    assert len({tuple(r["scales"]) for r in overflow}) == 1, overflow


def test_a_projection_called_outside_its_block_leaves_no_region_open(two_rank_results):
    for r in two_rank_results:
        assert _checked(r["stray_projection_call"])["ln1_grad"] < MODEL_ATOL, r["stray_projection_call"]


def test_what_does_not_compose_yet_is_refused_by_name(two_rank_results):
    refusals = _checked(two_rank_results[0]["refusals"])
    assert "tensor_parallel.autotp_size: the model was built inside engine.zero.Init" in refusals["zero_init"]
    assert "pass model_parameters=None or model.parameters()" in refusals["stale_parameters"]
    # GQA with key/value heads T does not divide (fewer than T is built: kv_heads.py); HF's LlamaAttention
    # keeps its head counts in its config
    assert refusals["odd_kv_heads"] == (
        "tensor_parallel.autotp_size: 2 does not divide the head counts of model.layers.0.self_attn "
        "(config.num_attention_heads = 6, config.num_key_value_heads = 3): each rank must hold whole query and "
        "key/value heads; use an autotp_size that divides them")
    assert "optimizer.type: OneBitAdam (a 1-bit optimizer) with tensor_parallel.autotp_size > 1 is not built" \
        in refusals["onebit"]
    assert refusals["head_sized_own_parameter"].startswith(
        "tensor_parallel.autotp_size: model.layers.0.self_attn.sinks (4,) is sized by the attention heads")
    assert refusals["whole_width_norm"].startswith(  # not a shape error in OLMo2's forward
        "tensor parallelism: Olmo2RMSNorm's weight (32,) runs between a column-parallel layer and its row-parallel")
    assert refusals["per_head_norms"].startswith(  # it trained silently wrong: rank 1's heads met heads 0-1's norms
        "tensor parallelism: StableLmLayerNormPerHead's norms.0.weight ... norms.3.weight (4, one per head) run between")


# fp16 with clipping on 2 model × 2 data at ZeRO-2 against the same-precision engine in one process:
# fp32 masters within FP16_TOL of each parameter's update (the largest element of master − start;
# rounding in another summation order moves them by a small part of it, a wrong clip coefficient by
# a large part), norms rel 1e-3. Measured: masters 0.34% of the update, norms 9.4e-5, the global
# batch's losses 6.8e-6, the first norm against fp32 4.4e-5.
# The first step's norm (same weights before any update) equals the fp32 reference's up to fp16
# rounding: the norm is unscaled before it is reported and clipped with.
FP16_TOL = 1e-2


def test_fp16_clipping_with_zero2_uses_the_whole_models_unscaled_norm(four_rank_results):
    from engine.tensor_parallel.layers import shard
    ref = _checked(four_rank_results[0]["fp16_reference"])
    torch.manual_seed(0)
    fp32 = _reference_run(_tiny_gpt().state_dict(), CLIP)  # the weights _fp16_clipped starts from
    assert min(ref["norms"]) > CLIP and ref["skipped"] == 0, ref["norms"]  # clipping acts at every step
    results = [_checked(r["fp16_clipped"]) for r in four_rank_results]
    assert sorted(r["coord"] for r in results) == [(0, d, m) for d in range(2) for m in range(2)]
    for r in results:
        assert r["skipped"] == 0 and r["layouts"], r["coord"]
        assert r["norms"][0] == pytest.approx(fp32["norms"][0], rel=1e-2), r["coord"]
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-3), r["coord"]
        for name, master in r["masters"].items():
            dim, parts = r["layouts"].get(name, (None, 1))
            cut = (lambda t: t) if dim is None else (lambda t: shard(t, dim, r["coord"][2], 2, parts))  # noqa: E731
            want, start = cut(ref["masters"][name]), cut(ref["start"][name])
            update = (want - start).abs().max()
            assert update > 0 and (master - want).abs().max() <= FP16_TOL * update, (r["coord"], name)
    by_data = {r["coord"][1]: r["losses"] for r in results}  # the global batch's loss: the data ranks' mean
    assert [(a + b) / 2 for a, b in zip(by_data[0], by_data[1])] == pytest.approx(ref["losses"], rel=FP16_TOL)
