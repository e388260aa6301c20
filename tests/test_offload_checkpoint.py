"""Checkpoints of offloaded runs hold the offloaded state and load into any offload setting, stage and
world size, and the loaded runs continue as the run that never stopped.

A 2-rank ZeRO-2 run with `offload_optimizer: cpu` (copies staged, as on an accelerator: see
test_offload_parity.py) saves after 4 AdamW steps. Loaded at 2 ranks with no offload, with CPU offload,
at stage 1 with offload and at stage 3 with optimizer and parameter offload, 3 more steps equal the
uninterrupted 7-step run without offload bit for bit at stage 2 (same reduction order) and within
atol 2e-6 at stages 1 and 3 (their buckets sum in another order). Loaded at 1 rank with and without
offload, the two continuations are bitwise equal to each other and within 1e-5 of the 2-rank run (only
the reduction order differs). AdamW's moments make a lost or misplaced optimizer state visible.
"""
from __future__ import annotations

import os

import torch

import engine
from engine.utils import safe_get_full_fp32_param
from tests.harness import run_distributed
from tests.models import OddMLP, make_batches, micro_batches

BATCH, SAVE_AT, MORE = 8, 4, 3
OPT_CPU = {"offload_optimizer": {"device": "cpu"}}
BOTH_CPU = {**OPT_CPU, "offload_param": {"device": "cpu"}}
STAGED = {"DSTRAIN_OFFLOAD_STAGE_COPIES": "1"}


def _config(stage: int, offload: dict) -> dict:
    return {"train_batch_size": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 600, "allgather_bucket_size": 900,
                                  "stage3_param_persistence_threshold": 5, **offload}}


def _engine(stage: int, offload: dict, seed: int = 0):
    torch.manual_seed(seed)  # another seed at load: everything must come from the checkpoint
    eng, _, _, _ = engine.initialize(model=OddMLP(), config=_config(stage, offload))
    return eng


def _train(eng, batches) -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for x, y in batches:
        for xm, ym in micro_batches(x, y, rank, world, 1):
            eng.backward(eng(xm, ym))
            eng.step()


def _params(eng) -> dict:
    return {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters() if p.requires_grad}


BATCHES = make_batches(SAVE_AT + MORE, BATCH)
TARGETS_2 = {"stage2-none": (2, {}), "stage2-cpu": (2, OPT_CPU), "stage1-cpu": (1, OPT_CPU), "stage3-both": (3, BOTH_CPU)}
TARGETS_1 = {"stage2-none": (2, {}), "stage2-cpu": (2, OPT_CPU)}


def _save_and_load_at_two_ranks(ckpt: str) -> dict:
    uninterrupted = _engine(2, {})
    _train(uninterrupted, BATCHES)
    saver = _engine(2, OPT_CPU)
    assert saver.zero_optimizer.tier.staged
    _train(saver, BATCHES[:SAVE_AT])
    saver.save_checkpoint(ckpt, tag="offloaded")
    saver.wait_for_checkpoint()
    out = {"uninterrupted": _params(uninterrupted)}
    for name, (stage, offload) in TARGETS_2.items():
        eng = _engine(stage, offload, seed=1)
        eng.load_checkpoint(ckpt, tag="offloaded")
        _train(eng, BATCHES[SAVE_AT:])
        out[name] = _params(eng)
    return out


def _load_at_one_rank(ckpt: str) -> dict:
    out = {}
    for name, (stage, offload) in TARGETS_1.items():
        eng = _engine(stage, offload, seed=1)
        eng.load_checkpoint(ckpt, tag="offloaded")
        _train(eng, BATCHES[SAVE_AT:])
        out[name] = _params(eng)
    return out


def _close(got: dict, want: dict, atol: float, what: str) -> None:
    for n, w in want.items():
        err = (got[n] - w).abs().max().item()
        assert (torch.equal(got[n], w) if atol == 0 else err <= atol), f"{what} {n}: max |diff| {err:.3e}"


