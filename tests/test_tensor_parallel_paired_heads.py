"""AutoTP of HF DiffLlama, whose attention pairs head h with head h + H/2 (engine/tensor_parallel/autotp.py,
note: paired heads): each rank holds whole pairs, so every head count must divide by 2 x autotp_size. A
count that divides by the size only (6 query heads, or 2 key/value heads, over 2 ranks) left a rank 3
heads or 1 key/value head to chunk in two, and failed in the first forward with torch's bare
"not enough values to unpack" or a size mismatch; it is refused at sharding, naming the counts. Counts that
divide train as the dense model (tests/test_tensor_parallel_own_params.py)."""
from __future__ import annotations

import pytest

from tests.harness import run_distributed

CASES = {"query_heads": (6, 6), "kv_heads": (4, 2), "one_pair_each": (4, 4)}


def _shard(heads: int, kv: int) -> str:
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM
    import torch
    from engine.comm import Communicator
    from engine.tensor_parallel.autotp import shard_model
    model = DiffLlamaForCausalLM(DiffLlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=heads,
                                                 num_key_value_heads=kv, max_position_embeddings=16))
    try:
        shard_model(model, Communicator(None))
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
        return "no error"
    except ValueError as err:
        return str(err)


def _all() -> dict:
    return {name: _shard(*counts) for name, counts in CASES.items()}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all, 2, timeout=120)


@pytest.mark.parametrize("name", ["query_heads", "kv_heads"])
def test_head_counts_that_split_a_pair_are_refused_naming_them(results, name):
    heads, kv = CASES[name]
    for r in results:
        assert r[name].startswith("tensor_parallel.autotp_size: 2 does not divide the head counts of "
                                  "model.layers.0.self_attn (config.num_attention_heads = "
                                  f"{heads}, config.num_key_value_heads = {kv}): each rank must hold whole pairs"), r[name]


def test_whole_pairs_shard(results):
    for r in results:
        assert r["one_pair_each"] == "no error", r["one_pair_each"]
