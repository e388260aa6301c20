"""NVMe optimizer offload at stages 1, 2 and 3 (engine/zero/nvme_tier.py) is a storage tier: every step
equals the run without offload bit for bit, with the fp32 master weights and optimizer state in swap files.

Oracles: 10 steps on 2 ranks of tests.models.ReuseNet with gradient accumulation 2, AdamW with clipping
that bites and SGD without clipping (linear in the gradient: a wrong gradient scale moves the weights),
both under a WarmupLR schedule (the swapped step must see every new learning rate), compared with
torch.equal, gradient norms compared exactly. `sub_group_size` 100 (rounded up to 128, nvme_tier.py's
lanes note) divides no partition (asserted), so every step has a short last sub-group; AdamW runs with
pipelined reads and writes. fp16 (loss scale 2^8, unscaled on the host) and bf16 at stage 2 equal the
run without offload in the same precision. An Inf on one rank's loss skips the step and leaves the
swap files' SHA-256 unchanged (stages 2 and 3); a stage-3 checkpoint saved at step 5 with the optimizer
on NVMe and the parameters on the host loads into a fresh such
engine, which then trains on equal to the run without offload never stopped; `destroy()` removes the swap directory; a missing `nvme_path` is one
ConfigError line naming the key. `offload_optimizer.fast_init` (no swap file written at initialisation)
trains bit for bit as without it (stage 2 SGD, stage 3 AdamW). Copies are staged (DSTRAIN_OFFLOAD_STAGE_COPIES=1) as on an accelerator.
The runs are tests/offload_runs.py's, one spawn shared with tests/test_offload_parity.py (the same
references without offload).
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.offload_runs import (BOTH_NVME, FAST_INIT_CASES, FOLD_CASES, GRAD_MEMORY_CASES, INF_STEP, NVME, NVME_FOLD,
                                NVME_GRAD_MEMORY, ONE_SLOT_CASES, RESUME_AT, STEPS, assert_same as _assert_same,
                                shared_runs)

CASES = [(stage, opt) for stage in (1, 2, 3) for opt in ("sgd", "adamw")]
INF_STAGES = (1, 2, 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return shared_runs(tmp_path_factory)


@pytest.mark.parametrize("stage,opt", CASES, ids=lambda v: str(v))
def test_nvme_offload_equals_no_offload_bit_for_bit(runs, stage, opt):
    for rank, result in enumerate(runs):
        got = result[(stage, opt, NVME)]
        assert all(len(g) > 1 and g[-1][1] - g[-1][0] < g[0][1] - g[0][0] == 128 for g in got["sub_groups"])
        assert got["state_in_memory"] == 0, f"rank {rank}: optimizer state was built in memory"
        assert got["swap_files"] > 0 and got["skipped"] == 0
        _assert_gradient_swapped(got, stage, f"rank {rank} stage {stage} {opt}")
        assert got["grad_swap"]["read_ahead"] == (opt == "adamw")  # offload_runs: AdamW's runs pipeline_read
        _assert_same(got, result[(stage, opt, "none")], f"rank {rank} stage {stage} {opt}")


def _finite(run: dict) -> dict:
    """The run with the Inf step's norm left out (the other steps' norms compare exactly)."""
    return {**run, "norms": run["norms"][:INF_STEP] + run["norms"][INF_STEP + 1:]}


def _assert_gradient_swapped(got: dict, stage: int, what: str) -> None:
    """The partition gradient was in swap files (engine/zero/grad_swap.py), none of it in host memory:
    10 steps of 2 micro-steps landed there (stages 2-3 every micro-step, read-add-write after the first;
    stage 1 at the boundary) and the norm and the stepper read it back."""
    swap = got["grad_swap"]
    assert swap is not None and got["grad_host_bytes"] == 0, f"{what}: gradient partition in host memory ({swap})"
    # per step, P the partition's bytes: stage 1 writes P and reads it twice (the norm, the stepper);
    # stages 2-3 write 2P (each micro-step) and read 3P (the second landing's read-add-write, then both)
    assert swap["written"] > 0 and swap["read"] * (2 if stage > 1 else 1) == swap["written"] * (3 if stage > 1 else 2), \
        f"{what}: {swap}"
    assert swap["held"] == (stage > 1), f"{what}: held gradients in a file {swap['held']} (stage 1 keeps .grad)"
    # with pipeline_read the stepper's sub-groups (several per partition here) came from reads started
    # one call ahead, without it none did
    assert (swap["reads_ahead_used"] > 0) == swap["read_ahead"], f"{what}: gradient read-ahead ({swap})"
    # the first backward held every gradient in the file; emptied, the file is gone (its disk given back)
    assert (swap["held_files_made"] >= 1) == (stage > 1) and not swap["held_file_left"], f"{what}: {swap}"


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_16bit_nvme_offload_equals_no_offload_in_the_same_precision(runs, precision):
    for rank, result in enumerate(runs):
        got = result[(precision, 2, NVME)]
        # the host keeps the send image in 16 bits and no fp32 flat (partition_store.py's note: 16-bit
        # send image): the master the step, the norm and the final weights come from is the tier's
        store = got["store"]
        assert store["kind"] == "HalfImageStore" and store["flat_bytes"] == 0, store
        assert store["resident_bytes"] == 2 * store["partition_numel"], store
        _assert_same(got, result[(precision, 2, "none")], f"rank {rank} {precision}")
    assert runs[0][(2, "adamw", NVME)]["store"]["kind"] == "TierMasterStore"  # fp32: the flat is the image


@pytest.mark.parametrize("name", [f"{NVME}->none", f"none->{NVME}"])
def test_bf16_checkpoints_move_between_the_16bit_send_image_and_no_offload(runs, name):
    # saved: the fp32 rows stream from the optimizer's files; loaded: written there, cast into the image
    for rank, result in enumerate(runs):
        got = result[("resume", "bf16", 2, name)]
        if name.endswith(NVME):
            assert got["store"]["kind"] == "HalfImageStore", got["store"]
        _assert_same(got, result[("bf16", 2, "none")], f"rank {rank} bf16 stage 2 resumed {name}")


def _training_state_round_trip(nvme_path: str) -> dict:
    """bf16, stage 2, optimizer on NVMe: engine A trains 3 steps; B, built from other weights, loads A's
    `training_state_dict()` (the master written to B's optimizer files and its send image); both train
    3 more. Returns both runs' final weights and norms."""
    import engine
    from engine.utils import safe_get_full_fp32_param
    from tests.models import make_batches, micro_batches
    from tests.offload_runs import GAS, MICRO, ReuseNet, config
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batches = make_batches(6, MICRO * GAS * world)

    def run(eng, steps):
        norms = []
        for x, y in steps:
            for xm, ym in micro_batches(x.bfloat16(), y.bfloat16(), rank, world, GAS):
                eng.backward(eng(xm, ym))
                eng.step()
            norms.append(eng.get_global_grad_norm())
        return norms
    engines = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        engines.append(engine.initialize(model=ReuseNet("reentrant"), config=config(2, "adamw", NVME, "bf16", nvme_path))[0])
    a, b = engines
    run(a, batches[:3])
    b.load_training_state_dict(a.training_state_dict())
    out = {"kind": type(b.zero_optimizer.partition.store).__name__}
    for name, eng in (("a", a), ("b", b)):
        out[name] = {"norms": run(eng, batches[3:]),
                     "params": {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters()}}
        eng.destroy()
    return out


def test_bf16_training_state_dict_loads_into_the_optimizer_files_and_the_16bit_send_image(tmp_path):
    from tests.harness import run_distributed
    for rank, result in enumerate(run_distributed(_training_state_round_trip, 2, args=(str(tmp_path),), timeout=120)):
        assert result["kind"] == "HalfImageStore", result["kind"]
        assert result["a"]["norms"] == result["b"]["norms"], (rank, result["a"]["norms"], result["b"]["norms"])
        for name, want in result["a"]["params"].items():
            got = result["b"]["params"][name]
            assert torch.equal(got, want), f"rank {rank} {name}: max |diff| {(got - want).abs().max().item():.3e}"


@pytest.mark.parametrize("precision,stage,name", [("fp32", stage, NVME) for stage in INF_STAGES]
                         + [("fp16", 2, NVME), ("fp16", 3, BOTH_NVME)], ids=lambda v: str(v))
def test_inf_on_one_rank_skips_and_leaves_the_swap_files_unchanged(runs, precision, stage, name):
    """fp16: the overflow skip leaves the 16-bit state unchanged too, stage 2's send image in host memory
    and stage 3's parameter files (with the master in the optimizer's files)."""
    for rank, result in enumerate(runs):
        got, want = result[("inf", precision, stage, name)], result[("inf", precision, stage, "none")]
        if precision == "fp16":  # the 16-bit state this case is about exists
            kind = got["store"]["kind"] if stage == 2 else got["param_store"]["file_dtype"]
            assert kind == ("HalfImageStore" if stage == 2 else "torch.float16"), f"rank {rank}: {kind}"
        assert got["skipped"] == want["skipped"] == 1, f"rank {rank}: skipped {got['skipped']}, {want['skipped']}"
        assert got["unchanged"] is True, f"rank {rank}: the skipped step changed a swap file"
        assert not math.isfinite(got["norms"][INF_STEP])
        _assert_same(_finite(got), _finite(want), f"rank {rank} after the skip")


def test_a_stage3_nvme_checkpoint_resumes_into_nvme_offload_exactly(runs):
    for rank, result in enumerate(runs):
        got = result[("resume", 3, NVME)]
        assert got["state_in_memory"] == 0 and got["swap_files"] > 0
        _assert_same(got, result[(3, "adamw", "none")], f"rank {rank} resumed at step {RESUME_AT}")


def test_a_missing_nvme_path_is_a_config_error_naming_the_key(runs):
    for rank, result in enumerate(runs):
        problems = result["missing_path"]
        assert problems is not None and len(problems) == 1, f"rank {rank}: {problems}"
        assert "swap directory does not exist" in problems[0]
        assert problems[0].endswith("fix zero_optimization.offload_optimizer.nvme_path")


def test_destroy_removes_the_swap_directory(runs):
    for rank, result in enumerate(runs):
        for key, got in result.items():
            if isinstance(key, tuple) and key[-1] == NVME:
                assert got["swap_dir_left"] is False, f"rank {rank} {key}: swap directory left after destroy()"
        assert result["left_in_nvme_path"] == [], f"rank {rank}: {result['left_in_nvme_path']} left in nvme_path"


@pytest.mark.parametrize("key", list(ONE_SLOT_CASES), ids=lambda k: f"stage{k[0]}-{k[1]}")
def test_one_swap_slot_halves_the_state_files_and_trains_the_same(runs, key):
    stage, opt, _ = key
    for rank, result in enumerate(runs):
        one, two = result[key], result[(stage, opt, NVME)]
        assert 0 < 2 * one["state_file_bytes"] == two["state_file_bytes"], \
            f"rank {rank}: state files {one['state_file_bytes']} bytes with one slot, {two['state_file_bytes']} with two"
        _assert_gradient_swapped(one, stage, f"rank {rank} stage {stage} {opt} one slot")
        _assert_same(one, two, f"rank {rank} stage {stage} {opt} one slot vs two")
        _assert_same(one, result[(stage, opt, "none")], f"rank {rank} stage {stage} {opt} one slot vs no offload")


@pytest.mark.parametrize("key", list(FAST_INIT_CASES), ids=lambda k: f"stage{k[0]}-{k[1]}")
def test_fast_init_writes_nothing_at_initialisation_and_trains_the_same(runs, key):
    stage, opt, _ = key
    for rank, result in enumerate(runs):
        fast, written = result[key], result[(stage, opt, NVME)]
        assert fast["swap_files_at_init"] == 0 < written["swap_files_at_init"], \
            f"rank {rank}: swap files at initialisation {fast['swap_files_at_init']} / {written['swap_files_at_init']}"
        assert fast["swap_files"] == written["swap_files"] > 0 and fast["state_in_memory"] == 0
        _assert_same(fast, written, f"rank {rank} stage {stage} {opt} fast_init vs not")
        _assert_same(fast, result[(stage, opt, "none")], f"rank {rank} stage {stage} {opt} fast_init vs no offload")


@pytest.mark.parametrize("key", [k for k in GRAD_MEMORY_CASES if k[0] != "inf"], ids=lambda k: f"stage{k[0]}-{k[1]}")
def test_the_gradient_in_host_memory_by_default_equals_no_offload_bit_for_bit(runs, key):
    """`offload_optimizer.swap_gradients` unset with the parameters in memory: the state in swap files,
    the gradient partition in host memory (engine/zero/grad_swap.py's note: when), where the step
    unscales and clips it before the stepper reads it."""
    stage, opt, _ = key
    for rank, result in enumerate(runs):
        got = result[key]
        assert got["grad_swap"] is None and got["grad_host_bytes"] > 0, f"rank {rank}: {got['grad_swap']}"
        assert got["state_in_memory"] == 0 and got["swap_files"] > 0 and got["skipped"] == 0
        _assert_same(got, result[(stage, opt, "none")], f"rank {rank} stage {stage} {opt} gradient in memory")


def test_an_inf_with_the_gradient_in_host_memory_skips_and_leaves_the_swap_files_unchanged(runs):
    for rank, result in enumerate(runs):
        got, want = result[("inf", "fp32", 2, NVME_GRAD_MEMORY)], result[("inf", "fp32", 2, "none")]
        assert got["grad_swap"] is None and got["skipped"] == want["skipped"] == 1 and got["unchanged"] is True
        _assert_same(_finite(got), _finite(want), f"rank {rank} after the skip")


@pytest.mark.parametrize("key", [k for k in FOLD_CASES if k[0] != "inf"], ids=lambda k: "-".join(map(str, k[:2])))
def test_a_norm_folded_into_the_landings_reads_the_gradient_once_per_step_and_trains_the_same(runs, key):
    """One gradient bucket per flat: every landing writes whole norm ranges, whose squares the step then
    takes from the landing (grad_swap.py's note: folded norm) instead of reading the file for them; the
    norms and weights equal the run without offload bit for bit (fp16: with the loss scale's unscale)."""
    for rank, result in enumerate(runs):
        got = result[key]
        stage = got["stage"]
        want = result[(key[0], 2, "none")] if key[0] == "fp16" else result[(stage, key[1], "none")]
        swap = got["grad_swap"]
        assert swap["norm_ranges_folded"] >= STEPS, f"rank {rank}: {swap}"
        # per step, P the partition's bytes: stage 1 writes P and reads it once (the stepper); stages 2-3
        # write 2P and read 2P (the second landing's read-add-write, the stepper): no read for the norm
        assert swap["read"] == swap["written"], f"rank {rank} {key}: {swap}"
        _assert_same(got, want, f"rank {rank} {key} folded norm")


def test_an_inf_with_a_folded_norm_skips_on_every_rank(runs):
    for rank, result in enumerate(runs):
        got, want = result[("inf", "fp32", 3, NVME_FOLD)], result[("inf", "fp32", 3, "none")]
        assert got["grad_swap"]["norm_ranges_folded"] > 0 and got["skipped"] == want["skipped"] == 1
        assert got["unchanged"] is True and not math.isfinite(got["norms"][INF_STEP])
        _assert_same(_finite(got), _finite(want), f"rank {rank} after the skip")


def _per_tensor_bf16(nvme_path: str) -> dict:
    """Lamb and Muon (two passes over the swapped sub-groups, nvme_per_tensor.py) in bf16 at stage 2:
    without offload and with the optimizer on NVMe (the 16-bit send image)."""
    import engine
    from engine.utils import safe_get_full_fp32_param
    from tests.models import make_batches, micro_batches
    from tests.test_optimizer_set import MICRO, Net, _config
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    for kind in ("Lamb", "Muon"):
        for offload in ("none", "nvme"):
            torch.manual_seed(0)
            cfg = {**_config(kind, 2, 2, offload, nvme_path), "bf16": {"enabled": True}}
            eng = engine.initialize(model=Net(), config=cfg)[0]
            norms = []
            for x, y in make_batches(4, MICRO * 2 * world):
                for xm, ym in micro_batches(x.bfloat16(), y.bfloat16(), rank, world, 2):
                    eng.backward(eng(xm, ym))
                    eng.step()
                norms.append(eng.get_global_grad_norm())
            out[kind, offload] = {"norms": norms, "kind": type(eng.zero_optimizer.partition.store).__name__,
                                  "params": {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters()}}
            eng.destroy()
    return out


def test_lamb_and_muon_in_bf16_step_the_16bit_send_image_equal_to_no_offload(tmp_path):
    from tests.harness import run_distributed
    for rank, result in enumerate(run_distributed(_per_tensor_bf16, 2, args=(str(tmp_path),), timeout=120)):
        for kind in ("Lamb", "Muon"):
            got, want = result[kind, "nvme"], result[kind, "none"]
            assert got["kind"] == "HalfImageStore" and got["norms"] == want["norms"], (rank, kind, got["norms"], want["norms"])
            for name, w in want["params"].items():
                g = got["params"][name]
                assert torch.equal(g, w), f"rank {rank} {kind} {name}: max |diff| {(g - w).abs().max().item():.3e}"


def _uncorrected_adam(nvme_path: str) -> dict:
    """DeepSpeed's `"Adam"` with `bias_correction: false` (ops.UncorrectedAdam) at stage 2, 4 steps, without
    offload and with the optimizer on NVMe."""
    import engine
    from engine.utils import safe_get_full_fp32_param
    from tests.models import make_batches, micro_batches
    from tests.offload_runs import GAS, MICRO, ReuseNet, config
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    for name in ("none", NVME):
        torch.manual_seed(0)
        cfg = config(2, "adamw", {} if name == "none" else name, "fp32", nvme_path)
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 0.01, "bias_correction": False, "weight_decay": 0.01}}
        eng = engine.initialize(model=ReuseNet(), config=cfg)[0]
        norms = []
        for x, y in make_batches(4, MICRO * GAS * world):
            for xm, ym in micro_batches(x, y, rank, world, GAS):
                eng.backward(eng(xm, ym))
                eng.step()
            norms.append(eng.get_global_grad_norm())
        out[name] = {"kind": type(eng.optimizer).__name__, "norms": norms,
                     "params": {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters()}}
        eng.destroy()
    return out


