"""ZeRO-Offload is a storage tier: with `offload_optimizer` / `offload_param` on "cpu" every step equals the
run without offload, bit for bit, at stages 1-3 (engine/zero/tier.py).

On a CPU-only machine an offloaded partition is already where the step runs, so the engine stages
nothing (offload costs nothing); these tests set DSTRAIN_OFFLOAD_STAGE_COPIES=1 so the accelerator's
path runs anyway: reduced gradient segments land in separate buffers, are copied to the host partition
and applied after backward, and updated weights are copied out again before the all-gather. One case
checks the unstaged path aliases (no staging buffers at all).

Oracles: 10 steps on 2 ranks of tests.models.ReuseNet (a head used in micro-step 0 only, transposed and
channels_last weights, a gradient in two pieces) with gradient accumulation 2. AdamW with clipping that
bites, and SGD without clipping (linear in the gradient, so a wrong scale moves the weights), compared
with torch.equal; gradient norms compared exactly. fp16/bf16 against the same precision without
offload. An Inf on one rank's loss skips the same step everywhere and leaves the offloaded master
weights and optimizer state bit for bit unchanged. Last, the seed's config (sample_configs/
zero3_offload.json: ZeRO-3, optimizer and parameters offloaded, fp16) trains the HF GPT-2 example.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import engine
from engine.utils import safe_get_full_fp32_param
from tests.harness import free_port, run_distributed
from tests.models import ReuseNet, make_batches, micro_batches

STEPS = 10
MICRO = 2
GAS = 2
INF_STEP = 4  # the step whose boundary micro-step gets an Inf loss on rank 1
OPTIMIZERS = {"adamw": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
              "sgd": {"type": "SGD", "params": {"lr": 0.2}}}


def _config(stage: int, optimizer: str, offload: dict, precision: str = "fp32") -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "gradient_clipping": 0.3 if optimizer == "adamw" else 0.0, "optimizer": OPTIMIZERS[optimizer],
           "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 700, "allgather_bucket_size": 900,
                                 "overlap_comm": True, "stage3_param_persistence_threshold": 30, **offload}}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


OPT_CPU = {"offload_optimizer": {"device": "cpu"}}
PARAM_CPU = {"offload_param": {"device": "cpu"}}
BOTH_CPU = {**OPT_CPU, **PARAM_CPU}


def _state_snapshot(zopt) -> list[torch.Tensor]:
    """Every tensor of this rank's offloaded state: master partitions and optimizer state."""
    out = [f.detach().clone() for f in zopt.partition.flat.values()]
    for flat in zopt.partition.flat.values():
        out += [v.clone() for _, v in sorted(zopt.optimizer.state.get(flat, {}).items()) if torch.is_tensor(v)]
    return out


def _train(stage: int, optimizer: str, offload: dict, precision: str = "fp32", inf: bool = False,
           zero_init: bool = False, meta: bool = False) -> dict:
    """`meta`: torch's default device is `meta` from the model's construction on, so any buffer the
    offload path makes without naming its device fails (as in test_device_discipline.py)."""
    try:
        return _train_on_default_device(stage, optimizer, offload, precision, inf, zero_init, meta)
    finally:
        torch.set_default_device("cpu")


def _train_on_default_device(stage, optimizer, offload, precision, inf, zero_init, meta) -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    cfg = _config(stage, optimizer, offload, precision)
    batches = make_batches(STEPS, MICRO * GAS * world)
    if zero_init:
        with engine.zero.Init(config=cfg, remote_device="cpu"):
            model = ReuseNet("reentrant")
    else:
        model = ReuseNet("reentrant")
    if meta:
        torch.set_default_device("meta")
    eng, _, _, _ = engine.initialize(model=model, config=cfg)
    dtype = next(eng.module.parameters()).dtype
    norms, unchanged = [], None
    for step, (x, y) in enumerate(batches):
        poison = inf and step == INF_STEP
        before = _state_snapshot(eng.zero_optimizer) if poison else None
        for k, (xm, ym) in enumerate(micro_batches(x.to(dtype), y.to(dtype), rank, world, GAS)):
            loss = eng(xm, ym, aux=k == 0)
            if poison and rank == 1 and k == GAS - 1:
                loss = loss * float("inf")
            eng.backward(loss)
            eng.step()
        if poison:
            after = _state_snapshot(eng.zero_optimizer)
            unchanged = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
        norms.append(eng.get_global_grad_norm())
    zopt = eng.zero_optimizer
    return {"params": {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters()},
            "norms": norms, "skipped": eng.skipped_steps, "unchanged": unchanged, "stage": zopt.stage,
            "home": str(zopt.tier.home), "staged": zopt.tier.staged,
            "flat_device": {str(f.device) for f in zopt.partition.flat.values()}}


FP32_CASES = {
    **{(stage, opt, name): (stage, opt, offload)
       for stage in (1, 2, 3) for opt in ("adamw", "sgd") for name, offload in (("none", {}), ("opt_cpu", OPT_CPU))},
    **{(3, opt, name): (3, opt, offload)
       for opt in ("adamw", "sgd") for name, offload in (("param_cpu", PARAM_CPU), ("both_cpu", BOTH_CPU))},
}
MIXED_CASES = {(precision, stage, name): (stage, "adamw", offload, precision)
               for precision in ("fp16", "bf16") for stage in (2, 3)
               for name, offload in (("none", {}), ("opt_cpu", OPT_CPU if stage < 3 else BOTH_CPU))}
