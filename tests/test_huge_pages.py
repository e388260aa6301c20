"""Host flats and optimizer state on transparent huge pages (offload/huge_pages.py): what the optimizer
step streams is advised MADV_HUGEPAGE before its first touch (read back from /proc/self/smaps: its
range lies in mappings with the "hg" flag); nothing changes a value. Whether the kernel then finds free
2 MiB blocks is its own call, so the huge pages actually mapped are what the benchmark reports
(bench_cpu_adam.py), not what a test asserts.

The cases that need the kernel's THP skip, saying so, where it has none (not Linux, or THP "never").
"""
from __future__ import annotations

import os

import pytest
import torch

from offload import huge_pages as hp
from tests.harness import run_distributed

needs_thp = pytest.mark.skipif(not hp.available(), reason="this kernel gives no transparent huge pages")
MIB = 1 << 20


def _whole_pages(t: torch.Tensor) -> int:
    return t.numel() * t.element_size() // hp.HUGE_PAGE * hp.HUGE_PAGE


@needs_thp
def test_host_zeros_is_zero_aligned_and_advised_for_huge_pages():
    t = hp.host_zeros(9 * MIB + 123)  # 36 MiB and a tail that stays on small pages
    assert t.data_ptr() % hp.HUGE_PAGE == 0 and hp.on_huge_pages(t)
    assert t.shape == (9 * MIB + 123,) and t.dtype == torch.float32 and not t.any()
    assert hp.advised_bytes(t) == _whole_pages(t)
    plain = torch.zeros(9 * MIB + 123)
    assert hp.advised_bytes(plain) == 0 and not hp.on_huge_pages(plain)


def test_small_pinned_and_switched_off_requests_are_plain_tensors(monkeypatch):
    small = hp.host_zeros(hp.MIN_BYTES // 4 - 1)
    assert not hp.on_huge_pages(small) and not small.any()
    pinned_asked = hp.host_empty(9 * MIB, pin_memory=torch.cuda.is_available())
    assert hp.on_huge_pages(pinned_asked) == (hp.available() and not torch.cuda.is_available())
    monkeypatch.setenv("DSTRAIN_HUGE_PAGES", "0")
    off = hp.host_zeros(9 * MIB)
    assert not hp.on_huge_pages(off) and hp.advised_bytes(off) == 0 and not off.any()
    ones = torch.ones(9 * MIB)
    assert hp.adopt(ones) is ones


@needs_thp
def test_adopt_state_moves_torch_optimizer_state_and_changes_no_value():
    torch.manual_seed(0)
    p = torch.nn.Parameter(hp.host_zeros(9 * MIB).normal_())
    q = torch.nn.Parameter(p.detach().clone())
    moved, kept = torch.optim.AdamW([p], lr=1e-2, fused=True), torch.optim.AdamW([q], lr=1e-2, fused=True)
    counts = []
    for _ in range(3):
        p.grad = torch.randn(p.shape)
        q.grad = p.grad.clone()
        moved.step()
        kept.step()
        counts.append(hp.adopt_state(moved))
    assert counts == [2, 0, 0]  # exp_avg and exp_avg_sq once, after the step that made them
    for key in ("exp_avg", "exp_avg_sq"):
        assert hp.on_huge_pages(moved.state[p][key]) and not hp.on_huge_pages(kept.state[q][key])
        assert hp.advised_bytes(moved.state[p][key]) == _whole_pages(p)
        assert torch.equal(moved.state[p][key], kept.state[q][key])
    assert torch.equal(p, q)
    moved.load_state_dict(kept.state_dict())  # a new state dict (a checkpoint's): moved once more
    assert not hp.on_huge_pages(moved.state[p]["exp_avg"])
    assert hp.adopt_state(moved) == 2 and hp.adopt_state(moved) == 0
    assert all(hp.on_huge_pages(moved.state[p][k]) for k in ("exp_avg", "exp_avg_sq"))
    assert all(torch.equal(moved.state[p][k], kept.state[q][k]) for k in ("exp_avg", "exp_avg_sq"))


@needs_thp
def test_swap_buffer_pool_is_cut_from_one_advised_block(monkeypatch):
    """Unpinned pools of at least MIN_BYTES: every buffer on advised huge pages (offload/pool.py's note:
    huge pages; O_DIRECT requests of scattered 4 KiB pages ran 1.2-2.7x slower), each on the O_DIRECT
    block, none overlapping; a bf16 pool whose buffers are not a whole block long gets a stride that is.
    Smaller pools and DSTRAIN_HUGE_PAGES=0 keep one plain aligned allocation per buffer."""
    from offload.aio import ALIGNMENT
    from offload.pool import SwapBufferPool
    for dtype, size in ((torch.float32, MIB), (torch.bfloat16, 3 * MIB + 5)):
        pool = SwapBufferPool(12, size, dtype=dtype, pin_memory=False)
        spans = sorted((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in pool.buffers)
        assert all(b.numel() == size and b.dtype == dtype and not b.any() for b in pool.buffers)
        assert all(start % ALIGNMENT == 0 for start, _ in spans)
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
        assert sum(hp.advised_bytes(b) for b in pool.buffers) >= 12 * size * dtype.itemsize - 2 * hp.HUGE_PAGE
        taken = [pool.acquire() for _ in range(12)]
        assert sorted(t.data_ptr() for t in taken) == [s for s, _ in spans]
    small = SwapBufferPool(2, MIB, pin_memory=False)
    assert all(hp.advised_bytes(b) == 0 and b.data_ptr() % ALIGNMENT == 0 for b in small.buffers)
    monkeypatch.setenv("DSTRAIN_HUGE_PAGES", "0")
    off = SwapBufferPool(12, MIB, pin_memory=False)
    assert all(hp.advised_bytes(b) == 0 for b in off.buffers)


def _train(stage: int, device: str, nvme_path: str, huge: bool) -> dict:
    """3 AdamW steps of a Linear(4096, 4096), Linear(4096, 256) model (17.8M parameters: 34 MiB partitions per
    rank, above MIN_BYTES, 32 MiB, so they go on huge pages; half the 33.6M model this test trained before) with
    the optimizer offloaded; where each partition tensor lives, and the weights and norms after."""
    import engine
    from engine.zero.tier import tier_tensors
    os.environ["DSTRAIN_HUGE_PAGES"] = "1" if huge else "0"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, 256))
    offload = {"device": device, "nvme_path": nvme_path} if device == "nvme" else {"device": device}
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "offload_optimizer": offload}, "steps_per_print": 10**9}
    eng, *_ = engine.initialize(model=model, config=cfg)
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    norms = []
    for _ in range(3):
        x = torch.randn(4, 4096, generator=gen)
        eng.backward(eng(x).square().mean())
        eng.step()
        norms.append(eng.get_global_grad_norm())
    placed = {role: [(hp.advised_bytes(t), _whole_pages(t)) for t in ts]
              for role, ts in tier_tensors(eng.zero_optimizer).items()}
    weights = [p.detach().clone() for p in model.parameters()]
    eng.destroy()
    return {"placed": placed, "weights": weights, "norms": norms}


