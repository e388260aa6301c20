"""Parameters a sharded attention or MLP holds directly (engine/tensor_parallel/own_params.py).

A small Llama-like model whose attention scales every head of q by its own per-head-dim parameter
(inside the region: each rank's gradient is its heads' share) and adds its own hidden-sized bias after
o_proj (outside: the dense gradient on every rank, and as wide as q_proj's output, which
initialize used to refuse), and whose MLP multiplies its hidden features by its own scalar gain
(inside). AutoTP'd on 2 ranks against the dense model in one process, both on the same batches, SGD
without momentum or clipping (the update is linear in the gradient): every gradient of the first step,
per parameter (this rank's slice of a sharded one), and every parameter after STEPS steps, fp32,
atol 1e-5 (summation order only). An own parameter used on both sides of a region is refused naming
it; one as wide as a column layer's output used inside fails in torch with a note naming it. A pair
built from dstrain's layers in two modules of one nn.Sequential (BERT's Intermediate / Output): a gain
beside the column layer gets the dense gradient. HF DiffLlama (its own lambda_q1.. inside the attention
region, and heads paired h with h + H/2: autotp.py's note on paired heads) the same way, also with
head_dim equal to the head count (its lambda_q1.. are then as long as the heads are many, and AutoTP
refused them at sharding as if they were one per head: autotp.py's note on head-sized parameters).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.harness import run_distributed

ATOL, STEPS, LR = 1e-5, 4, 0.5
D, HEADS, VOCAB = 32, 4, 64


class _Attention(nn.Module):
    def __init__(self, use_gate_twice: bool = False):
        super().__init__()
        self.num_heads, self.head_dim = HEADS, D // HEADS
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.head_scale = nn.Parameter(1 + 0.3 * torch.randn(self.head_dim))  # every head of q, inside
        self.out_bias = nn.Parameter(0.1 * torch.randn(D))  # after o_proj: outside, as wide as q_proj's output
        self.gate = nn.Parameter(torch.tensor(1.5)) if use_gate_twice else None

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q = q * self.head_scale
        if self.gate is not None:  # inside and outside: refused
            q = q * self.gate
        y = self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
        y = y + self.out_bias
        return y * self.gate if self.gate is not None else y


class _Mlp(nn.Module):
    def __init__(self, whole_width_bias: bool = False):
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.gain = nn.Parameter(torch.tensor(0.7))  # on the hidden features: inside
        self.hidden_bias = nn.Parameter(0.1 * torch.randn(2 * D)) if whole_width_bias else None

    def forward(self, x):
        h = self.up_proj(x)
        if self.hidden_bias is not None:  # up_proj's whole output width, on one rank's half: torch raises
            h = h + self.hidden_bias
        return self.down_proj(F.gelu(h) * self.gain)


class _Net(nn.Module):
    def __init__(self, **kinds):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.attn = nn.ModuleList(_Attention(kinds.get("use_gate_twice", False)) for _ in range(2))
        self.mlp = nn.ModuleList(_Mlp(kinds.get("whole_width_bias", False)) for _ in range(2))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids):
        x = self.tok(ids)
        for attn, mlp in zip(self.attn, self.mlp):
            x = x + attn(x)
            x = x + mlp(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _dense_slice(p: nn.Parameter, full: torch.Tensor, comm) -> torch.Tensor:
    from engine.tensor_parallel import is_partitioned
    from engine.tensor_parallel.layers import shard
    return shard(full, p.tensor_parallel_dim, comm.rank, comm.world_size, p.tensor_parallel_parts) \
        if is_partitioned(p) else full


def _tiny_diffllama(hidden: int = D):
    """HF DiffLlama: its own lambda_q1.. (head_dim) inside the region, and heads paired h with h + H/2."""
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM
    model = DiffLlamaForCausalLM(DiffLlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                                 num_hidden_layers=2, num_attention_heads=HEADS,
                                                 num_key_value_heads=HEADS, max_position_embeddings=16))
    return model, lambda m, ids: m(input_ids=ids, labels=ids).loss


def _equals_dense(kind: str) -> dict:
    from engine.comm import Communicator
    from engine.tensor_parallel.autotp import shard_model
    comm = Communicator(None)
    torch.manual_seed(0)
    if kind.startswith("diffllama"):  # "diffllama_square": head_dim = 16 / HEADS = HEADS
        model, loss_of = _tiny_diffllama(HEADS * HEADS if kind == "diffllama_square" else D)
    else:
        model, loss_of = _Net(), lambda m, ids: m(ids)
    reference = copy.deepcopy(model)
    shard_model(model, comm)
    dense = dict(reference.named_parameters())
    g = torch.Generator().manual_seed(1)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (model, reference)]
    grad_err, loss_err = {}, 0.0
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (4, 12), generator=g)
        losses = [loss_of(m, ids) for m in (model, reference)]
        for loss in losses:
            loss.backward()
        loss_err = max(loss_err, abs(losses[0].item() - losses[1].item()))
        if step == 0:
            grad_err = {n: (p.grad - _dense_slice(p, dense[n].grad, comm)).abs().max().item()
                        for n, p in model.named_parameters()}
        for opt in opts:
            opt.step()
            opt.zero_grad()
    param_err = {n: (p.detach() - _dense_slice(p, dense[n].detach(), comm)).abs().max().item()
                 for n, p in model.named_parameters()}
    return {"grad": grad_err, "param": param_err, "loss": loss_err}


class _Intermediate(nn.Module):
    """BERT's layout of an MLP built from dstrain's layers: the column layer and a gain on its output in
    one module, the row layer in the next (dropout_region.py's note: their Sequential owns the pair)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.gain = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        return F.gelu(self.up(x)) * self.gain


def _pair_equals_dense(reference: nn.Module, column: str, row: str, gain: str) -> dict:
    """`reference` with its Linear layers at paths `column` and `row` sharded over 2 ranks, the regions
    marked as initialize marks them: the gain's gradient against the dense one."""
    from engine.comm import Communicator
    from engine.tensor_parallel.dropout_region import mark_layer_regions
    from engine.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    comm = Communicator(None)
    model = copy.deepcopy(reference)
    for path, parallel in ((column, ColumnParallelLinear.from_dense), (row, RowParallelLinear.from_dense)):
        parent, _, leaf = path.rpartition(".")
        model.get_submodule(parent).register_module(leaf, parallel(model.get_submodule(path), group=comm))
    marked = mark_layer_regions(model)
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(1))
    for m in (model, reference):
        m(x).pow(2).sum().backward()
    grads = [m.get_parameter(gain).grad for m in (model, reference)]
    return {"marked": marked, "gain": (grads[0] - grads[1]).abs().item()}


