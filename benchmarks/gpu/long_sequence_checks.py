"""The GPU script's long-sequence checks (issue 19: block-sparse attention and activation checkpointing
"in fp32 and bf16, CPU and CUDA"); benchmarks/gpu/run.py runs them on one rank, `--cpu` too. Neither
feature has a collective of its own (the layout's broadcast of random blocks runs on the world-1 group,
over NCCL on a GPU), so a second rank would only repeat them.

[Note: sparse attention] `SparseSelfAttention` on the device, a Fixed layout (unidirectional, global
patterns differing per head) with a key-padding mask (additive, DeepSpeed's default mode) and a causal
mask (multiplicative), and a BigBird layout (random, sliding-window and global blocks) without masks:
output and the gradients of q, k and v against `ops.sparse_attention.reference.masked_dense_attention`
in fp64 on the same device, from the same inputs (in bf16: the bf16 inputs, so their own rounding is
not counted). Sample 0's first PAD keys are padding, so with the causal mask its first PAD query rows
have nothing to attend to: block_sparse's contract is zeros and no gradient there, which rests on the
attention kernel's handling of a row whose every score is -inf (tested on CPU's kernels only before).
On a GPU the groups run SDPA's fused kernels as torch picks them (fp32: memory-efficient; bf16 also
flash or cuDNN where no mask is given). Tolerances (rtol = atol), output / gradients: fp32 1e-5 / 1e-5
(unit roundoff 6e-8 over sums of at most a few hundred terms; the memory-efficient kernel's fp32
matmuls are CUTLASS's 3xTF32 on compute capability 8.0 and up, fp32-accurate, and torch's TF32 matmul
flag is off by default); bf16 2e-2 / 5e-2, the tolerances of tests/test_sparse_attention.py: bf16 keeps
8 significant bits (unit roundoff 2^-8 ≈ 3.9e-3), the kernels round the attention weights and the
output once each (2e-2 is about 5 such roundings of an O(1) value), and backward rounds dP and dS
again before their matmuls.

[Note: activation checkpointing] The example GPT (the checks' tiny one) with dropout 0.1 in attention,
trained AC_STEPS steps through `engine.initialize` with an `activation_checkpointing` section, against
the same model without one: every loss and every gradient (`safe_get_full_grad`, before each step)
torch.equal. With dropout, equality needs the recompute to draw the forward's masks again, which on a
GPU is the CUDA generator's replay (torch's checkpoint saves the RNG state of its inputs' devices; the
tracked streams are engine.checkpointing's). Sections: full checkpointing of every block,
`"selective_unpack"` (nothing random is remade: the masks are held), and full with `cpu_checkpointing`
(the region is handed host copies of the block inputs). Attention runs on SDPA's math kernel: the
fused kernels' backward accumulates with atomics on a GPU, so two runs could differ with no checkpoint
at all; every kernel draws its mask from the same generator. The section must have patched the blocks
(else equality says nothing). Placement, by torch's saved-tensor hooks around each forward (nothing
of the engine's internals, which see the inputs a non-reentrant checkpoint holds): on an accelerator,
the host tensors of a block input's shape saved for backward are the block inputs cpu_checkpointing
holds, one per block and step, each pinned (their copies are asynchronous), and there are none without
it; on CPU every saved tensor is on the host, so that part is not checked there (the detail says so).
"""
from __future__ import annotations

import random
from dataclasses import replace

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import engine
from benchmarks.gpu.training import MICRO, TINY, batches, check_config
from engine.utils import safe_get_full_grad
from examples.gpt import GPT
from ops.sparse_attention import BigBirdSparsityConfig, FixedSparsityConfig, SparseSelfAttention
from ops.sparse_attention.reference import masked_dense_attention

