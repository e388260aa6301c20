"""ZeRO-Offload is a storage tier: with `offload_optimizer` / `offload_param` on "cpu" every step equals the
run without offload, bit for bit, at stages 1-3 (engine/zero/tier.py).

On a CPU-only machine an offloaded partition is already where the step runs, so the engine stages
nothing (offload costs nothing); these tests set DSTRAIN_OFFLOAD_STAGE_COPIES=1 so the accelerator's
path runs anyway: reduced gradient segments land in separate buffers, are copied to the host partition
and applied after backward, and updated weights are copied out again before the all-gather. One case
checks the unstaged path aliases (no staging buffers at all).

Oracles: 10 steps on 2 ranks of tests.models.ReuseNet (a head used in micro-step 0 only, transposed and
channels_last weights, a gradient in two pieces) with gradient accumulation 2 and a WarmupLR schedule.
AdamW with clipping that bites, and SGD without clipping (linear in the gradient, so a wrong scale moves
the weights), compared with torch.equal; gradient norms compared exactly. The runs are
tests/offload_runs.py's, one spawn shared with tests/test_offload_nvme.py. fp16/bf16 against the same precision without
offload. An Inf on one rank's loss skips the same step everywhere and leaves the offloaded master
weights and optimizer state bit for bit unchanged. Last, the seed's config (sample_configs/
zero3_offload.json: ZeRO-3, optimizer and parameters offloaded, fp16) trains the HF GPT-2 example
(examples/train_hf_gpt2.py's main, on the same two ranks; dslaunch itself is tests/test_launcher_*.py's).
"""
from __future__ import annotations

import math
import re

import pytest

from tests.offload_runs import FP32_CASES, INF_STEP, MIXED_CASES, NVME, assert_same as _assert_same, shared_runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return shared_runs(tmp_path_factory)


@pytest.mark.parametrize("key", [k for k in FP32_CASES if k[2] not in ("none", NVME)], ids=lambda k: "-".join(map(str, k)))
def test_fp32_offload_equals_no_offload_bit_for_bit(runs, key):
    stage, opt, _ = key
    for rank, result in enumerate(runs):
        got, want = result[key], result[(stage, opt, "none")]
        assert got["stage"] == stage and got["home"] == "cpu" and got["staged"], f"rank {rank}: {got['home']}"
        assert got["skipped"] == 0
        _assert_same(got, want, f"rank {rank} {key}")


@pytest.mark.parametrize("key", [k for k in MIXED_CASES if k[2] not in ("none", NVME)], ids=lambda k: "-".join(map(str, k)))
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


def test_the_seed_config_trains_the_hf_gpt2_example_on_two_ranks(runs):
    for rank, result in enumerate(runs):
        got = result["hf_gpt2"]
        assert got["code"] == 0, f"rank {rank}: {got['printed'][-3000:]}"
    printed = runs[0]["hf_gpt2"]["printed"]  # rank 0 prints the summary
    summary = re.search(r"steps (\d+)  loss ([\d.]+) -> ([\d.]+) .* zero stage 3", printed)
    assert summary and int(summary.group(1)) == 4, printed[-3000:]
    assert float(summary.group(3)) < float(summary.group(2))  # random init: ln 256 ≈ 5.5, learning from there


@pytest.mark.parametrize("stage", [2, 3])
def test_every_offload_buffer_names_its_device(runs, stage):
    for rank, result in enumerate(runs):
        _assert_same(result[("meta", stage)], result[(stage, "sgd", "none")], f"rank {rank} meta default device")