def _split_pair_equals_dense() -> dict:
    torch.manual_seed(0)
    return _pair_equals_dense(nn.Sequential(_Intermediate(), nn.Sequential(nn.Linear(2 * D, D))), "0.up", "1.0",
                              "0.gain")


class _Gain(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        return F.gelu(x) * self.gain


class _LayerList(nn.Module):
    """A column layer, a gain on its output and the row layer as entries of a ModuleList, run one after
    the other: the module running the list owns the pair (dropout_region.py's note)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(D, 2 * D), _Gain(), nn.Linear(2 * D, D)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _module_list_pair_equals_dense() -> dict:
    torch.manual_seed(0)
    return _pair_equals_dense(_LayerList(), "layers.0", "layers.2", "layers.1.gain")


class _SquareHeads(nn.Module):
    """Attention with head_dim equal to the head count (4 × 4) and a bias with one entry per head: its
    length cannot tell it from a per-head-dim one (autotp.py's note on head-sized parameters)."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = HEADS, HEADS
        width = HEADS * HEADS
        self.tok = nn.Embedding(VOCAB, width)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.head_bias = nn.Parameter(0.1 * torch.randn(HEADS))

    def forward(self, ids):
        x = self.tok(ids)
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q = q + self._bias().view(1, -1, 1, 1)  # one per head: 4 entries against this rank's 2 heads
        return self.o_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1)).sum()

    def _bias(self):
        return self.head_bias


class _SlicedHeads(_SquareHeads):
    """The same bias cut by the head count: on one rank's 2 heads `[:num_heads]` reads the first 2 entries
    on both ranks, which ran without error, silently wrong (autotp.py's note on head-sized parameters)."""

    def _bias(self):
        return self.head_bias[:self.num_heads]


