"""Block-sparse attention (`ops.sparse_attention`): DeepSpeed's layouts and errors, and the same numbers
as dense attention restricted to the layout, forward and backward.

Oracles: each layout against a per-element statement of DeepSpeed's pattern (which (query block, key
block) pairs it connects, written independently of the implementation's loops), with the random
blocks replayed from the same seeded `random` draws; attention against a dense softmax over the
layout expanded to tokens (and, for the dense layout, against torch's SDPA). fp32 tolerance 1e-5
(only the order of the softmax sums differs); bf16 against the fp32 result, 2e-2 (bf16's 8 bits).
"""
from __future__ import annotations

import contextlib
import itertools
import random

import pytest
import torch

import schemas
from ops.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseAttentionUtils,
    SparseSelfAttention,
    VariableSparsityConfig,
    sparsity_config_from,
)
from ops.sparse_attention.reference import masked_dense_attention


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: a second intra-op thread only waits for a core of a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _grid(n: int, pred) -> torch.Tensor:
    return torch.tensor([[int(bool(pred(r, c))) for c in range(n)] for r in range(n)])


# -- per-element statements of DeepSpeed's patterns ---------------------------------------------------------
def fixed_oracle(n, h, local=4, glob=1, uni=False, horizontal=False, patterns=1):
    offset = local - (1 + h % patterns) * glob
    # one global range per local window; a short last window keeps its range inside the sequence
    # (so it may reach back into the window before)
    ranges = [(ws + offset if ws + local <= n else min(ws + offset, n - glob)) for ws in range(0, n, local)]

    def connected(r, c):
        if r // local == c // local and (c <= r or not uni):
            return True
        if any(s <= c < s + glob and (not uni or r >= s) for s in ranges):
            return True
        return horizontal and any(s <= r < s + glob for s in ranges)

    return _grid(n, connected)