INF_CASES = {("inf", precision, stage, name): (stage, "adamw", offload, precision, True)
             for precision, stage in (("fp16", 1), ("fp32", 3))
             for name, offload in (("none", {}), ("opt_cpu", OPT_CPU if stage < 3 else BOTH_CPU))}


def _all_cases() -> dict:
    os.environ["DSTRAIN_OFFLOAD_STAGE_COPIES"] = "1"
    out = {key: _train(*args) for key, args in {**FP32_CASES, **MIXED_CASES, **INF_CASES}.items()}
    out[("zero_init", "both_cpu")] = _train(3, "sgd", BOTH_CPU, zero_init=True)
    out[("meta", 2)] = _train(2, "sgd", OPT_CPU, meta=True)
    out[("meta", 3)] = _train(3, "sgd", BOTH_CPU, meta=True)
    os.environ["DSTRAIN_OFFLOAD_STAGE_COPIES"] = "0"  # a CPU-only machine's own path: nothing staged
    out[("unstaged", "opt_cpu")] = _train(2, "sgd", OPT_CPU)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all_cases, 2, timeout=300)


def _assert_same(got: dict, want: dict, what: str) -> None:
    for name, w in want["params"].items():
        g = got["params"][name]
        assert torch.equal(g, w), f"{what} {name}: max |diff| {(g - w).abs().max().item():.3e}"
    assert got["norms"] == want["norms"], f"{what}: gradient norms {got['norms']} != {want['norms']}"


@pytest.mark.parametrize("key", [k for k in FP32_CASES if k[2] != "none"], ids=lambda k: "-".join(map(str, k)))
def test_fp32_offload_equals_no_offload_bit_for_bit(runs, key):
    stage, opt, _ = key
    for rank, result in enumerate(runs):
        got, want = result[key], result[(stage, opt, "none")]
        assert got["stage"] == stage and got["home"] == "cpu" and got["staged"], f"rank {rank}: {got['home']}"
        assert got["skipped"] == 0
        _assert_same(got, want, f"rank {rank} {key}")


@pytest.mark.parametrize("key", [k for k in MIXED_CASES if k[2] != "none"], ids=lambda k: "-".join(map(str, k)))
def test_16bit_offload_equals_no_offload_in_the_same_precision(runs, key):
    precision, stage, _ = key
    for rank, result in enumerate(runs):
        _assert_same(result[key], result[(precision, stage, "none")], f"rank {rank} {key}")


@pytest.mark.parametrize("precision,stage", [("fp16", 1), ("fp32", 3)])
def test_inf_on_one_rank_skips_the_step_and_leaves_offloaded_state_unchanged(runs, precision, stage):
    for rank, result in enumerate(runs):
        got = result[("inf", precision, stage, "opt_cpu")]
        want = result[("inf", precision, stage, "none")]
        assert got["skipped"] == want["skipped"] == 1, f"rank {rank}: skipped {got['skipped']}, {want['skipped']}"
        assert got["unchanged"] is True, f"rank {rank}: the skipped step changed the offloaded state"
        assert not math.isfinite(got["norms"][INF_STEP])  # the step saw the Inf
        got_norms = got["norms"][:INF_STEP] + got["norms"][INF_STEP + 1:]
        want_norms = want["norms"][:INF_STEP] + want["norms"][INF_STEP + 1:]
        assert got_norms == want_norms
        _assert_same({**got, "norms": []}, {**want, "norms": []}, f"rank {rank}")


def test_zero_init_remote_device_cpu_builds_the_partition_on_the_host(runs):
    for rank, result in enumerate(runs):
        got = result[("zero_init", "both_cpu")]
        assert got["flat_device"] == {"cpu"} and got["home"] == "cpu"
        _assert_same(got, result[(3, "sgd", "none")], f"rank {rank} zero.Init(remote_device='cpu')")


def test_cpu_only_offload_stages_nothing(runs):
    for rank, result in enumerate(runs):
        got = result[("unstaged", "opt_cpu")]
        assert got["staged"] is False, f"rank {rank}: a CPU-only run staged copies"
        _assert_same(got, result[(2, "sgd", "none")], f"rank {rank} unstaged")


def test_the_seed_config_trains_the_hf_gpt2_example_on_two_ranks():
    repo = Path(__file__).resolve().parents[1]
    dslaunch = Path(sys.executable).with_name("dslaunch")
    result = subprocess.run([str(dslaunch), "--num_gpus", "2", "--master_port", str(free_port()),
                             "examples/train_hf_gpt2.py", "--fp16", "--steps", "4",
                             "--deepspeed_config", "sample_configs/zero3_offload.json"],
                            cwd=repo, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = re.search(r"steps (\d+)  loss ([\d.]+) -> ([\d.]+) .* zero stage 3", result.stdout + result.stderr)
    assert summary and int(summary.group(1)) == 4, result.stdout[-3000:]
    assert float(summary.group(3)) < float(summary.group(2))  # random init: ln 256 ≈ 5.5, learning from there


@pytest.mark.parametrize("stage", [2, 3])
def test_every_offload_buffer_names_its_device(runs, stage):
    for rank, result in enumerate(runs):
        _assert_same(result[("meta", stage)], result[(stage, "sgd", "none")], f"rank {rank} meta default device")