def _refusals() -> dict:
    from engine.comm import Communicator
    from engine.tensor_parallel.autotp import shard_model
    found = {}
    for kind in ("use_gate_twice", "whole_width_bias", "per_head_square", "per_head_sliced"):
        torch.manual_seed(0)
        heads = {"per_head_square": _SquareHeads, "per_head_sliced": _SlicedHeads}
        model = heads[kind]() if kind in heads else _Net(**{kind: True})
        shard_model(model, Communicator(None))
        try:
            model(torch.zeros(2, 6, dtype=torch.long)).backward()
        except Exception as err:  # noqa: BLE001 - the test reads its type, text and notes
            found[kind] = (type(err).__name__, str(err), getattr(err, "__notes__", []))
    return found


def _guarded(check, *args):
    """A check's result, or the error it raised as text (one refused case fails its own test only)."""
    try:
        return check(*args)
    except ValueError as err:
        return f"{type(err).__name__}: {err}"


def _two_ranks() -> dict:
    return {"dense": _equals_dense("net"), "diffllama": _equals_dense("diffllama"),
            "diffllama_square": _guarded(_equals_dense, "diffllama_square"), "split": _split_pair_equals_dense(),
            "module_list": _module_list_pair_equals_dense(), "refusals": _refusals()}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_two_ranks, world_size=2, timeout=120)


OWN = {"dense": {"attn.0.head_scale", "attn.0.out_bias", "mlp.0.gain"},
       "diffllama": {"model.layers.0.self_attn.lambda_q1", "model.layers.1.self_attn.lambda_k2"}}
OWN["diffllama_square"] = OWN["diffllama"]


@pytest.mark.parametrize("kind", sorted(OWN))
def test_own_parameters_inside_and_outside_a_region_train_as_the_dense_model(results, kind):
    for rank, r in enumerate(r[kind] for r in results):
        assert isinstance(r, dict), r  # a refusal's text (_guarded)
        assert set(r["grad"]) >= OWN[kind], r["grad"].keys()
        bad = {n: e for n, e in r["grad"].items() if e > ATOL}
        assert not bad, f"rank {rank}: first-step gradients off the dense model's: {bad}"
        bad = {n: e for n, e in r["param"].items() if e > ATOL}
        assert not bad, f"rank {rank}: parameters after {STEPS} steps off the dense model's: {bad}"
        assert r["loss"] < ATOL, (rank, r["loss"])


def test_a_parameter_beside_the_column_layer_of_a_pair_split_over_two_modules_is_summed(results):
    for r in results:
        assert r["split"]["marked"] == [""] and r["split"]["gain"] < ATOL, r["split"]


def test_a_parameter_between_a_pair_split_over_a_module_lists_entries_is_summed(results):
    for r in results:  # before 2026-12-07: not paired, each rank's gradient its half's share (1.5 off the dense 3.3)
        assert r["module_list"]["marked"] == [""] and r["module_list"]["gain"] < ATOL, r["module_list"]


def test_an_own_parameter_used_on_both_sides_of_a_region_is_refused_by_name(results):
    for r in results:
        kind, text, _ = r["refusals"]["use_gate_twice"]
        assert kind == "ValueError" and "_Attention.gate ()" in text and "inside" in text and "outside" in text, text


def test_a_per_head_parameter_as_long_as_head_dim_fails_with_a_note_naming_it(results):
    for r in results:  # not refused at sharding: its length is also head_dim's (a false refusal else)
        kind, text, notes = r["refusals"]["per_head_square"]
        assert kind == "RuntimeError", (kind, text)
        assert len(notes) == 1 and "_SquareHeads holds head_bias, as long as head_dim and as a head count" in notes[0] \
            and "autotp_size at 1" in notes[0], notes


def test_a_per_head_parameter_as_long_as_head_dim_read_in_part_is_refused_by_name(results):
    for r in results:  # before 2026-12-07 it trained on without error, each rank adding heads 0-1's entries
        kind, text, _ = r["refusals"]["per_head_sliced"]
        assert kind == "ValueError", (kind, text)
        assert text.startswith("tensor parallelism: _SlicedHeads.head_bias (4,) is as long as head_dim and as a head "
                               "count, and its forward reads part of it (SliceBackward0)"), text


def test_a_whole_width_own_parameter_inside_a_region_fails_with_a_note_naming_it(results):
    for r in results:
        kind, text, notes = r["refusals"]["whole_width_bias"]
        assert kind == "RuntimeError", (kind, text)
        assert len(notes) == 1 and "_Mlp holds hidden_bias" in notes[0] and "autotp_size at 1" in notes[0], notes
