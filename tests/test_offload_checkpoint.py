"""Checkpoints of offloaded runs hold the offloaded state and load into any offload setting, stage and
world size, and the loaded runs continue as the run that never stopped.

A 2-rank ZeRO-2 run with `offload_optimizer: cpu` (copies staged, as on an accelerator: see
test_offload_parity.py) saves after 4 AdamW steps. Loaded at 2 ranks with no offload, with CPU offload,
at stage 1 with offload and at stage 3 with optimizer and parameter offload, 3 more steps equal the
uninterrupted 7-step run without offload bit for bit at stage 2 (same reduction order) and within
atol 2e-6 at stages 1 and 3 (their buckets sum in another order). Loaded at 1 rank with and without
offload, the two continuations are bitwise equal to each other and within 1e-5 of the 2-rank run (only
the reduction order differs). AdamW's moments make a lost or misplaced optimizer state visible.
The same with NVMe optimizer offload (the swapped state streamed by engine/checkpoint/nvme.py), and under
NVMe the state APIs (safe_get_full_* / safe_get_local_*, `eng.optimizer.state_dict()` and
`load_state_dict()`) return the swapped state: equal to the same run without offload. A checkpoint saved
before the first step, loaded into a run that has stepped, leaves it no optimizer state, as without offload.
An async save under NVMe (`checkpoint.async_save`: file-level snapshot, engine/checkpoint/nvme.py's
note) writes the bytes of the synchronous save of the same state, although its writer is held back
until two more steps have rewritten both swap slots and the host flat; its snapshot copies are gone
once it is committed. Three more 2-rank NVMe checkpoints reshard to 1 rank into their own tiers, equal
to the same load without offload: bf16 at stage 2 (the 16-bit send image), and stage 3 with the
parameters on NVMe too, in fp32 and bf16 (16-bit parameter files).
[Note: two spawns] Every 2-rank scenario runs in one spawned job and every 1-rank one in another
(module-scoped fixtures); the tests assert on their results. The uninterrupted run is shared.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

import engine
from engine.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_get_local_fp32_param,
                          safe_get_local_optimizer_state)
from tests.harness import run_distributed
from tests.models import OddMLP, make_batches, micro_batches

BATCH, SAVE_AT, MORE = 8, 4, 3
OPT_CPU = {"offload_optimizer": {"device": "cpu"}}
BOTH_CPU = {**OPT_CPU, "offload_param": {"device": "cpu"}}
STAGED = {"DSTRAIN_OFFLOAD_STAGE_COPIES": "1"}


def _config(stage: int, offload: dict, extra: dict | None = None) -> dict:
    return {**(extra or {}), "train_batch_size": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 600, "allgather_bucket_size": 900,
                                  "stage3_param_persistence_threshold": 5, **offload}}


def _engine(stage: int, offload: dict, seed: int = 0, extra: dict | None = None):
    torch.manual_seed(seed)  # another seed at load: everything must come from the checkpoint
    eng, _, _, _ = engine.initialize(model=OddMLP(), config=_config(stage, offload, extra))
    return eng


def _train(eng, batches) -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    dtype = next(eng.module.parameters()).dtype  # bf16 runs take bf16 inputs
    for x, y in batches:
        for xm, ym in micro_batches(x.to(dtype), y.to(dtype), rank, world, 1):
            eng.backward(eng(xm, ym))
            eng.step()


def _params(eng) -> dict:
    return {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters() if p.requires_grad}


BATCHES = make_batches(SAVE_AT + MORE, BATCH)
TARGETS_2 = {"stage2-none": (2, {}), "stage2-cpu": (2, OPT_CPU), "stage1-cpu": (1, OPT_CPU), "stage3-both": (3, BOTH_CPU)}
TARGETS_1 = {"stage2-none": (2, {}), "stage2-cpu": (2, OPT_CPU)}


def _save_and_load_at_two_ranks(ckpt: str, uninterrupted: dict) -> dict:
    saver = _engine(2, OPT_CPU)
    assert saver.zero_optimizer.tier.staged
    _train(saver, BATCHES[:SAVE_AT])
    saver.save_checkpoint(ckpt, tag="offloaded")
    saver.wait_for_checkpoint()
    out = {"uninterrupted": uninterrupted}
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


def test_offloaded_checkpoint_loads_anywhere_and_continues_as_the_uninterrupted_run(two_ranks, one_rank):
    for rank, result in enumerate(two_ranks):
        result = result["cpu"]
        want = result["uninterrupted"]
        _close(result["stage2-none"], want, 0, f"rank {rank} offload -> no offload")
        _close(result["stage2-cpu"], want, 0, f"rank {rank} offload -> offload")
        _close(result["stage1-cpu"], want, 2e-6, f"rank {rank} stage 2 -> stage 1 offload")
        _close(result["stage3-both"], want, 2e-6, f"rank {rank} stage 2 -> stage 3 param+optimizer offload")
    one = one_rank["cpu"]
    _close(one["stage2-cpu"], one["stage2-none"], 0, "1 rank: offload vs no offload")
    _close(one["stage2-cpu"], two_ranks[0]["cpu"]["uninterrupted"], 1e-5, "1 rank vs the 2-rank uninterrupted run")


# -- NVMe optimizer offload (engine/checkpoint/nvme.py) ---------------------------------------------
def _nvme(path: str) -> dict:
    return {"sub_group_size": 100, "offload_optimizer": {"device": "nvme", "nvme_path": path}}


def _state_apis(eng) -> dict:
    """What the state APIs say after training: per parameter, and the optimizer's own state_dict."""
    per_param = {}
    for n, p in eng.module.named_parameters():
        if p.requires_grad:
            per_param[n] = {"fp32": safe_get_full_fp32_param(p), "local_fp32": safe_get_local_fp32_param(p),
                            **{k: safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq", "step")},
                            "local_exp_avg": safe_get_local_optimizer_state(p, "exp_avg")}
    return {"per_param": per_param, "state_dict": eng.optimizer.state_dict()["state"]}


def _load_state_dict_round_trip(eng, state_dict: dict) -> dict:
    """`eng.optimizer.load_state_dict` of another run's state, read back through state_dict()."""
    eng.optimizer.load_state_dict(state_dict)
    return {"in_memory": sum(len(s) for s in eng.optimizer.state.values()),
            "read_back": eng.optimizer.state_dict()["state"]}


def _nvme_save_and_load(ckpt: str, nvme_path: str, uninterrupted: dict) -> dict:
    """Save with NVMe offload, load into no offload, CPU offload and NVMe; save without offload, load
    into NVMe. Every continuation must be the uninterrupted run (stage 2, same reduction order). The
    two savers trained alike: their state APIs must agree."""
    out = {"uninterrupted": uninterrupted, "apis": {}}
    for source, offload in (("nvme", _nvme(nvme_path)), ("none", {})):
        saver = _engine(2, offload)
        _train(saver, BATCHES[:SAVE_AT])
        saver.save_checkpoint(ckpt, tag=source)
        saver.wait_for_checkpoint()
        out["apis"][source] = _state_apis(saver)
        if source == "nvme":
            nvme_saver = saver  # kept for the load_state_dict round trip below
        else:
            out["round_trip"] = _load_state_dict_round_trip(nvme_saver, saver.optimizer.state_dict())
            nvme_saver.destroy()
            saver.destroy()
    for name, (tag, offload) in {"nvme->none": ("nvme", {}), "nvme->cpu": ("nvme", OPT_CPU),
                                 "nvme->nvme": ("nvme", _nvme(nvme_path)),
                                 "none->nvme": ("none", _nvme(nvme_path))}.items():
        eng = _engine(2, offload, seed=1)
        eng.load_checkpoint(ckpt, tag=tag)
        _train(eng, BATCHES[SAVE_AT:])
        out[name] = _params(eng)
        eng.destroy()
    out["stateless"] = _stateless_loads(ckpt, nvme_path)
    out["weights_only"] = _weights_only_loads(ckpt, nvme_path)
    return out


WEIGHTS_ONLY = {"load_optimizer_states=False": {"load_optimizer_states": False},
                "load_module_only": {"load_module_only": True}}


def _weights_only_loads(ckpt: str, nvme_path: str) -> dict:
    """The NVMe checkpoint's weights loaded into engines that trained 2 steps, leaving their optimizer
    state alone: every tier keeps its own moments and step count, as without offload."""
    out = {}
    for how, kwargs in WEIGHTS_ONLY.items():
        for name, offload in (("none", {}), ("cpu", OPT_CPU), ("nvme", _nvme(nvme_path))):
            eng = _engine(2, offload, seed=1)
            _train(eng, BATCHES[:2])
            eng.load_checkpoint(ckpt, tag="nvme", **kwargs)
            _train(eng, BATCHES[SAVE_AT:])
            out[how, name] = _params(eng)
            eng.destroy()
    return out


def _stateless_loads(ckpt: str, nvme_path: str) -> dict:
    """A checkpoint saved before the first step (no optimizer state) loaded into engines that trained 2
    steps: the state they built is replaced by none, as without offload, so every tier continues alike."""
    saver = _engine(2, {})
    saver.save_checkpoint(ckpt, tag="untrained")
    saver.wait_for_checkpoint()
    saver.destroy()
    out = {}
    for name, offload in (("none", {}), ("cpu", OPT_CPU), ("nvme", _nvme(nvme_path))):
        eng = _engine(2, offload, seed=1)
        _train(eng, BATCHES[:2])
        eng.load_checkpoint(ckpt, tag="untrained")
        _train(eng, BATCHES[SAVE_AT:])
        out[name] = _params(eng)
        eng.destroy()
    return out


def _files_of(tag_dir: Path) -> dict:
    """A committed tag's files as bytes; metadata.json without its config (async_save differs there)."""
    out = {f.name: f.read_bytes() for f in sorted(tag_dir.iterdir()) if f.name not in ("metadata.json", "manifest.json")}
    meta = json.loads((tag_dir / "metadata.json").read_text())
    meta.pop("config")
    out["metadata.json"] = meta
    return out


def _nvme_async_save(ckpt: str, nvme_path: str) -> dict:
    """A synchronous and an async NVMe save of the same state (4 steps); the async one's writer is
    held until 2 more steps ran (module note), which rewrite both swap slots and the host flat."""
    import engine.checkpoint.writer as writer
    out = {}
    for mode in ("sync", "async"):
        eng = _engine(2, _nvme(nvme_path), extra={"checkpoint": {"async_save": mode == "async"}})
        _train(eng, BATCHES[:SAVE_AT])
        gate, real = threading.Event(), writer.write_and_commit
        if mode == "async":  # the background thread calls it through the module (held until gate.set())
            writer.write_and_commit = lambda snap, comm: (gate.wait(60), real(snap, comm))
        try:
            eng.save_checkpoint(os.path.join(ckpt, mode), tag="t")
            if mode == "async":
                _train(eng, BATCHES[SAVE_AT:SAVE_AT + 2])
                out["copies_while_held"] = sorted(p.name for p in eng.zero_optimizer.nvme.swap.path.glob("ckpt*"))
        finally:
            gate.set()
            eng.wait_for_checkpoint()
            writer.write_and_commit = real
        out[mode] = _files_of(Path(ckpt, mode, "t"))
        out[mode + "_copies_after"] = sorted(p.name for p in eng.zero_optimizer.nvme.swap.path.glob("ckpt*"))
        eng.destroy()
    return out


def _nvme_load_at_one_rank(ckpt: str, nvme_path: str) -> dict:
    """The 2-rank NVMe checkpoint, and the 2-rank one without offload, each into 1 rank with and without NVMe."""
    out = {}
    for tag, prefix in (("nvme", ""), ("none", "none->")):
        for name, offload in (("none", {}), ("nvme", _nvme(nvme_path))):
            eng = _engine(2, offload, seed=1)
            eng.load_checkpoint(ckpt, tag=tag)
            _train(eng, BATCHES[SAVE_AT:])
            out[prefix + name] = _params(eng)
            eng.destroy()
    return out


BF16 = {"bf16": {"enabled": True}}


def _both_nvme(path: str) -> dict:
    return {**_nvme(path), "offload_param": {"device": "nvme", "nvme_path": path, "max_in_cpu": 0}}


# 2-rank NVMe checkpoints that other tests load only at 2 ranks, resharded to 1 here (tag: (stage, tier, extra)):
# bf16 at stage 2 keeps a 16-bit send image (partition_store.py's note) with the master in the optimizer's
# files; at stage 3 with both tiers on NVMe every gather reads the parameter files (16-bit ones in bf16,
# offload/param_swap.py's note).
RESHARD = {"nvme-bf16": (2, _nvme, BF16), "both-nvme": (3, _both_nvme, {}), "both-nvme-bf16": (3, _both_nvme, BF16)}


def _reshard_saves(ckpt: str, nvme_path: str) -> None:
    for tag, (stage, tier, extra) in RESHARD.items():
        saver = _engine(stage, tier(nvme_path), extra=extra)
        _train(saver, BATCHES[:SAVE_AT])
        saver.save_checkpoint(ckpt, tag=tag)
        saver.wait_for_checkpoint()
        saver.destroy()


def _reshard_loads(ckpt: str, nvme_path: str) -> dict:
    """Each 2-rank checkpoint at 1 rank (other partition boundaries), into its own tiers and without offload."""
    out = {}
    for tag, (stage, tier, extra) in RESHARD.items():
        variants = [("none", {}), ("nvme", tier(nvme_path))]
        if tag == "nvme-bf16":  # in place (swap_slots 1): the load reads each master range before writing it
            one_slot = tier(nvme_path)
            one_slot["offload_optimizer"] = {**one_slot["offload_optimizer"], "swap_slots": 1}
            variants.append(("nvme-slot1", one_slot))
        for name, offload in variants:
            eng = _engine(stage, offload, seed=1, extra=extra)
            eng.load_checkpoint(ckpt, tag=tag)
            _train(eng, BATCHES[SAVE_AT:])
            store = eng.zero_optimizer.partition.store
            out[(tag, name)] = {"params": _params(eng), "store": type(store).__name__,
                                "module": {n: p.detach().clone() for n, p in eng.module.named_parameters()}
                                if stage < 3 else None,
                                "read": getattr(store, "bytes_read", None)}
            eng.destroy()
    return out


def _two_rank_job(ckpt: str, nvme_ckpt: str, nvme_path: str) -> dict:
    uninterrupted = _engine(2, {})
    _train(uninterrupted, BATCHES)
    params = _params(uninterrupted)
    _reshard_saves(nvme_ckpt, nvme_path)
    return {"cpu": _save_and_load_at_two_ranks(ckpt, params), "nvme": _nvme_save_and_load(nvme_ckpt, nvme_path, params),
            "nvme_async": _nvme_async_save(nvme_ckpt + "-async", nvme_path)}


def _one_rank_job(ckpt: str, nvme_ckpt: str, nvme_path: str) -> dict:
    return {"cpu": _load_at_one_rank(ckpt), "nvme": _nvme_load_at_one_rank(nvme_ckpt, nvme_path),
            "reshard": _reshard_loads(nvme_ckpt, nvme_path)}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> tuple[str, str, str]:
    d = tmp_path_factory.mktemp("offload_ckpt")
    return os.fspath(d / "ckpt"), os.fspath(d / "nvme_ckpt"), os.fspath(d)


@pytest.fixture(scope="module")
def two_ranks(paths) -> list:
    return run_distributed(_two_rank_job, 2, args=paths, timeout=300, env=STAGED)


@pytest.fixture(scope="module")
def one_rank(paths, two_ranks) -> dict:  # loads what the 2-rank job saved
    return run_distributed(_one_rank_job, 1, args=paths, timeout=180, env=STAGED)[0]


def test_nvme_offloaded_checkpoint_loads_anywhere_and_the_reverse(two_ranks, one_rank):
    for rank, result in enumerate(two_ranks):
        result = result["nvme"]
        for name in ("nvme->none", "nvme->cpu", "nvme->nvme", "none->nvme"):
            _close(result[name], result["uninterrupted"], 0, f"rank {rank} {name}")
    one = one_rank["nvme"]
    _close(one["nvme"], one["none"], 0, "1 rank: NVMe vs no offload from a 2-rank NVMe checkpoint")
    _close(one["nvme"], two_ranks[0]["nvme"]["uninterrupted"], 1e-5, "1 rank vs the 2-rank uninterrupted run")
    _close(one["none->nvme"], one["none->none"], 0, "1 rank: a 2-rank checkpoint without offload into NVMe vs none")
    _close(one["none->nvme"], two_ranks[0]["nvme"]["uninterrupted"], 1e-5, "none -> 1-rank NVMe vs the 2-rank run")


def test_nvme_load_of_a_checkpoint_without_optimizer_state_leaves_none_as_without_offload(two_ranks):
    for rank, result in enumerate(two_ranks):
        got = result["nvme"]["stateless"]
        _close(got["cpu"], got["none"], 0, f"rank {rank}: CPU offload vs no offload")
        _close(got["nvme"], got["none"], 0, f"rank {rank}: NVMe offload vs no offload")


@pytest.mark.parametrize("how", WEIGHTS_ONLY)
def test_nvme_weights_only_load_keeps_the_optimizer_state_as_without_offload(two_ranks, how):
    for rank, result in enumerate(two_ranks):
        got = result["nvme"]["weights_only"]
        _close(got[how, "cpu"], got[how, "none"], 0, f"rank {rank} {how}: CPU offload vs no offload")
        _close(got[how, "nvme"], got[how, "none"], 0, f"rank {rank} {how}: NVMe offload vs no offload")


@pytest.mark.parametrize("tag", RESHARD)
def test_nvme_checkpoints_reshard_into_their_tiers_as_into_no_offload(one_rank, tag):
    """2 ranks -> 1: the master goes into the optimizer's files (and at stage 3 the parameters into their
    files) at other partition boundaries, and the run trains on equal to the same load without offload
    (masters; at stage 2 the module's weights too, which the 16-bit send image's all-gathers set). (The
    load's refresh of the stage-2 image is not observable: every applied step rewrites the whole image
    before its all-gather reads it.)"""
    got, want = one_rank["reshard"][(tag, "nvme")], one_rank["reshard"][(tag, "none")]
    stage = RESHARD[tag][0]
    kind = "HalfImageStore" if stage == 2 else "NvmeParamStore"
    assert got["store"] == kind and want["store"] != kind, (got["store"], want["store"])
    if stage == 3:
        assert got["read"] > 0, "the loaded run never read its parameter files"
    _close(got["params"], want["params"], 0, f"1 rank {tag}: the NVMe tiers vs no offload")
    if stage < 3:
        _close(got["module"], want["module"], 0, f"1 rank {tag}, the module's weights")
    if (tag, "nvme-slot1") in one_rank["reshard"]:
        _close(one_rank["reshard"][(tag, "nvme-slot1")]["params"], want["params"], 0, f"1 rank {tag}, swap_slots 1")


def _equal_states(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want) and want, f"{what}: state of {sorted(got)} vs {sorted(want)}"
    for i in want:
        assert set(got[i]) == set(want[i]), f"{what} [{i}]: keys {sorted(got[i])} vs {sorted(want[i])}"
        for k, w in want[i].items():
            assert torch.equal(got[i][k], w), f"{what} [{i}][{k}] differs"


def test_nvme_state_is_what_the_state_apis_return(two_ranks):
    for rank, result in enumerate(two_ranks):
        apis = result["nvme"]["apis"]
        nvme, none = apis["nvme"]["per_param"], apis["none"]["per_param"]
        assert set(nvme) == set(none)
        for n, want in none.items():
            for k, w in want.items():
                got = nvme[n][k]
                assert got is not None and torch.equal(got, w), f"rank {rank} {n} {k}: NVMe differs from no offload"
        assert int(none["l1.weight"]["step"]) == SAVE_AT and none["l1.weight"]["exp_avg"].abs().sum() > 0
        _equal_states(apis["nvme"]["state_dict"], apis["none"]["state_dict"], f"rank {rank} optimizer.state_dict()")
        trip = result["nvme"]["round_trip"]
        assert trip["in_memory"] == 0, f"rank {rank}: load_state_dict left state in memory under NVMe"
        _equal_states(trip["read_back"], apis["none"]["state_dict"], f"rank {rank} load_state_dict -> state_dict")


def test_nvme_async_save_writes_the_sync_save_while_training_goes_on(two_ranks):
    for rank, result in enumerate(two_ranks):
        result = result["nvme_async"]
        sync, held = result["sync"], result["async"]
        assert set(held) == set(sync) and f"rank_{rank:05d}.pt" in sync, f"rank {rank}: files {sorted(held)}"
        for name, want in sync.items():
            assert held[name] == want, f"rank {rank}: the async save's {name} differs from the sync save's"
        # the snapshot copies existed while the writer was held (2 kinds of AdamW state + the master, per
        # partition), and are gone after the commit, as after the sync save (which makes none)
        assert len(result["copies_while_held"]) >= 3, result["copies_while_held"]
        assert result["async_copies_after"] == result["sync_copies_after"] == []