def sliding_oracle(n, width, causal=False):
    return _grid(n, lambda r, c: r - width // 2 <= c <= (r if causal else r + width // 2))


def global_ranges_oracle(n, starts, ends, rows, uni_columns):
    ends = ends if ends is not None else [s + 1 for s in starts]
    ranges = [(s, min(e, n)) for s, e in zip(starts, ends) if s < n]

    def connected(r, c):
        col = any(s <= c < e and (not uni_columns or r >= s) for s, e in ranges)
        return col or (rows and any(s <= r < e for s, e in ranges))

    return _grid(n, connected)


def variable_local_oracle(n, windows, uni):
    bounds, start = [], 0
    while start < n:
        size = windows[len(bounds)] if len(bounds) < len(windows) else windows[-1]
        bounds.append((start, start + size))
        start += size
    window_of = {b: i for i, (s, e) in enumerate(bounds) for b in range(s, min(e, n))}
    return _grid(n, lambda r, c: window_of[r] == window_of[c] and (c <= r or not uni))


def random_oracle(n, k, uni, seed):
    rng = random.Random(seed)
    out = torch.zeros(n, n, dtype=torch.int64)
    for r in range(n):
        out[r, rng.sample(range(n) if not uni else range(r + 1), k)] = 1
    return out


FIXED = [dict(local=L, glob=G, uni=u, horizontal=hz, patterns=p, heads=3, per_head=p > 1)
         for L, G in [(4, 1), (4, 2), (3, 1), (2, 2)] for u in (False, True) for hz in (False, True) for p in (1, 2)
         if not (u and hz) and p <= L // G]


@pytest.mark.parametrize("n", [5, 8, 11])
@pytest.mark.parametrize("case", FIXED, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_fixed_layout_is_deepspeeds(case, n):
    cfg = FixedSparsityConfig(case["heads"], block=2, different_layout_per_head=case["per_head"],
                              num_local_blocks=case["local"], num_global_blocks=case["glob"],
                              attention="unidirectional" if case["uni"] else "bidirectional",
                              horizontal_global_attention=case["horizontal"],
                              num_different_global_patterns=case["patterns"])
    layout = cfg.make_layout(2 * n)
    assert layout.shape == (3, n, n) and layout.dtype == torch.int64
    for h in range(3):
        want = fixed_oracle(n, h if case["per_head"] else 0, case["local"], case["glob"], case["uni"],
                            case["horizontal"], case["patterns"])
        assert torch.equal(layout[h], want), f"head {h}\n{layout[h]}\n{want}"


@pytest.mark.parametrize("n, width, starts, ends, uni", [
    (7, 3, [0], None, False), (9, 5, [0, 4], None, True), (8, 1, [1, 5], [3, 7], False), (6, 3, [2, 9], None, False),
    (10, 3, [0, 8], [2, 12], True)])
def test_bslongformer_layout_is_deepspeeds(n, width, starts, ends, uni):
    layout = BSLongformerSparsityConfig(2, block=4, num_sliding_window_blocks=width, global_block_indices=starts,
                                        global_block_end_indices=ends,
                                        attention="unidirectional" if uni else "bidirectional").make_layout(4 * n)
    want = sliding_oracle(n, width) | global_ranges_oracle(n, starts, ends, rows=True, uni_columns=False)
    if uni:
        want = torch.tril(want)
    assert torch.equal(layout[0], want) and torch.equal(layout[1], want)


@pytest.mark.parametrize("uni", [False, True])
@pytest.mark.parametrize("n, width", [(6, 3), (9, 5), (4, 1)])
def test_local_sliding_window_layout_is_deepspeeds(n, width, uni):
    layout = LocalSlidingWindowSparsityConfig(2, block=2, num_sliding_window_blocks=width,
                                              attention="unidirectional" if uni else "bidirectional").make_layout(2 * n)
    assert torch.equal(layout[1], sliding_oracle(n, width, causal=uni))


@pytest.mark.parametrize("n, windows, starts, ends, random_blocks, uni, horizontal", [
    (9, [4], [0], None, 0, False, False), (10, [2, 3], [1, 6], None, 2, False, True),
    (11, [3, 1, 2], [0, 4], [2, 6], 1, True, False), (5, [8], [3], None, 0, True, False),
    (7, [2], [0, 20], None, 3, False, False)])
def test_variable_layout_is_deepspeeds(n, windows, starts, ends, random_blocks, uni, horizontal):
    random.seed(7)
    cfg = VariableSparsityConfig(2, block=3, num_random_blocks=random_blocks, local_window_blocks=windows,
                                 global_block_indices=starts, global_block_end_indices=ends,
                                 attention="unidirectional" if uni else "bidirectional",
                                 horizontal_global_attention=horizontal)
    layout = cfg.make_layout(3 * n)
    want = (random_oracle(n, random_blocks, False, 7) | variable_local_oracle(n, windows, uni)
            | global_ranges_oracle(n, starts, ends, rows=horizontal, uni_columns=uni))
    assert torch.equal(layout[0], want), f"\n{layout[0]}\n{want}"
    assert torch.equal(layout[1], want)


@pytest.mark.parametrize("n, k, width, glob, uni", [(8, 1, 3, 1, False), (10, 1, 5, 2, True), (6, 0, 1, 1, False),
                                                    (9, 3, 3, 2, False)])
def test_bigbird_layout_is_deepspeeds(n, k, width, glob, uni):
    random.seed(3)
    layout = BigBirdSparsityConfig(2, block=2, num_random_blocks=k, num_sliding_window_blocks=width,
                                   num_global_blocks=glob,
                                   attention="unidirectional" if uni else "bidirectional").make_layout(2 * n)
    want = random_oracle(n, k, uni, 3) | sliding_oracle(n, width) | _grid(n, lambda r, c: r < glob or c < glob)
    if uni:
        want = torch.tril(want)
    assert torch.equal(layout[0], want), f"\n{layout[0]}\n{want}"


def test_dense_layout_is_all_ones():
    assert torch.equal(DenseSparsityConfig(3, block=4).make_layout(20), torch.ones(3, 5, 5, dtype=torch.int64))


# -- DeepSpeed's errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, words", [
    (lambda: FixedSparsityConfig(2, num_local_blocks=4, num_global_blocks=3), "must be dividable by number of global"),
    (lambda: FixedSparsityConfig(2, attention="sideways"), 'only "uni/bi-directional"'),
    (lambda: FixedSparsityConfig(2, attention="unidirectional", horizontal_global_attention=True),
     'only "bi-directional" attentions can support horizontal'),
    (lambda: FixedSparsityConfig(2, num_different_global_patterns=2), "Set different_layout_per_head to True"),
    (lambda: FixedSparsityConfig(2, different_layout_per_head=True, num_local_blocks=4, num_global_blocks=2,
                                 num_different_global_patterns=3), "cannot be larger than number of local window"),
    (lambda: VariableSparsityConfig(2, global_block_indices=[0, 2], global_block_end_indices=[1]),
     "must be same as global block end indices length"),
    (lambda: BSLongformerSparsityConfig(2, global_block_indices=[3], global_block_end_indices=[3]),
     "must be smaller than global block end index"),
    (lambda: VariableSparsityConfig(2, attention="x"), 'only "uni/bi-directional"'),
    (lambda: BigBirdSparsityConfig(2, attention="x"), 'only "uni/bi-directional"'),
    (lambda: DenseSparsityConfig(2, block=16).make_layout(40), "needs to be dividable by Block size 16"),
    (lambda: BigBirdSparsityConfig(2, block=4, num_random_blocks=5).make_layout(16), "Number of random blocks, 5"),
    (lambda: BigBirdSparsityConfig(2, block=4, num_sliding_window_blocks=5).make_layout(16),
     "Number of sliding window blocks, 5"),
    (lambda: BigBirdSparsityConfig(2, block=4, num_random_blocks=0, num_global_blocks=5).make_layout(16),
     "Number of global blocks, 5"),
])
def test_invalid_combinations_raise_deepspeeds_errors(make, words):
    with pytest.raises((ValueError, NotImplementedError)) as err:
        make()
    assert words in str(err.value)


# -- the attention ---------------------------------------------------------------------------------------------
CONFIGS = {
    "dense": lambda h: DenseSparsityConfig(h, block=4),
    "fixed": lambda h: FixedSparsityConfig(h, block=4, num_local_blocks=2, different_layout_per_head=True,
                                           num_different_global_patterns=2),
    "fixed-uni": lambda h: FixedSparsityConfig(h, block=4, num_local_blocks=3, attention="unidirectional"),
    "bigbird": lambda h: BigBirdSparsityConfig(h, block=4, num_random_blocks=1, different_layout_per_head=True),
    "bslongformer": lambda h: BSLongformerSparsityConfig(h, block=4, global_block_indices=[0, 5]),
    "variable": lambda h: VariableSparsityConfig(h, block=4, num_random_blocks=1, local_window_blocks=[1, 2],
                                                 global_block_indices=[2], horizontal_global_attention=True),
    "local": lambda h: LocalSlidingWindowSparsityConfig(h, block=4, num_sliding_window_blocks=3),
}


def _qkv(b=2, h=3, s=32, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def _grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.autograd.grad(out, inputs, torch.randn(out.shape, generator=g).to(out.dtype))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_layout_equals_dense_attention_masked_by_it(name):
    random.seed(0)
    attn = SparseSelfAttention(CONFIGS[name](3), max_seq_length=64)
    q, k, v = _qkv()
    layout = attn.get_layout(32)
    out = attn(q, k, v)
    want = masked_dense_attention(q, k, v, layout, 4)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    for got, ref in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(got.double(), ref.double(), rtol=1e-5, atol=1e-5)


def test_dense_layout_equals_torch_sdpa_forward_and_backward():
    attn = SparseSelfAttention(DenseSparsityConfig(3, block=8), max_seq_length=64)
    q, k, v = _qkv(s=48)
    out = attn(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for got, ref in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kp_mode, attn_mode", [("add", "mul"), ("mul", "add"), ("mul", "mul")])
def test_key_padding_causal_masks_and_rpe(kp_mode, attn_mode):
    attn = SparseSelfAttention(FixedSparsityConfig(3, block=4, num_local_blocks=2), key_padding_mask_mode=kp_mode,
                               attn_mask_mode=attn_mode, max_seq_length=32)
    q, k, v = _qkv()
    keep = torch.ones(2, 32)
    keep[0, 27:] = 0  # the last 5 keys of sample 0 are padding
    key_add = torch.zeros(2, 32).masked_fill(keep == 0, float("-inf"))
    causal = torch.tril(torch.ones(32, 32))
    causal_add = torch.zeros(32, 32).masked_fill(causal == 0, float("-inf"))
    rpe = torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(4))
    out = attn(q, k, v, rpe=rpe, key_padding_mask=keep if kp_mode == "mul" else key_add,
               attn_mask=causal if attn_mode == "mul" else causal_add)
    want = masked_dense_attention(q, k, v, attn.get_layout(32), 4, key_add, (rpe, causal_add))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    for got, ref in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(got.double(), ref.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["default", "math"])
def test_a_row_with_nothing_to_attend_to_gives_zeros(backend):
    """Query rows 0-5 may attend to no key: zeros out, zero gradients, and everything (those rows
    included: the reference's contract is the same) as the dense reference, forward and backward;
    with torch's default CPU kernel (flash) and its math kernel, on whose safe softmax for such rows
    block_sparse relies."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    attn = SparseSelfAttention(FixedSparsityConfig(3, block=4, num_local_blocks=2), max_seq_length=32)
    q, k, v = _qkv()
    allowed = torch.tril(torch.ones(32, 32))
    allowed[:6] = 0
    rpe = torch.randn(32, 32, generator=torch.Generator().manual_seed(4))  # an additive mask as well
    kernel = sdpa_kernel(SDPBackend.MATH) if backend == "math" else contextlib.nullcontext()
    with kernel:
        out = attn(q, k, v, rpe=rpe, attn_mask=allowed)
        grads = _grads(out, (q, k, v))
    assert torch.equal(out[:, :, :6], torch.zeros_like(out[:, :, :6]))
    assert all(torch.isfinite(g).all() for g in grads) and torch.equal(grads[0][:, :, :6], torch.zeros(2, 3, 6, 8))
    causal_add = torch.zeros(32, 32).masked_fill(allowed == 0, float("-inf"))
    want = masked_dense_attention(q, k, v, attn.get_layout(32), 4, None, (rpe, causal_add))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, _grads(want, (q, k, v))):
        torch.testing.assert_close(got.double(), ref.double(), rtol=1e-5, atol=1e-5)


def test_bf16_matches_fp32_within_bf16_rounding():
    attn = SparseSelfAttention(BigBirdSparsityConfig(3, block=4), max_seq_length=32)
    q, k, v = _qkv()
    qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    out, out16 = attn(q, k, v), attn(qb, kb, vb)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), out, rtol=2e-2, atol=2e-2)
    for got, ref in zip(_grads(out16, (qb, kb, vb)), _grads(out, (q, k, v))):
        torch.testing.assert_close(got.float(), ref, rtol=5e-2, atol=5e-2)


def test_work_grows_with_the_non_zero_blocks_not_seq_squared():
    """What backward keeps (the gathered key/value tiles, outputs, log-sum-exps; no score tiles) is
    O(nnz x block x dim): at a fixed number of blocks per row it about doubles with the sequence,
    where dense scores alone quadruple."""
    sizes = {}
    for s in (256, 512):
        attn = SparseSelfAttention(BigBirdSparsityConfig(1, block=16, num_random_blocks=1), max_seq_length=s)
        q, k, v = _qkv(b=1, h=1, s=s)
        biggest = []

        def pack(t):
            biggest.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            attn(q, k, v)
        sizes[s] = sum(biggest)
    assert sizes[512] <= 2.3 * sizes[256] and sizes[512] < 512 * 512 / 2, sizes


def test_shape_and_length_errors_are_clear():
    attn = SparseSelfAttention(FixedSparsityConfig(3, block=4), max_seq_length=32)
    q, k, v = _qkv(s=30)
    with pytest.raises(ValueError, match="dividable by Block size 4"):
        attn(q, k, v)
    q, k, v = _qkv(s=36)
    with pytest.raises(ValueError, match="max_seq_length 32"):
        attn(q, k, v)
    q, k, v = _qkv(h=2)
    with pytest.raises(ValueError, match="2 heads"):
        attn(q, k, v)


def test_utils_pad_and_unpad_to_the_block_size():
    ids = torch.arange(10).view(2, 5)
    mask = torch.ones(2, 5, dtype=torch.long)
    pad, ids2, mask2, tt, pos, emb = SparseAttentionUtils.pad_to_block_size(4, ids, mask, None, None, None, 0, None)
    assert pad == 3 and ids2.shape == (2, 8) and mask2[:, 5:].sum() == 0 and (ids2[:, 5:] == 0).all()
    out = torch.randn(2, 8, 6)
    assert torch.equal(SparseAttentionUtils.unpad_sequence_output(pad, out), out[:, :5])


# -- the sparse_attention config section -----------------------------------------------------------------------
BASE = {"train_micro_batch_size_per_gpu": 1}


@pytest.mark.parametrize("section, cls", [({"mode": "dense"}, DenseSparsityConfig), ({}, FixedSparsityConfig),
                                          ({"mode": "bigbird", "num_random_blocks": 2}, BigBirdSparsityConfig),
                                          ({"mode": "variable"}, VariableSparsityConfig),
                                          ({"mode": "bslongformer"}, BSLongformerSparsityConfig)])
def test_the_section_builds_deepspeeds_pattern(section, cls):
    cfg = schemas.load_config({**BASE, "sparse_attention": {"block": 8, **section}})
    pattern = sparsity_config_from(cfg.sparse_attention, num_heads=4)
    assert type(pattern) is cls and pattern.block == 8 and pattern.num_heads == 4
    if "num_random_blocks" in section:
        assert pattern.num_random_blocks == 2


def test_a_wrong_mode_names_the_key():
    with pytest.raises(schemas.ConfigError, match="sparse_attention.mode"):
        schemas.load_config({**BASE, "sparse_attention": {"mode": "sparse"}})


def test_combinations_of_the_grid_all_build():
    for local, glob in itertools.product((2, 4), (1, 2)):
        FixedSparsityConfig(2, num_local_blocks=local, num_global_blocks=glob).make_layout(64)


# -- the GPT example's attention, and random blocks across ranks --------------------------------------------
def test_gpt_example_with_a_dense_layout_equals_its_sdpa_attention():
    from examples.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    dense = GPT(GPTConfig(seq_len=32, n_layer=2, d_model=32, n_head=4))
    section = schemas.load_config({**BASE, "sparse_attention": {"mode": "dense", "block": 8}}).sparse_attention
    torch.manual_seed(0)
    sparse = GPT(GPTConfig(seq_len=32, n_layer=2, d_model=32, n_head=4, sparsity=sparsity_config_from(section, 4)))
    assert all(b.sparse is not None for b in sparse.blocks)
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (dense, sparse):
        loss = model(idx, idx)
        loss.backward()
        losses.append((loss.detach(), model.blocks[0].qkv.weight.grad.clone()))
    torch.testing.assert_close(losses[1][0], losses[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses[1][1], losses[0][1], rtol=1e-4, atol=1e-6)


def _layout_on_each_rank():
    random.seed(100 + torch.distributed.get_rank())  # ranks seeded differently draw different blocks
    return BigBirdSparsityConfig(2, block=4, num_random_blocks=3, different_layout_per_head=True).make_layout(64)


def test_random_blocks_are_rank_0s_on_every_rank():
    from tests.harness import run_distributed
    first, second = run_distributed(_layout_on_each_rank, 2, timeout=60)
    random.seed(100)
    alone = BigBirdSparsityConfig(2, block=4, num_random_blocks=3, different_layout_per_head=True).make_layout(64)
    assert torch.equal(first, second) and torch.equal(first, alone)
