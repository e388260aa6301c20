"""NVMe optimizer offload at stages 1 and 2 (engine/zero/nvme_tier.py) is a storage tier: every step equals
the run without offload bit for bit, with the fp32 master weights and optimizer state in swap files.

Oracles: 10 steps on 2 ranks of tests.models.ReuseNet with gradient accumulation 2, AdamW with clipping
that bites and SGD without clipping (linear in the gradient: a wrong gradient scale moves the weights),
both under a WarmupLR schedule (the swapped step must see every new learning rate), compared with
torch.equal, gradient norms compared exactly. `sub_group_size` 100 (rounded up to 128, nvme_tier.py's
lanes note) divides no partition (asserted), so every step has a short last sub-group; AdamW runs with
pipelined reads and writes. fp16 (loss scale 2^8, unscaled on the host) and bf16 at stage 2 equal the
run without offload in the same precision. An Inf on one rank's loss skips the step and leaves the
swap files' SHA-256 unchanged; `destroy()` removes the swap directory; a missing `nvme_path` is one
ConfigError line naming the key. Copies are staged (DSTRAIN_OFFLOAD_STAGE_COPIES=1) as on an accelerator.
"""
from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import pytest
import torch

import engine
import schemas
from engine.utils import safe_get_full_fp32_param
from tests.harness import run_distributed
from tests.models import ReuseNet, make_batches, micro_batches

STEPS, MICRO, GAS, INF_STEP, SUB_GROUP = 10, 2, 2, 4, 100
OPTIMIZERS = {"adamw": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
              "sgd": {"type": "SGD", "params": {"lr": 0.2}}}


def _offload(optimizer: str, nvme_path: str | None) -> dict:
    if nvme_path is None:
        return {}
    pipelined = optimizer == "adamw"  # 3 tensors per sub-group: 9 buffers hold read, step and write
    return {"sub_group_size": SUB_GROUP, "aio": {"block_size": 4096, "intra_op_parallelism": 2},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 9 if pipelined else 4,
                                  "pipeline_read": pipelined, "pipeline_write": pipelined}}


def _config(stage: int, optimizer: str, nvme_path: str | None, precision: str = "fp32") -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "gradient_clipping": 0.3 if optimizer == "adamw" else 0.0, "optimizer": OPTIMIZERS[optimizer],
            "zero_allow_untested_optimizer": True,
            # a schedule: the swapped step must see the learning rate the engine sets on every step
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.02, "warmup_num_steps": 6}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 700, "allgather_bucket_size": 900,
                                  "overlap_comm": True}}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    offload = _offload(optimizer, nvme_path)
    if offload:
        cfg["aio"] = offload.pop("aio")
        cfg["zero_optimization"].update(offload)
    return cfg


def _swap_hashes(zopt) -> dict:
    return {path: hashlib.sha256(Path(path).read_bytes()).hexdigest()
            for part in zopt.nvme.parts.values() for path in part._files.values()}


def _train(stage: int, optimizer: str, nvme_path: str | None, inf: bool = False, precision: str = "fp32") -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    batches = make_batches(STEPS, MICRO * GAS * world)
    cfg = _config(stage, optimizer, nvme_path, precision)
    eng, _, _, _ = engine.initialize(model=ReuseNet("reentrant"), config=cfg)
    zopt, dtype = eng.zero_optimizer, next(eng.module.parameters()).dtype
    norms, unchanged = [], None
    for step, (x, y) in enumerate(batches):
        poison = inf and step == INF_STEP
        before = _swap_hashes(zopt) if poison and zopt.nvme is not None else None
        for k, (xm, ym) in enumerate(micro_batches(x.to(dtype), y.to(dtype), rank, world, GAS)):
            loss = eng(xm, ym, aux=k == 0)
            if poison and rank == 1 and k == GAS - 1:
                loss = loss * float("inf")
            eng.backward(loss)
            eng.step()
        if before is not None:
            unchanged = before == _swap_hashes(zopt) and len(before) > 0
        norms.append(eng.get_global_grad_norm())
    out = {"params": {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters()},
           "norms": norms, "skipped": eng.skipped_steps, "unchanged": unchanged}
    if zopt.nvme is not None:
        swap_dir = zopt.nvme.swap.path
        out["sub_groups"] = [part.groups for part in zopt.nvme.parts.values()]
        out["state_in_memory"] = sum(len(s) for s in zopt.optimizer.state.values())
        out["swap_files"] = len(list(swap_dir.glob("*.swp")))
        eng.destroy()
        out["swap_dir_left"] = swap_dir.exists()
    return out


CASES = [(stage, opt) for stage in (1, 2) for opt in ("sgd", "adamw")]