BATCH, HEADS, SEQ, BLOCK, DIM = 2, 4, 256, 16, 32
PAD = 24  # left padding of sample 0: a block and a half, so a tile is cut through by the mask
LAYOUTS = {
    "Fixed, key padding + causal": lambda: FixedSparsityConfig(
        HEADS, block=BLOCK, num_local_blocks=4, attention="unidirectional", different_layout_per_head=True,
        num_different_global_patterns=2),
    "BigBird": lambda: BigBirdSparsityConfig(HEADS, block=BLOCK, num_random_blocks=2, num_sliding_window_blocks=3,
                                             num_global_blocks=1, different_layout_per_head=True),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = {"fp32": (1e-5, 1e-5), "bf16": (2e-2, 5e-2)}  # output, gradients (note: sparse attention)

AC_STEPS = 3
DROPOUT_GPT = replace(TINY, dropout=0.1)
SECTIONS = {"full": {"checkpoint_blocks": True},
            "selective_unpack": {"checkpoint_blocks": True, "policy": "selective_unpack"},
            "full + cpu_checkpointing": {"checkpoint_blocks": True, "cpu_checkpointing": True}}
AC_PRECISIONS = ("fp32",)  # the replay is of the generator, whatever the dtype: bf16 would add CI time, not paths


# -- sparse attention ---------------------------------------------------------------------------------
def _beyond(what: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    """max |got - want|; raises where an element is further than tol + tol·|want| (or not finite)."""
    err = (got.double() - want).abs()
    bad = ~(err <= tol + tol * want.abs())  # a NaN is bad too
    if bad.any():
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements beyond {tol:g} of masked dense "
                             f"attention, max |diff| {err.max().item():.2e}, "
                             f"{int((~torch.isfinite(got)).sum())} not finite")
    return err.max().item()


def _masks(dev: torch.device, dtype: torch.dtype):
    """(key padding, additive (batch, seq); causal keep-mask (seq, seq); the causal mask as the
    reference takes it, additive fp64), all on `dev`."""
    key_add = torch.zeros(BATCH, SEQ, dtype=dtype, device=dev)
    key_add[0, :PAD] = float("-inf")
    keep = torch.ones(SEQ, SEQ, dtype=torch.bool, device=dev).tril()
    causal_add = torch.zeros(SEQ, SEQ, dtype=torch.float64, device=dev).masked_fill(~keep, float("-inf"))
    return key_add, keep, causal_add


def check_sparse_attention(layout: str, precision: str) -> str:
    dev, dtype = engine.dist.device(), DTYPES[precision]
    random.seed(0)  # BigBird's random blocks are Python's `random` draws: the same layout every run
    attn = SparseSelfAttention(LAYOUTS[layout](), max_seq_length=SEQ).to(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, up = (torch.randn(BATCH, HEADS, SEQ, DIM, generator=g, device=dev).to(dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    masked = "causal" in layout
    key_add, keep, causal_add = _masks(dev, dtype) if masked else (None, None, None)
    out = attn(q, k, v, key_padding_mask=key_add, attn_mask=keep)
    grads = torch.autograd.grad(out, (q, k, v), up)
    away = sorted({str(t.device) for t in (out, *grads)} - {str(dev)})
    if away or out.dtype != dtype:
        raise AssertionError(f"output or gradients on {away}, output {out.dtype}: expected {dev}, {dtype}")
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]  # fp64 leaves: unrounded gradients
    squares = () if causal_add is None else (causal_add,)
    layout_blocks = attn.get_layout(SEQ)
    want = masked_dense_attention(*exact, layout_blocks, BLOCK, key_add, squares)
    want_grads = torch.autograd.grad(want, exact, up.double())
    tol_out, tol_grad = TOLERANCE[precision]
    worst_out = _beyond(f"{precision} output", out, want, tol_out)
    worst_grad = max(_beyond(f"{precision} d{n}", got, ref, tol_grad) for n, got, ref in zip("qkv", grads, want_grads))
    detail = (f"{int(layout_blocks.sum())} of {layout_blocks.numel()} blocks; largest difference: output "
              f"{worst_out:.1e}, gradients {worst_grad:.1e} (tolerance {tol_out:g} / {tol_grad:g}); on {dev}")
    if masked:  # the contract, exactly: zeros, and no gradient for the rows' queries
        if out[0, :, :PAD].count_nonzero() or grads[0][0, :, :PAD].count_nonzero():
            raise AssertionError(f"rows with nothing to attend to (sample 0, the first {PAD}): not zeros")
        detail += f"; {PAD} rows with nothing to attend to: zeros, no gradient"
    return detail


# -- activation checkpointing ---------------------------------------------------------------------------
def _train(section: dict | None, precision: str) -> tuple[list, list, list, int]:
    """Losses, per-step gradients (on the device), whether each host tensor of a block input's shape
    saved in the forwards is pinned (on an accelerator; note: activation checkpointing), and how many
    modules the section patched."""
    cfg = check_config(0, precision, {"activation_checkpointing": section} if section else None)
    dev = engine.dist.device()
    torch.manual_seed(0)
    eng, _, _, _ = engine.initialize(model=GPT(DROPOUT_GPT), config=cfg)
    patched = sum("forward" in vars(m) for m in eng.module.modules())
    host: list[bool] = []
    block_input = (MICRO, DROPOUT_GPT.seq_len, DROPOUT_GPT.d_model)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if dev.type != "cpu" and t.device.type == "cpu" and tuple(t.shape) == block_input:
            host.append(t.is_pinned())
        return t

    losses, grads = [], []
    try:
        with sdpa_kernel(SDPBackend.MATH):  # note: activation checkpointing
            for x, y in batches(AC_STEPS, DROPOUT_GPT, MICRO):
                x, y = x.to(dev), y.to(dev)
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss = eng(x, y)
                eng.backward(loss)
                grads.append({n: safe_get_full_grad(p) for n, p in eng.module.named_parameters()})
                eng.step()
                losses.append(loss.detach())
    finally:
        engine.checkpointing.unconfigure()  # process-wide settings: the next engine starts from none
        eng.destroy()
    return losses, grads, host, patched


def check_checkpointing(policy: str, precision: str) -> str:
    if precision not in check_checkpointing.reference:
        check_checkpointing.reference[precision] = _train(None, precision)[:2]
    want_losses, want_grads = check_checkpointing.reference[precision]
    losses, grads, host, patched = _train(SECTIONS[policy], precision)
    if patched < DROPOUT_GPT.n_layer:
        raise AssertionError(f"the section patched {patched} modules, expected all {DROPOUT_GPT.n_layer} blocks")
    for step, (got, want) in enumerate(zip(grads, want_grads)):
        missing = [n for n in want if got[n] is None or want[n] is None]
        differ = [n for n in want if n not in missing and not torch.equal(got[n], want[n])]
        if missing or differ or not torch.equal(losses[step], want_losses[step]):
            worst = max(((got[n] - want[n]).abs().max().item() for n in differ), default=0.0)
            raise AssertionError(f"step {step + 1}: loss {losses[step].item():.6f} vs {want_losses[step].item():.6f} "
                                 f"without checkpointing; {len(differ)} gradient(s) differ (first "
                                 f"{differ[:1]}, max |diff| {worst:.2e}); no gradient: {missing[:3]}")
    detail = (f"{AC_STEPS} steps, dropout {DROPOUT_GPT.dropout}: losses and gradients equal to the model without "
              f"checkpointing (loss {losses[0].item():.4f} -> {losses[-1].item():.4f}); ")
    return detail + _host_placement(policy, host)


check_checkpointing.reference = {}  # precision -> losses and gradients without checkpointing, this run


def _host_placement(policy: str, host: list[bool]) -> str:
    """Note: activation checkpointing. `host`: is_pinned of each host tensor of a block input's shape
    that the forwards saved."""
    if engine.dist.device().type == "cpu":
        return "host copies: on CPU every saved tensor is on the host (pinned ones checked on an accelerator only)"
    want = DROPOUT_GPT.n_layer * AC_STEPS if "cpu_checkpointing" in policy else 0
    if len(host) != want or not all(host):
        raise AssertionError(f"{len(host)} tensors saved on the host ({sum(host)} pinned), expected {want}, all pinned")
    return f"{want} block inputs saved on the host, all pinned" if want else "nothing saved on the host"


def long_sequence_cases() -> list[tuple]:
    """(check name, function, args) for run.py's run_checks; forgets the references of an earlier run."""
    check_checkpointing.reference = {}
    cases = [(f"sparse attention {layout} {p}", check_sparse_attention, (layout, p))
             for layout in LAYOUTS for p in DTYPES]
    cases += [(f"activation checkpointing {policy} {p}", check_checkpointing, (policy, p))
              for policy in SECTIONS for p in AC_PRECISIONS]
    return cases