def test_adam_without_bias_correction_steps_swapped_equal_to_no_offload(tmp_path):
    from tests.harness import run_distributed
    for rank, result in enumerate(run_distributed(_uncorrected_adam, 2, args=(str(tmp_path),), timeout=120)):
        assert result[NVME]["kind"] == "UncorrectedAdam" and result[NVME]["norms"] == result["none"]["norms"]
        for name, want in result["none"]["params"].items():
            got = result[NVME]["params"][name]
            assert torch.equal(got, want), f"rank {rank} {name}: max |diff| {(got - want).abs().max().item():.3e}"


def _failed_step(nvme_path: str) -> dict:
    """2 AdamW steps, then a step whose third sub-group's gradient read raises (as a disk error would),
    then 2 more steps, against the same 4 good steps without NVMe (the failed step's batch dropped): the
    master reads between the failure and the next step (checkpoints, safe_get_*) and the run after it."""
    from engine.utils import safe_get_full_fp32_param
    from tests.models import OddMLP, make_batches, micro_batches
    import engine
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    for name in ("none", "nvme"):
        zero = {"stage": 2} if name == "none" else {
            "stage": 2, "sub_group_size": 64, "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}}
        torch.manual_seed(0)
        eng = engine.initialize(model=OddMLP(), config={
            "train_batch_size": 4 * world, "gradient_clipping": 0.0, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}}})[0]
        params = lambda: {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters() if p.requires_grad}
        batches = make_batches(5, 4 * world)
        for i, (x, y) in enumerate(batches):
            if name == "none" and i == 2:  # a failed step drops its window's gradients (partitioned.py's note)
                continue
            (xm, ym), = micro_batches(x, y, rank, world, 1)
            loss = eng(xm, ym)
            eng.backward(loss)
            if i != 2:
                eng.step()
                continue
            if name == "nvme":
                tier, reader = eng.zero_optimizer.nvme, eng.zero_optimizer.nvme.grad_reader
                before = params()

                def failing(key, read=reader):
                    good = read(key)
                    return lambda s, e: good(s, e) if s < 128 else (_ for _ in ()).throw(OSError("disk gone"))
                tier.grad_reader = failing
                try:
                    eng.step()
                except OSError as err:
                    out["error"] = str(err)
                tier.grad_reader = reader
                out["after_failure"], out["before"] = params(), before
            eng.zero_grad()
        out[name] = params()
        eng.destroy()
    return out


def test_a_step_that_fails_halfway_leaves_the_committed_master_everywhere(tmp_path):
    """The swap files keep the previous state (two slots); what the gathers and checkpoints read (the host
    flat) must too, or a checkpoint saved after the failure holds half-stepped weights with the old moments."""
    from tests.harness import run_distributed
    for rank, result in enumerate(run_distributed(_failed_step, 2, args=(str(tmp_path),), timeout=120)):
        assert result["error"] == "disk gone", result.get("error")
        for n, want in result["before"].items():
            assert torch.equal(result["after_failure"][n], want), f"rank {rank} {n}: changed by the failed step"
        for n, want in result["none"].items():
            assert torch.equal(result["nvme"][n], want), f"rank {rank} {n}: the run after the failure differs"
