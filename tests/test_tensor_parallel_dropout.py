"""Dropout under tensor parallelism (engine/tensor_parallel/dropout_region.py), on 2 tensor ranks.

The rule (Megatron's): a dropout on a partitioned tensor (this rank's heads or hidden features) draws a
different mask on every tensor rank, as the dense model draws independent masks per head; a dropout on
a replicated tensor draws the same mask everywhere; a recompute draws the forward's masks. The cases are
the real layouts: HF GPT-2 through `tensor_parallel.autotp_size` with HF's own gradient checkpointing
(torch.utils.checkpoint), HF Llama's attention dropout, and a user's block built from dstrain's layers.
"""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.harness import run_distributed

TP_CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
             "tensor_parallel": {"autotp_size": 2}}


class MaskRecorder:
    """Every dropout mask `F.dropout` draws while active (HF's modules and eager attention call it)."""

    def __init__(self):
        self.masks, self._dropout = [], F.dropout

    def __enter__(self):
        def recording(t, p=0.5, training=True, inplace=False):
            y = self._dropout(t, p, training, inplace)
            if p > 0 and training:
                self.masks.append(y == 0)
            return y

        torch.nn.functional.dropout = recording
        return self.masks

    def __exit__(self, *exc):
        torch.nn.functional.dropout = self._dropout


def _same_on_both_ranks(tensor: torch.Tensor) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(2)]
    torch.distributed.all_gather(gathered, tensor)
    return torch.equal(*gathered)


def _gpt2_step(checkpointed: bool, reentrant: bool = False) -> dict:
    """One forward and backward of an AutoTP'd HF GPT-2 (attention and residual dropout 0.5)."""
    import engine
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                       attn_pdrop=0.5, resid_pdrop=0.5, embd_pdrop=0.0, use_cache=False,
                                       attn_implementation="eager"))
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    eng, *_ = engine.initialize(model=model, config=TP_CONFIG)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with MaskRecorder() as masks:
        loss = eng(input_ids=ids, labels=ids).loss
        eng.backward(loss)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), "grads": grads, "masks": masks}


def _against_plain(plain: dict, checkpointed: dict) -> dict:
    forward = plain["masks"]
    return {
        "loss_equal": torch.equal(plain["loss"], checkpointed["loss"]),
        "grads_equal": sorted(n for n, g in plain["grads"].items() if torch.equal(g, checkpointed["grads"][n])),
        # the checkpointed run's forward, then its recomputes (the masks of the plain forward, per layer)
        "recomputes_equal_forward": [any(torch.equal(m, r) for m in forward) for r in checkpointed["masks"]],
        "recomputed": len(checkpointed["masks"]) - len(forward),
    }


def _gpt2_with_hf_gradient_checkpointing() -> dict:
    plain = _gpt2_step(False)
    forward = plain["masks"]  # per layer: attention probabilities (2 local heads), attention out, MLP out
    return {
        "shapes": [tuple(m.shape) for m in forward],
        "grads": sorted(plain["grads"]),
        "non_reentrant": _against_plain(plain, _gpt2_step(True)),
        "reentrant": _against_plain(plain, _gpt2_step(True, reentrant=True)),
        "ranks_same": [_same_on_both_ranks(m) for m in forward],
        "heads_same": torch.equal(forward[0][:, 0], forward[0][:, 1]),
    }


def _llama_attention_dropout() -> dict:
    import engine
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.5,
                                         max_position_embeddings=16, attn_implementation="eager"))
    eng, *_ = engine.initialize(model=model, config=TP_CONFIG)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with MaskRecorder() as masks:
        eng(input_ids=ids, labels=ids)
    return {"shapes": [tuple(m.shape) for m in masks], "ranks_same": [_same_on_both_ranks(m) for m in masks],
            "layers_same": torch.equal(masks[0], masks[1]),
            "default_stream_same_after": _same_on_both_ranks(torch.get_rng_state())}


class UserBlock(nn.Module):
    """A Megatron-style MLP written with dstrain's layers: dropout on the hidden features (partitioned),
    then on the output (replicated)."""

    def __init__(self):
        from engine.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        super().__init__()
        self.fc = ColumnParallelLinear(16, 64)
        self.out = RowParallelLinear(64, 16, input_is_parallel=True)

    def forward(self, x):
        return F.dropout(self.out(F.dropout(F.gelu(self.fc(x)), 0.5, self.training)), 0.5, self.training)


class UnpairedRow(nn.Module):
    """A dropout and a row-parallel layer whose column-parallel partner is in another module (BERT's
    `Output` beside its `Intermediate`): the smallest module running both owns the pair; across a
    ModuleList's entries the module running the list does."""

    def __init__(self):
        from engine.tensor_parallel import RowParallelLinear
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.out = RowParallelLinear(64, 16, input_is_parallel=True)

    def forward(self, x):
        return self.out(self.drop(x))


