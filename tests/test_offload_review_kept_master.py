"""Hostile review of the NVMe parameter store's kept buffers and of the master the NVMe optimizer copies
from them (offload/param_swap.py's notes: kept buffers, the master's file; swapped_partition.py's note:
master copy): everything that changes the committed master outside a plain step must reach the resident
copies and kept buffers before the next step copies its master from there.

One 2-rank spawn; tests.models.StackNet 5 deep at ZeRO-3, both tiers on NVMe with a parameter buffer for
every group (tests/offload_runs.py's BOTH_NVME_KEPT), SGD without clipping (linear in the gradient). The
same sequence of events runs with and without offload and the weights (`safe_get_full_fp32_param`), the
losses and the gradient norms are compared bit for bit after each step: a `GatheredParameters` edit of
a weight and of a persistent bias, a checkpoint saved and loaded back into the same engine after
another step, an Inf on one rank (a skipped step), a step that fails halfway and whose send image the
tier puts back, and every step after those copying its master from the kept buffers (`masters_copied`
counted). Variants: two param groups with their own learning rates (two flats, two master files), and
bf16 with `fast_init` (fp32 parameter files in 16-bit training, so the master copy is active there too).
"""
from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed

STEPS = 8
EDIT_AT, SAVE_AT, LOAD_AT, INF_AT, FAIL_AT = 1, 2, 4, 5, 6


def _edit(eng, params) -> None:
    import engine
    with engine.zero.GatheredParameters(params, modifier_rank=0):
        if torch.distributed.get_rank() == 0:
            for p in params:
                p.data.mul_(0.5).add_(0.01)


def _fail_once(tier) -> None:
    """The next step's gradient reads fail after each flat's first sub-group (the restore succeeds)."""
    reader = tier.grad_reader

    def failing_reader(key):
        read, part = reader(key), tier.parts[key]

        def read_or_fail(s, e):
            if s >= part.groups[1][0]:
                raise RuntimeError("gradient read failed")
            return read(s, e)
        return read_or_fail
    tier.grad_reader = failing_reader


def _run(nvme_path: str, ckpt: str, variant: str, offloaded: bool) -> dict:
    import engine
    from engine.utils import safe_get_full_fp32_param
    from tests.models import StackNet, make_batches, micro_batches
    from tests.offload_runs import BOTH_NVME_FAST, BOTH_NVME_KEPT, GAS, MICRO, KEPT_BUFFERS, config
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    precision = "bf16" if variant == "bf16_fast" else "fp32"
    name = (BOTH_NVME_FAST if variant == "bf16_fast" else BOTH_NVME_KEPT) if offloaded else {}
    cfg = config(3, "sgd", name, precision, nvme_path)
    if offloaded:
        cfg["zero_optimization"]["offload_param"]["buffer_count"] = KEPT_BUFFERS
    torch.manual_seed(0)
    model = StackNet(depth=5)
    params = model.parameters()
    if variant == "two_groups":
        head = [p for n, p in model.named_parameters() if n.startswith(("layers.3", "layers.4", "out"))]
        params = [{"params": [p for p in model.parameters() if all(p is not q for q in head)]},
                  {"params": head, "lr": 0.05}]
    eng = engine.initialize(model=model, model_parameters=params, config=cfg)[0]
    cast = next(eng.module.parameters()).dtype
    tier = eng.zero_optimizer.nvme
    out = {"weights": [], "losses": [], "norms": [], "copied": [], "events": []}
    for step, (x, y) in enumerate(make_batches(STEPS, MICRO * GAS * world)):
        if step == EDIT_AT:
            _edit(eng, [eng.module.layers[1].weight, eng.module.layers[3].weight, eng.module.layers[2].bias])
        if step == LOAD_AT:
            eng.load_checkpoint(ckpt, tag=variant)  # back to after SAVE_AT's step, in the same engine
        if step == FAIL_AT and offloaded:
            _fail_once(tier)
            try:
                for xm, ym in micro_batches(x.to(cast), y.to(cast), rank, world, GAS):
                    eng.backward(eng(xm, ym))
                    eng.step()
            except RuntimeError as err:
                out["events"].append(str(err))
            del tier.grad_reader  # the raised boundary step dropped its window (engine.step): the batch trains again
            out["weights_after_failure"] = {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters()}
        for k, (xm, ym) in enumerate(micro_batches(x.to(cast), y.to(cast), rank, world, GAS)):
            loss = eng(xm, ym)
            if step == INF_AT and rank == 1 and k == GAS - 1:
                loss = loss * float("inf")
            out["losses"].append(float(loss.detach()))
            eng.backward(loss)
            eng.step()
        out["norms"].append(eng.get_global_grad_norm())
        out["weights"].append({n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters()})
        out["copied"].append(sum(part.masters_copied for part in tier.parts.values()) if offloaded else 0)
        if step == SAVE_AT:
            eng.save_checkpoint(ckpt, tag=variant)
        if step == FAIL_AT - 1:
            out["weights_before_failure"] = out["weights"][-1]
    out["skipped"] = eng.skipped_steps
    eng.destroy()
    return out


def _all(root: str) -> dict:
    import os
    out = {}
    for variant in ("one_group", "two_groups", "bf16_fast"):
        for offloaded in (False, True):
            nvme, ckpt = (os.path.join(root, variant, what, str(offloaded)) for what in ("nvme", "ckpt"))
            os.makedirs(nvme, exist_ok=True)
            out[variant, offloaded] = _run(nvme, ckpt, variant, offloaded)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_all, 2, args=(str(tmp_path_factory.mktemp("review")),), timeout=300)


def _same(got: dict, want: dict, what) -> None:
    for n, w in want.items():
        assert torch.equal(got[n], w), (what, n, float((got[n] - w).abs().max()))


@pytest.mark.parametrize("variant", ["one_group", "two_groups", "bf16_fast"])
def test_kept_master_copies_equal_no_offload_across_edits_loads_skips_and_failures(runs, variant):
    for rank, result in enumerate(runs):
        got, want = result[variant, True], result[variant, False]
        assert got["skipped"] == want["skipped"] == 1, (rank, got["skipped"], want["skipped"])
        assert got["events"] and "gradient read failed" in got["events"][0], (rank, got["events"])
        # the failed step changed nothing the weights show (the tier put the image back)
        _same(got["weights_after_failure"], got["weights_before_failure"], (rank, variant, "failed step"))
        # every applied step after the first copied masters from the kept buffers (not the skipped one)
        copied = got["copied"]
        increments = [b - a for a, b in zip(copied, copied[1:])]
        assert all(n > 0 for i, n in enumerate(increments) if i + 1 != INF_AT), (rank, variant, copied)
        assert got["losses"] == want["losses"], (rank, variant, got["losses"], want["losses"])
        for step, (g, w) in enumerate(zip(got["weights"], want["weights"], strict=True)):
            _same(g, w, (rank, variant, "step", step))
        assert got["norms"][:INF_AT] == want["norms"][:INF_AT], (rank, variant)
