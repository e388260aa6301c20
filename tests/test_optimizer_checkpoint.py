"""Each optimizer's state survives a checkpoint, with and without the optimizer offloaded: resumed at the
same stage and world size it continues bit for bit; loaded at another world size (2 -> 1 and 2 -> 4
ranks for all; Lamb and Muon also from the CPU-offloaded save at 4), stage (1 -> 3) or offload tier
(none <-> cpu, cpu -> nvme) every
state tensor is the saved one exactly (its declared layout, engine/checkpoint/state_layout.py, files
it per element or per tensor) and training continues to the
uninterrupted result at fp32 tolerance (only the ranks' summation order differs). The global batch is
the same at every world size. Checkpoints are saved at stage 1 on 2 ranks, once without offload and
once with `offload_optimizer.device: "cpu"` (DSTRAIN_OFFLOAD_STAGE_COPIES=1: the accelerator's copy path).
torch's Adafactor (per-tensor state: each matrix's row and column factors, refused at stage >= 1) is
saved at stage 0 on 2 ranks and resumes bit for bit there and at 1 rank.
mup's MuAdam, MuAdamW and MuSGD (torch's Adam, AdamW, SGD over mup's param groups, one lr per width
multiplier) are saved at stage 1 without offload after each group's lr was halved, as a schedule would:
a load keeps every state tensor and every group's lr (a fresh engine has mup's own lrs: a load that
dropped the saved ones would differ), resumes bit for bit at 2 ranks and reshards to 1 rank (stage 0),
2 ranks at stage 3 with CPU offload, and 4 ranks at stage 2.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import engine
from engine.checkpoint.state_layout import STATE_LAYOUTS
from engine.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from tests import optimizer_runs
from tests import test_mup_optimizers as mup_set
from tests.models import make_batches, micro_batches
from tests.test_optimizer_set import OPTIMIZERS, Net, _offload

GLOBAL_BATCH, STEPS, SAVE_AT, SAVED_STAGE = 8, 4, 2, 1
CLASS_OF = {"Adagrad": "Adagrad", "Lion": "Lion", "Lamb": "Lamb", "Muon": "MuonWithAuxAdam", "Adafactor": "Adafactor",
            "RMSprop": "RMSprop",
            "MuAdam": "Adam", "MuAdamW": "AdamW", "MuSGD": "SGD"}  # mup's builders return torch's classes
PARAMS = {**OPTIMIZERS, "Adafactor": {"lr": 0.02}, **mup_set.PARAMS}
ALL = ("Adagrad", "Lion", "Lamb", "Muon", "RMSprop")  # RMSprop: a torch.optim class by name
MUP = ("MuAdam", "MuAdamW", "MuSGD")
SAVES = [(saved, kind, SAVED_STAGE) for saved in ("none", "cpu") for kind in ALL] + [
    ("none", "Adafactor", 0)] + [("none", kind, SAVED_STAGE) for kind in MUP]  # (offload, optimizer, stage) saved
# world -> [(saved offload, stage, offload, optimizers)] each saved checkpoint is loaded into; at 4 ranks
# (oversubscribed) every optimizer once, and the per-tensor ones, whose state layout differs most from
# the elementwise, from the CPU-offloaded save too; mup's have several param groups, each with its own lr.
TARGETS = {1: [("none", 0, "none", ALL + ("Adafactor",) + MUP), ("cpu", 0, "none", ALL)],
           2: [("none", SAVED_STAGE, "none", ALL + MUP), ("cpu", SAVED_STAGE, "cpu", ALL),
               ("none", 3, "cpu", ALL + MUP), ("cpu", 3, "none", ALL), ("cpu", 2, "nvme", ALL),
               ("none", 0, "none", ("Adafactor",))],
           4: [("none", 2, "none", ALL + MUP), ("cpu", 3, "cpu", ("Lamb", "Muon"))]}


def _engine(kind: str, stage: int, offload: str = "none", nvme_path: str | None = None):
    world = torch.distributed.get_world_size()
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
           "gradient_clipping": 0.0, "optimizer": {"type": kind, "params": PARAMS[kind]},
           "zero_allow_untested_optimizer": kind in ("RMSprop", "MuSGD"),
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 150, "stage3_param_persistence_threshold": 10,
                                 **_offload(offload, nvme_path)}}
    torch.manual_seed(0)
    eng, _, _, _ = engine.initialize(model=mup_set.make_model() if kind in MUP else Net(), config=cfg)
    return eng


def _train(eng, first: int, last: int) -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for x, y in make_batches(STEPS, GLOBAL_BATCH)[first:last]:
        for xm, ym in micro_batches(x, y, rank, world, 1):
            eng.backward(eng(xm, ym))
            eng.step()


def _state(eng, kind: str) -> dict:
    out = {}
    for name, p in eng.module.named_parameters():
        out[(name, "fp32")] = safe_get_full_fp32_param(p)
        for key in STATE_LAYOUTS[CLASS_OF[kind]]:
            value = safe_get_full_optimizer_state(p, key)
            if value is not None:
                out[(name, key)] = torch.as_tensor(value).float().clone()
    if kind in MUP:  # each group's lr: mup's width scaling (and whatever a schedule did to it)
        for i, group in enumerate(eng.optimizer.param_groups):
            out[("group", i, "lr")] = torch.tensor(group["lr"], dtype=torch.float64)
    return out


def _weights(eng) -> dict:
    return {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters()}


def _save_all(root: str) -> dict:
    out = {}
    for saved, kind, stage in SAVES:
        eng = _engine(kind, stage, saved)
        _train(eng, 0, SAVE_AT)
        if kind in MUP:  # as a schedule would: the loads must restore these, not mup's own lrs
            for group in eng.optimizer.param_groups:
                group["lr"] *= 0.5
        eng.save_checkpoint(Path(root) / saved / kind)
        eng.wait_for_checkpoint()
        state = _state(eng, kind)
        _train(eng, SAVE_AT, STEPS)
        out[(saved, kind)] = {"saved": state, "final": _weights(eng)}
    return out


def _load_all(root: str) -> dict:
    out = {}
    for saved, stage, offload, kinds in TARGETS[torch.distributed.get_world_size()]:
        for kind in kinds:  # each load its own part: one that fails fails only its tests
            optimizer_runs.record(out, (saved, kind, stage, offload), _load_one, root, saved, kind, stage, offload)
    return out


def _load_one(root: str, saved: str, kind: str, stage: int, offload: str) -> dict:
    eng = _engine(kind, stage, offload, nvme_path=os.path.join(root, "nvme"))
    eng.load_checkpoint(Path(root) / saved / kind)
    loaded = _state(eng, kind)
    _train(eng, SAVE_AT, STEPS)
    if offload == "nvme":
        eng.destroy()  # removes the swap directory (destroy's gc.collect costs ~1 s: only where needed)
    return {"loaded": loaded, "final": _weights(eng)}


@pytest.fixture(scope="module")
def runs():
    """tests/optimizer_runs.py saves at 2 ranks, then loads at 2 ranks in the same spawn, and at 1 and 4."""
    return optimizer_runs.part(2, "saved")[0], {w: optimizer_runs.Results(optimizer_runs.part(w, "loaded")[0])
                                                for w in TARGETS}


@pytest.mark.parametrize("saved, kind", [(saved, kind) for saved, kind, stage in SAVES if stage == SAVED_STAGE])
def test_resume_at_the_same_stage_is_bit_for_bit(runs, saved, kind):
    full, loaded = runs
    got = loaded[2][(saved, kind, SAVED_STAGE, saved)]
    assert set(got["loaded"]) == set(full[(saved, kind)]["saved"]), f"{kind}: state keys differ"
    for key, value in full[(saved, kind)]["saved"].items():
        assert torch.equal(got["loaded"][key], value), f"{kind} {key}: loaded state differs"
    for name, value in full[(saved, kind)]["final"].items():
        assert torch.equal(got["final"][name], value), f"{kind} {name}: resumed training differs"


RESHARDS = [(world, saved, stage, offload, kind) for world, targets in TARGETS.items()
            for saved, stage, offload, kinds in targets for kind in kinds
            if (world, stage, offload) != (2, SAVED_STAGE, saved) and kind != "Adafactor"]


@pytest.mark.parametrize("world, saved, stage, offload, kind", RESHARDS, ids=lambda v: str(v))
def test_reshard_keeps_every_state_tensor_and_continues(runs, world, saved, stage, offload, kind):
    full, loaded = runs
    got, want = loaded[world][(saved, kind, stage, offload)], full[(saved, kind)]
    assert set(got["loaded"]) == set(want["saved"]), f"{kind}: state keys differ"
    if kind in MUP:  # the halved lrs came back, and mup's scaling made them differ between groups
        lrs = {value.item() for key, value in want["saved"].items() if key[0] == "group"}
        assert len(lrs) >= 2, f"{kind}: one lr for every group ({lrs}): no μP scaling"
    for key, value in want["saved"].items():
        assert torch.equal(got["loaded"][key], value), f"{kind} {key}: loaded state differs"
    for name, value in want["final"].items():
        err = (got["final"][name] - value).abs().max().item()
        assert err < 2e-5, f"{kind} {name}: after resharding max |w - w_uninterrupted| = {err:.2e}"


@pytest.mark.parametrize("world", [2, 1])
def test_adafactor_per_tensor_state_round_trips_at_stage_0(runs, world):
    """Row and column factors are whole per tensor (state_layout.PER_TENSOR): every rank holds and saves
    them whole, and any world size loads them as saved; the biases' `variance` is per element. At 2
    ranks training resumes bit for bit, at 1 rank to fp32 tolerance."""
    full, loaded = runs
    got, want = loaded[world][("none", "Adafactor", 0, "none")], full[("none", "Adafactor")]
    kinds = {key[1] for key in want["saved"]}
    assert {"row_var", "col_var", "variance", "step"} <= kinds, kinds
    assert set(got["loaded"]) == set(want["saved"])
    for key, value in want["saved"].items():
        assert torch.equal(got["loaded"][key], value), f"Adafactor {key}: loaded state differs"
    for name, value in want["final"].items():  # at 1 rank only the gradient's summation order differs
        err = (got["final"][name] - value).abs().max().item()
        assert err == 0 if world == 2 else err < 2e-5, f"Adafactor {name}: max |w - w_uninterrupted| = {err:.2e}"