def test_offloaded_checkpoint_loads_anywhere_and_continues_as_the_uninterrupted_run(tmp_path):
    ckpt = os.fspath(tmp_path / "ckpt")
    two = run_distributed(_save_and_load_at_two_ranks, 2, args=(ckpt,), timeout=180, env=STAGED)
    for rank, result in enumerate(two):
        want = result["uninterrupted"]
        _close(result["stage2-none"], want, 0, f"rank {rank} offload -> no offload")
        _close(result["stage2-cpu"], want, 0, f"rank {rank} offload -> offload")
        _close(result["stage1-cpu"], want, 2e-6, f"rank {rank} stage 2 -> stage 1 offload")
        _close(result["stage3-both"], want, 2e-6, f"rank {rank} stage 2 -> stage 3 param+optimizer offload")
    one = run_distributed(_load_at_one_rank, 1, args=(ckpt,), timeout=120, env=STAGED)[0]
    _close(one["stage2-cpu"], one["stage2-none"], 0, "1 rank: offload vs no offload")
    _close(one["stage2-cpu"], two[0]["uninterrupted"], 1e-5, "1 rank vs the 2-rank uninterrupted run")


# -- NVMe optimizer offload (engine/checkpoint/nvme.py) ---------------------------------------------
def _nvme(path: str) -> dict:
    return {"sub_group_size": 100, "offload_optimizer": {"device": "nvme", "nvme_path": path}}


def _nvme_save_and_load(ckpt: str, nvme_path: str) -> dict:
    """Save with NVMe offload, load into no offload, CPU offload and NVMe; save without offload, load
    into NVMe. Every continuation must be the uninterrupted run (stage 2, same reduction order)."""
    uninterrupted = _engine(2, {})
    _train(uninterrupted, BATCHES)
    out = {"uninterrupted": _params(uninterrupted)}
    for source, offload in (("nvme", _nvme(nvme_path)), ("none", {})):
        saver = _engine(2, offload)
        _train(saver, BATCHES[:SAVE_AT])
        saver.save_checkpoint(ckpt, tag=source)
        saver.wait_for_checkpoint()
        saver.destroy()
    for name, (tag, offload) in {"nvme->none": ("nvme", {}), "nvme->cpu": ("nvme", OPT_CPU),
                                 "nvme->nvme": ("nvme", _nvme(nvme_path)),
                                 "none->nvme": ("none", _nvme(nvme_path))}.items():
        eng = _engine(2, offload, seed=1)
        eng.load_checkpoint(ckpt, tag=tag)
        _train(eng, BATCHES[SAVE_AT:])
        out[name] = _params(eng)
        eng.destroy()
    return out


def _nvme_load_at_one_rank(ckpt: str, nvme_path: str) -> dict:
    out = {}
    for name, offload in (("none", {}), ("nvme", _nvme(nvme_path))):
        eng = _engine(2, offload, seed=1)
        eng.load_checkpoint(ckpt, tag="nvme")
        _train(eng, BATCHES[SAVE_AT:])
        out[name] = _params(eng)
        eng.destroy()
    return out


def test_nvme_offloaded_checkpoint_loads_anywhere_and_the_reverse(tmp_path):
    ckpt, nvme_path = os.fspath(tmp_path / "ckpt"), os.fspath(tmp_path)
    two = run_distributed(_nvme_save_and_load, 2, args=(ckpt, nvme_path), timeout=180, env=STAGED)
    for rank, result in enumerate(two):
        for name in ("nvme->none", "nvme->cpu", "nvme->nvme", "none->nvme"):
            _close(result[name], result["uninterrupted"], 0, f"rank {rank} {name}")
    one = run_distributed(_nvme_load_at_one_rank, 1, args=(ckpt, nvme_path), timeout=120, env=STAGED)[0]
    _close(one["nvme"], one["none"], 0, "1 rank: NVMe vs no offload from a 2-rank NVMe checkpoint")
    _close(one["nvme"], two[0]["uninterrupted"], 1e-5, "1 rank vs the 2-rank uninterrupted run")
