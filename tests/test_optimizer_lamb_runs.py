"""Lamb's per-tensor sums over flats by rows (ops/tensor_segments.py) and its whole-tensor step at ZeRO
stage 0 (ops/lamb.py), in one process.

- A flat's per-tensor partial sums of squares are the same bits whatever windows the flat is read in
  (64-element NVMe sub-groups, 192, 1024, the in-memory 65,536-element blocks, the whole flat), and
  equal float64 sums per tensor to fp32 rounding; scaling each fragment by its tensor's value equals
  the per-element gather it replaces, bit for bit. The fragments' boundaries fall inside rows, one
  fragment is a single element, and the flat ends in a partial row.
- At stage 0 a group of tensors (one larger than a block, stepped in blocks; the rest batched with
  foreach) steps as the paper's per-tensor Lamb, and the batched tensors equal `lamb_update` tensor by
  tensor bit for bit.
"""
from __future__ import annotations

import torch
from torch import nn

import ops
from ops.lamb import BLOCK, advance_step, lamb_update
from ops.tensor_segments import ROW, FlatRuns
from tests.test_optimizer_set import OPTIMIZERS, PaperLamb

SIZES = [5, 130, 64, 1, 700, 63, BLOCK + 3 * ROW + 9, 17, 300]  # sum % 64 != 0: a partial last row
WINDOWS = [ROW, 3 * ROW, 16 * ROW, BLOCK, None]  # None: the whole flat in one window


def _runs(sizes: list[int]) -> list[tuple[int, int, int]]:
    return [(sum(sizes[:i]), n, i) for i, n in enumerate(sizes)]


def _windows(n: int, width: int | None) -> list[tuple[int, int]]:
    width = width or n
    return [(s, min(s + width, n)) for s in range(0, n, width)]


def test_row_sums_are_the_same_bits_in_any_windows_and_scale_as_a_gather():
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(sum(SIZES), generator=g, device="cpu")
    runs = FlatRuns(_runs(SIZES), flat.device)
    ids = torch.repeat_interleave(torch.arange(len(SIZES), device="cpu"), torch.tensor(SIZES, device="cpu"))
    per_tensor = torch.rand(len(SIZES), generator=g, device="cpu") + 0.5
    sums, scaled = [], []
    for width in WINDOWS:
        partial = torch.zeros(len(SIZES), dtype=torch.float32, device="cpu")
        out = []
        for s, e in _windows(flat.numel(), width):
            plan = runs.plan(s, e)
            plan.add_squares(partial, flat[s:e])
            out.append(plan.scale(flat[s:e].clone(), per_tensor))
        sums.append(partial)
        scaled.append(torch.cat(out))
    want = torch.stack([t.double().square().sum() for t in torch.split(flat, SIZES)])
    assert torch.allclose(sums[0].double(), want, rtol=1e-5, atol=0), (sums[0], want)
    for width, got in zip(WINDOWS[1:], sums[1:]):
        assert torch.equal(got, sums[0]), f"windows of {width}: {(got - sums[0]).abs().max():.2e}"
    for width, got in zip(WINDOWS, scaled):
        assert torch.equal(got, flat * per_tensor[ids]), f"windows of {width}: scale differs from the gather"


def test_stage0_lamb_steps_blocked_and_batched_tensors_as_the_paper():
    cfg = OPTIMIZERS["Lamb"]
    shapes = [(257, 256), (9, 13), (7,), (5, 7)]  # 65,792 elements > BLOCK: blocked; the rest batched
    assert shapes[0][0] * shapes[0][1] > BLOCK
    g = torch.Generator().manual_seed(1)
    start = [torch.randn(*s, generator=g, device="cpu") * 0.1 for s in shapes]
    grads = [[torch.randn(*s, generator=g, device="cpu") * 0.01 for s in shapes] for _ in range(3)]
    ours, paper, loop = ([nn.Parameter(t.clone()) for t in start] for _ in range(3))
    opt = ops.Lamb(ours, lr=cfg["lr"], weight_decay=cfg["weight_decay"], max_coeff=cfg["max_coeff"],
                   min_coeff=cfg["min_coeff"])
    ref = PaperLamb(paper, cfg["lr"], cfg["weight_decay"], cfg["max_coeff"], cfg["min_coeff"])
    states = [{} for _ in loop]
    for step_grads in grads:
        for params in (ours, paper):
            for p, grad in zip(params, step_grads):
                p.grad = grad.clone()
        opt.step()
        ref.step()
        with torch.no_grad():  # the whole-tensor step, one tensor at a time
            for p, grad, state in zip(loop, step_grads, states):
                lamb_update(p, grad, state, opt.param_groups[0], advance_step(state))
    for got, want, before in zip(ours, paper, start):
        assert (got - want).abs().max() < 1e-6 and (want - before).abs().max() > 1e-3, (got - want).abs().max()
    for got, same in zip(ours[1:], loop[1:]):
        assert torch.equal(got, same), f"batched {tuple(got.shape)}: {(got - same).abs().max():.2e}"