class LayerList(nn.Module):
    """The same pair as entries of a ModuleList, run one after the other by this module's forward."""

    def __init__(self):
        from engine.tensor_parallel import ColumnParallelLinear
        super().__init__()
        self.layers = nn.ModuleList([ColumnParallelLinear(16, 64), UnpairedRow()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _user_block_of_dstrain_layers() -> dict:
    import engine
    from engine.tensor_parallel import ColumnParallelLinear
    from engine.topology import ProcessGroups, Topology, set_current
    set_current(ProcessGroups(Topology.for_world(2, model=2)))
    torch.manual_seed(0)
    # the vocabulary-parallel head's column layer beside an embedding dropout is not warned about
    head = nn.Sequential(nn.Dropout(0.5), ColumnParallelLinear(16, 64))
    model = nn.Sequential(UserBlock(), nn.Sequential(ColumnParallelLinear(16, 64), UnpairedRow()), LayerList(),
                          head)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng, *_ = engine.initialize(model=model, config=TP_CONFIG)
        # a model that is a ModuleList: no module runs its entries (as a PipelineModule's stages)
        from engine.tensor_parallel.dropout_region import mark_layer_regions
        mark_layer_regions(nn.ModuleList([ColumnParallelLinear(16, 64), UnpairedRow()]))
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(3))
    with MaskRecorder() as masks:
        eng(x)
    from engine.tensor_parallel import ParallelSelfAttention
    return {"ranks_same": [_same_on_both_ranks(m) for m in masks],
            "root_attention_marked": mark_layer_regions(ParallelSelfAttention(16, 2)),  # it forks its own stream
            "default_stream_same_after": _same_on_both_ranks(torch.get_rng_state()),
            "warnings": [str(w.message) for w in caught if "tensor parallelism" in str(w.message)]}


def _guarded(check) -> dict:
    import traceback
    try:
        return check()
    except Exception:  # noqa: BLE001 - reported by the test that reads this check
        return {"error": traceback.format_exc()}


def _checks() -> dict:
    """All cases in one spawn (each spawn costs a torch and transformers import per rank)."""
    return {"gpt2": _guarded(_gpt2_with_hf_gradient_checkpointing), "llama": _guarded(_llama_attention_dropout),
            "user": _guarded(_user_block_of_dstrain_layers)}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_checks, world_size=2, timeout=300)


def _case(results, name) -> list[dict]:
    cases = [r[name] for r in results]
    for case in cases:
        assert "error" not in case, case.get("error")
    return cases


def test_hf_gradient_checkpointing_recomputes_the_forward_masks_under_autotp(results):
    """torch.utils.checkpoint (HF's `gradient_checkpointing_enable`) restores only the default
    generators before its recompute: the masks of the split heads must follow from them, or the
    backward multiplies by other masks than the forward did and the gradient is silently wrong."""
    for rank, r in enumerate(_case(results, "gpt2")):
        assert r["shapes"] == [(2, 2, 16, 16), (2, 16, 32), (2, 16, 32)] * 2, r["shapes"]
        for flavour in ("non_reentrant", "reentrant"):
            c = r[flavour]
            assert c["loss_equal"], (rank, flavour)
            assert c["grads_equal"] == r["grads"], (rank, flavour, sorted(set(r["grads"]) - set(c["grads_equal"])))
            assert c["recomputed"] > 0 and all(c["recomputes_equal_forward"]), (rank, flavour, c)
        # split heads: another mask on each rank (and per head); replicated outputs: the same mask
        assert r["ranks_same"] == [False, True, True] * 2, (rank, r["ranks_same"])
        assert not r["heads_same"], rank


def test_llama_attention_dropout_differs_per_tensor_rank_and_per_layer(results):
    """Llama draws nothing on the default stream between its layers' attentions (no residual dropout):
    each region's entry must still move it on, or every layer would reuse the first one's mask."""
    for rank, r in enumerate(_case(results, "llama")):
        assert r["shapes"] == [(2, 2, 16, 16)] * 2, r["shapes"]  # 2 of 4 query heads on each rank, 2 layers
        assert r["ranks_same"] == [False, False], rank
        assert not r["layers_same"], rank
        assert r["default_stream_same_after"], rank


def test_a_block_of_dstrain_layers_gets_the_parallel_region_at_initialize(results):
    """A user's column → dropout → row block (no AutoTP: the model is sharded already) draws its own
    hidden-feature mask per rank and the same output mask; so does a column layer and a dropout → row
    layer held by two modules of one nn.Sequential, or by two entries of a ModuleList (before
    2026-12-07: one mask on both ranks' hidden features, and for the ModuleList a warning); a dropout
    beside a row-parallel layer whose partner no module runs with it (a model that is a ModuleList) is
    named in a warning."""
    for rank, r in enumerate(_case(results, "user")):
        # the block's hidden and output masks; the Sequential's pair (split input); the ModuleList's
        # pair (split input); the head's input (replicated)
        assert r["ranks_same"] == [False, True, False, False, True], rank
        assert r["root_attention_marked"] == [], rank
        assert r["default_stream_same_after"], rank
        assert len(r["warnings"]) == 1 and r["warnings"][0].startswith(
            "tensor parallelism: 1 (UnpairedRow) holds a dropout and a RowParallelLinear"), r["warnings"]