def _all_cases(nvme_path: str) -> dict:
    out = {}
    for stage, opt in CASES:
        out[(stage, opt, "none")] = _train(stage, opt, None)
        out[(stage, opt, "nvme")] = _train(stage, opt, nvme_path)
    for precision in ("fp16", "bf16"):
        out[(precision, "none")] = _train(2, "adamw", None, precision=precision)
        out[(precision, "nvme")] = _train(2, "adamw", nvme_path, precision=precision)
    out[("inf", "none")] = _train(2, "adamw", None, inf=True)
    out[("inf", "nvme")] = _train(2, "adamw", nvme_path, inf=True)
    out["left_in_nvme_path"] = sorted(os.listdir(nvme_path))
    try:
        engine.initialize(model=ReuseNet("reentrant"), config=_config(2, "sgd", os.path.join(nvme_path, "missing")))
        out["missing_path"] = None
    except schemas.ConfigError as error:
        out["missing_path"] = error.problems
    lamb = {**_config(2, "sgd", nvme_path), "optimizer": {"type": "Lamb", "params": {"lr": 0.01}}}
    try:
        engine.initialize(model=ReuseNet("reentrant"), config=lamb)
        out["lamb"] = None
    except schemas.ConfigError as error:
        out["lamb"] = error.problems
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    nvme_path = os.fspath(tmp_path_factory.mktemp("nvme"))
    return run_distributed(_all_cases, 2, args=(nvme_path,), timeout=240,
                           env={"DSTRAIN_OFFLOAD_STAGE_COPIES": "1"})


def _assert_same(got: dict, want: dict, what: str) -> None:
    for name, w in want["params"].items():
        g = got["params"][name]
        assert torch.equal(g, w), f"{what} {name}: max |diff| {(g - w).abs().max().item():.3e}"
    assert got["norms"] == want["norms"], f"{what}: gradient norms {got['norms']} != {want['norms']}"


@pytest.mark.parametrize("stage,opt", CASES, ids=lambda v: str(v))
def test_nvme_offload_equals_no_offload_bit_for_bit(runs, stage, opt):
    for rank, result in enumerate(runs):
        got = result[(stage, opt, "nvme")]
        assert all(len(g) > 1 and g[-1][1] - g[-1][0] < g[0][1] - g[0][0] == 128 for g in got["sub_groups"])
        assert got["state_in_memory"] == 0, f"rank {rank}: optimizer state was built in memory"
        assert got["swap_files"] > 0 and got["skipped"] == 0
        _assert_same(got, result[(stage, opt, "none")], f"rank {rank} stage {stage} {opt}")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_16bit_nvme_offload_equals_no_offload_in_the_same_precision(runs, precision):
    for rank, result in enumerate(runs):
        _assert_same(result[(precision, "nvme")], result[(precision, "none")], f"rank {rank} {precision}")


def test_inf_on_one_rank_skips_and_leaves_the_swap_files_unchanged(runs):
    for rank, result in enumerate(runs):
        got, want = result[("inf", "nvme")], result[("inf", "none")]
        assert got["skipped"] == want["skipped"] == 1, f"rank {rank}: skipped {got['skipped']}, {want['skipped']}"
        assert got["unchanged"] is True, f"rank {rank}: the skipped step changed a swap file"
        assert not math.isfinite(got["norms"][INF_STEP])
        finite = lambda r: {**r, "norms": r["norms"][:INF_STEP] + r["norms"][INF_STEP + 1:]}  # noqa: E731
        _assert_same(finite(got), finite(want), f"rank {rank} after the skip")


def test_a_missing_nvme_path_is_a_config_error_naming_the_key(runs):
    for rank, result in enumerate(runs):
        problems = result["missing_path"]
        assert problems is not None and len(problems) == 1, f"rank {rank}: {problems}"
        assert "swap directory does not exist" in problems[0]
        assert problems[0].endswith("fix zero_optimization.offload_optimizer.nvme_path")


def test_a_per_tensor_optimizer_is_refused_by_name(runs):
    for rank, result in enumerate(runs):
        assert result["lamb"] == ['zero_optimization.offload_optimizer.device: "nvme" with optimizer Lamb is not '
                                  'built yet (its trust ratio needs the norms of each whole tensor, and a swapped '
                                  'sub-group holds pieces of tensors); use offload_optimizer.device "cpu", or an '
                                  "elementwise optimizer (Adam, AdamW, SGD, Adagrad, Lion, or torch's ASGD, Adadelta, "
                                  'Adamax, NAdam, RAdam, RMSprop, Rprop)'], f"rank {rank}: {result['lamb']}"


def test_destroy_removes_the_swap_directory(runs):
    for rank, result in enumerate(runs):
        for key, got in result.items():
            if isinstance(key, tuple) and key[-1] == "nvme":
                assert got["swap_dir_left"] is False, f"rank {rank} {key}: swap directory left after destroy()"
        assert result["left_in_nvme_path"] == [], f"rank {rank}: {result['left_in_nvme_path']} left in nvme_path"