def _train_small_then_huge(stage: int, device: str, nvme_path: str) -> tuple[dict, dict]:
    """Both sides of the comparison in one spawned world (one spawn, not two): small pages first, so its
    "nothing advised" check sees a process that never advised anything, as a world of its own would."""
    small = _train(stage, device, nvme_path, False)
    return _train(stage, device, nvme_path, True), small


@needs_thp
@pytest.mark.parametrize("stage,device", [(2, "cpu"), (3, "cpu"), (2, "nvme")])
def test_offloaded_partition_is_on_huge_pages_and_trains_as_on_small_pages(tmp_path, stage, device):
    both = run_distributed(_train_small_then_huge, world_size=2, args=(stage, device, str(tmp_path)), timeout=240)
    roles = ("master", "master_grad", "optimizer_state") if device == "cpu" else ("master", "swap_buffers")
    for rank, (h, s) in enumerate(both):
        for role in roles:
            large = [(got, whole) for got, whole in h["placed"][role] if whole >= hp.MIN_BYTES]  # not "step"
            assert large, f"rank {rank}: no large {role} tensor"
            if role == "swap_buffers":  # cut from one advised block per pool (two pools at most): all but its tail
                got, whole = (sum(pair[i] for pair in large) for i in (0, 1))
                assert got >= whole - 2 * hp.HUGE_PAGE, f"rank {rank}: {got} of {whole} pool bytes advised"
            for got, whole in large if role != "swap_buffers" else ():
                assert got == whole, f"rank {rank} {role}: {got} of {whole} bytes advised for huge pages"
            assert all(got == 0 for got, _ in s["placed"][role]), f"rank {rank} {role}: advised when off"
        assert h["norms"] == s["norms"], f"rank {rank}"
        assert all(torch.equal(a, b) for a, b in zip(h["weights"], s["weights"])), f"rank {rank}"
