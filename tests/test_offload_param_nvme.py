"""NVMe parameter offload at ZeRO stage 3 (`offload_param.device: "nvme"`, engine/zero/param_nvme.py,
offload/param_swap.py) is a storage tier: every step equals stage 3 without offload bit for bit.

Oracles: 10 steps on 2 ranks of tests.models.ReuseNet with gradient accumulation 2, AdamW with clipping
that bites and SGD without clipping (linear in the gradient: a wrong gradient scale moves the weights),
under a WarmupLR schedule, compared with torch.equal, gradient norms compared exactly; the optimizer
on the host and on NVMe. The final weights come from `safe_get_full_fp32_param`, which reads the
partition through the store (the swap files when the optimizer is on NVMe). `max_in_cpu` 600 keeps
two of tests.models.StackNet's layers resident and reads the rest from the files on every gather (read
ahead of use by the prefetcher); ReuseNet's one group is read from the files every time. An Inf on
one rank skips the step with every swap file's SHA-256 unchanged. Resident parameter bytes stay
within max_in_cpu * 4 + the pool, by the store's count and by the storages that exist after every
micro-step, and with the optimizer on NVMe the host flat holds no bytes; there, in fp32, the gathers
read the optimizer's master file and no step writes a parameter byte, and with 16-bit files each
sub-group's write-back is left in flight while the next one steps, none after a step. Checkpoints: saved with
parameters (and optimizer) on NVMe, loaded without offload, and the other way round, both runs
continue equal to the run never stopped. A frozen layer's chunks are in a chunk file with parameters on
NVMe (engine/zero/stage3_frozen.py): trained equal, and moved by checkpoints both ways. The swap
directories are gone after `destroy()`. The runs are
tests/offload_runs.py's, in the one 2-rank spawn test_offload_parity.py and test_offload_nvme.py share.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.offload_runs import (BOTH_NVME, BOTH_NVME_FAST, BOTH_NVME_KEPT, BOTH_NVME_RESIDENT, INF_STEP, NVME, NVME_FAST, PARAM_NVME,
                                PARAM_NVME_CASES, STEPS, assert_same as _assert_same, shared_runs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return shared_runs(tmp_path_factory)


@pytest.mark.parametrize("key", [k for k in PARAM_NVME_CASES if k[0] == 3], ids=lambda k: "-".join(map(str, k)))
def test_param_nvme_equals_stage3_without_offload_bit_for_bit(runs, key):
    _, opt, name = key
    for rank, result in enumerate(runs):
        got = result[key]
        store = got["param_store"]
        assert got["skipped"] == 0 and store["read"] > 0 and store["written"] > 0, f"rank {rank}: {store}"
        assert store["master_in_memory"] is (name == PARAM_NVME)
        if name == BOTH_NVME_RESIDENT:
            _assert_written_back_only(got, f"rank {rank}")
        elif name == PARAM_NVME:  # ReuseNet's one group is never resident: every step writes it
            assert store["written"] > store["written_at_build"], f"rank {rank}: {store}"
        if name == BOTH_NVME:
            assert store["partition_bytes"] == 0, f"rank {rank}: the host flat still holds bytes"
            # fp32 files would hold the optimizer's master byte for byte: the gathers read it from the
            # optimizer's files and no step writes a parameter byte (offload/param_swap.py's note: the
            # master's file)
            assert store["written"] == store["written_at_build"] and store["writes_behind"] == 0, f"rank {rank}: {store}"
            # offload_optimizer.swap_gradients unset: with the parameters on NVMe the gradient is swapped too
            assert got["grad_swap"] is not None and got["grad_host_bytes"] == 0, f"rank {rank}: {got['grad_swap']}"
        assert not store["dir_left"], f"rank {rank}: the parameter swap directory was left"
        _assert_same(got, result[(3, opt, "none")], f"rank {rank} {key}")


def _assert_written_back_only(got: dict, what: str) -> None:
    """Every slot resident (max_in_cpu 1e9): no step wrote a parameter byte to the files (offload/
    param_swap.py's note: write-back), and the unset swap_gradients kept the gradient in host memory."""
    store = got["param_store"]
    assert store["written"] == store["written_at_build"] and store["writes_behind"] == 0, f"{what}: {store}"
    assert got["grad_swap"] is None and got["grad_host_bytes"] > 0, f"{what}: the gradient was swapped"


def test_resident_parameters_train_equal_with_no_parameter_write_after_initialisation(runs):
    for rank, result in enumerate(runs):
        got = result[("stack", BOTH_NVME_RESIDENT)]
        _assert_written_back_only(got, f"rank {rank}")
        _assert_same(got, result[("stack", "none")], f"rank {rank} StackNet resident")


def test_resident_parameter_bytes_stay_within_max_in_cpu_and_the_pool(runs):
    for rank, result in enumerate(runs):
        for key in [k for k in PARAM_NVME_CASES if k[0] == 3] + [("stack", BOTH_NVME)]:
            store = result[key]["param_store"]
            assert store["measured"], key
            assert store["accounted_peak"] <= store["bound"], f"rank {rank} {key}: {store}"
            assert max(store["measured"]) <= store["bound"], f"rank {rank} {key}: {store}"


def test_a_prefetched_multi_group_model_trains_equal_with_some_groups_read_from_disk(runs):
    for rank, result in enumerate(runs):
        got, want = result[("stack", BOTH_NVME)], result[("stack", "none")]
        store = got["param_store"]
        # resident slots: some, but not all (the bound is max_in_cpu): later gathers read the files
        assert store["pool"] < max(store["measured"]) <= store["bound"], f"rank {rank}: {store}"
        assert store["read"] > 10 * 4 * 288, f"rank {rank}: too few bytes read for per-step reads: {store}"
        assert store["reads_ahead"] >= STEPS, f"rank {rank}: the prefetcher read no group ahead: {store}"
        # the backward's first groups are the forward's last, still in their buffers (param_swap.py's note:
        # kept buffers), across steps that wrote new values into them: _assert_same below
        assert store["kept_hits"] > 0, f"rank {rank}: no gather found its group kept: {store}"
        _assert_same(got, want, f"rank {rank} StackNet")
        # one read spanning resident and unresident slots (offload/param_swap.py's note: write-back)
        assert all(torch.equal(g, w) for g, w in zip(got["partition"], want["partition"], strict=True)), f"rank {rank}"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_groups_kept_in_their_buffers_are_read_once_and_train_equal(runs, precision):
    # offload/param_swap.py's note (kept buffers): every step writes new values into the buffers, and the
    # gathers after the first read them there, not the files
    for rank, result in enumerate(runs):
        got = result[("stack", BOTH_NVME_KEPT) if precision == "fp32" else ("stack", "bf16", BOTH_NVME_KEPT)]
        store = got["param_store"]
        # each group read from the files once (4 of them 2 * STEPS times without the kept buffers)
        assert store["reads_at_gather"] + store["reads_ahead"] <= store["groups"], f"rank {rank} {precision}: {store}"
        assert store["kept_hits"] >= 2 * STEPS * 4, f"rank {rank} {precision}: {store}"
        # fp32 files hold the committed master, so the optimizer copies it from them instead of reading its
        # file (swapped_partition.py's note: master copy); 16-bit files do not hold it
        copied = got["masters_copied"]
        assert copied >= STEPS - 1 if precision == "fp32" else copied == 0, f"rank {rank} {precision}: {copied}"
        _assert_same(got, result[("stack", precision, "none") if precision == "bf16" else ("stack", "none")],
                     f"rank {rank} {precision} kept buffers")


@pytest.mark.parametrize("name", [BOTH_NVME, BOTH_NVME_RESIDENT])
def test_inf_on_one_rank_skips_and_leaves_every_swap_file_unchanged(runs, name):
    for rank, result in enumerate(runs):
        got, want = result[("inf", "fp32", 3, name)], result[("inf", "fp32", 3, "none")]
        assert got["skipped"] == want["skipped"] == 1
        assert got["unchanged"] is True, f"rank {rank}: the skipped step changed a swap file"
        assert not math.isfinite(got["norms"][INF_STEP])
        finite = lambda r: {**r, "norms": r["norms"][:INF_STEP] + r["norms"][INF_STEP + 1:]}  # noqa: E731
        _assert_same(finite(got), finite(want), f"rank {rank} after the skip")


@pytest.mark.parametrize("name", [f"{BOTH_NVME}->none", f"none->{BOTH_NVME}", f"{PARAM_NVME}->{PARAM_NVME}",
                                  f"{BOTH_NVME_RESIDENT}->none"])
def test_checkpoints_move_between_param_nvme_and_no_offload(runs, name):
    for rank, result in enumerate(runs):
        _assert_same(result[("resume", 3, name)], result[(3, "adamw", "none")], f"rank {rank} resumed {name}")


@pytest.mark.parametrize("name", [f"{BOTH_NVME}->none", f"none->{BOTH_NVME}"])
def test_checkpoints_of_partly_resident_parameters_move_to_and_from_no_offload(runs, name):
    # StackNet keeps two layers' slots resident, the rest in the files; the load's sub-group reads span
    # both (offload/param_swap.py's note: write-back)
    for rank, result in enumerate(runs):
        _assert_same(result[("resume", "stack", name)], result[("stack", "none")], f"rank {rank} StackNet {name}")


@pytest.mark.parametrize("name", [PARAM_NVME, BOTH_NVME])
def test_zero_init_on_nvme_writes_chunks_to_files_and_trains_equal_to_a_normal_build(runs, name):
    for rank, result in enumerate(runs):
        got = result[("zero_init_nvme", name)]
        assert got["init_chunks"] == ["SwappedChunk"], f"rank {rank}: chunks in memory: {got['init_chunks']}"
        _assert_same(got, result[("stack", "none")], f"rank {rank} zero.Init nvme {name}")


@pytest.mark.parametrize("key", [("frozen", PARAM_NVME), ("frozen", BOTH_NVME), ("frozen", "zero_init", BOTH_NVME)],
                         ids=lambda k: "-".join(k))
def test_frozen_parameters_live_in_a_file_and_train_equal(runs, key):
    # engine/zero/stage3_frozen.py: a frozen layer's chunks are in a chunk file, not in host memory, and
    # every gather reads them back, ahead of it once the prefetcher has a plan (zero.Init's chunks moved
    # there without a stop in memory)
    for rank, result in enumerate(runs):
        got, want = result[key], result[("frozen", "none")]
        assert want["frozen"]["count"] > 0 and want["frozen"]["resident_bytes"] > 0, f"rank {rank}: {want['frozen']}"
        frozen = got["frozen"]
        assert frozen["count"] == want["frozen"]["count"] and frozen["resident_bytes"] == 0, f"rank {rank}: {frozen}"
        assert frozen["file_bytes"] > 0 and not frozen["dir_left"], f"rank {rank}: {frozen}"
        assert frozen["reads_ahead"] > 0, f"rank {rank}: no gather took a frozen chunk read ahead of it"
        _assert_same(got, want, f"rank {rank} {key}")


def test_frozen_chunks_that_fit_max_in_cpu_stay_in_memory(runs):
    # stage3_frozen.py's note: max_in_cpu 1e9 holds the trainable partition and leaves room for the
    # frozen chunks, which then are neither written to a file nor read back
    for rank, result in enumerate(runs):
        got, want = result[("frozen", BOTH_NVME_RESIDENT)], result[("frozen", "none")]
        frozen = got["frozen"]
        assert frozen["resident_bytes"] == want["frozen"]["resident_bytes"] > 0, f"rank {rank}: {frozen}"
        assert frozen["file_bytes"] == 0 and frozen["reads_ahead"] == 0, f"rank {rank}: {frozen}"
        _assert_same(got, want, f"rank {rank} frozen resident")


@pytest.mark.parametrize("name", [f"{BOTH_NVME}->none", f"none->{BOTH_NVME}", f"none->{BOTH_NVME_RESIDENT}"])
def test_checkpoints_of_frozen_parameters_move_to_and_from_a_file(runs, name):
    # the reloaded engine starts from other weights, the frozen layer's too: a load that left the
    # frozen chunk file unwritten would train from those
    for rank, result in enumerate(runs):
        _assert_same(result[("resume", "frozen", name)], result[("frozen", "none")], f"rank {rank} frozen {name}")


@pytest.mark.parametrize("name", [PARAM_NVME, BOTH_NVME])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_16bit_training_swaps_16bit_parameters_and_equals_no_offload(runs, precision, name):
    # offload/param_swap.py's note (16-bit files): the files hold what the gathers send, half the bytes; the
    # fp32 master is in host memory (the optimizer there) or in the NVMe optimizer's files
    for rank, result in enumerate(runs):
        got = result[(precision, 3, name)]
        store = got["param_store"]
        assert store["file_dtype"] == f"torch.{'float16' if precision == 'fp16' else 'bfloat16'}", store
        assert store["file_bytes"] == 2 * store["partition_numel"], store
        assert store["master_in_memory"] is (name == PARAM_NVME), store
        if name == BOTH_NVME:
            # each sub-group's write-back overlapped the next one's step, and each step ended with them
            # finished (offload/param_swap.py's note: write-behind)
            assert store["partition_bytes"] == 0 and store["writes_behind"] > 0, store
            assert set(store["in_flight_after_step"]) == {0}, store
        _assert_same(got, result[(precision, 3, "none")], f"rank {rank} {precision} {name}")
    # fp32 training keeps fp32 files
    assert runs[0][(3, "adamw", PARAM_NVME)]["param_store"]["file_dtype"] == "torch.float32"
    assert runs[0][(3, "adamw", BOTH_NVME)]["param_store"]["file_dtype"] == "torch.float32"


def test_fast_init_keeps_fp32_parameter_files_in_bf16_and_equals_no_offload(runs):
    # its first step reads the first master from the parameter files: 16-bit ones would round it
    for rank, result in enumerate(runs):
        got = result[("bf16", 3, BOTH_NVME_FAST)]
        assert got["param_store"]["file_dtype"] == "torch.float32" and got["swap_files_at_init"] == 0, got
        _assert_same(got, result[("bf16", 3, "none")], f"rank {rank} bf16 fast_init")


@pytest.mark.parametrize("name", [f"{BOTH_NVME}->none", f"none->{BOTH_NVME}"])
def test_bf16_checkpoints_move_between_16bit_parameter_files_and_no_offload(runs, name):
    # saved: the master streams from the optimizer's files; loaded: written to them, the 16-bit image to
    # the parameter files (the reloaded engine starts from other weights: only the load makes it equal)
    for rank, result in enumerate(runs):
        got = result[("resume", "bf16", name)]
        if name.endswith(BOTH_NVME):
            assert got["param_store"]["file_dtype"] == "torch.bfloat16", got["param_store"]
        _assert_same(got, result[("bf16", 3, "none")], f"rank {rank} bf16 resumed {name}")


def test_zero_init_bf16_chunks_on_nvme_become_the_master_of_the_optimizer_files(runs):
    for rank, result in enumerate(runs):
        got = result[("zero_init_nvme", "bf16", BOTH_NVME)]
        assert got["init_chunks"] == ["SwappedChunk"] and got["param_store"]["file_dtype"] == "torch.bfloat16", got
        _assert_same(got, result[("stack", "bf16", "none")], f"rank {rank} bf16 zero.Init nvme")


EDIT_TIERS = (PARAM_NVME, BOTH_NVME, BOTH_NVME_FAST, NVME, NVME_FAST)


def _modifier_edits(nvme_path: str) -> dict:
    """Stage 3, a frozen first layer, SGD: rank 0 rewrites a trainable weight through
    GatheredParameters(modifier_rank=0) before the first step (with `fast_init` the optimizer tier's
    master is then still the partition itself) and a trainable and the frozen weight after two steps,
    then trains on; without offload and in every tier that keeps the master apart from what the
    gathers send (partition_store.py's note: master in the tier): the optimizer's files with the
    partition in memory or in parameter files, and 16-bit parameter files in bf16, where the edit's fp32
    values are cast on their way to the files."""
    import engine
    from engine.utils import safe_get_full_fp32_param
    from tests.models import make_batches, micro_batches
    from tests.offload_runs import GAS, MICRO, _frozen_stack, _gathered, config
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def edit(params):
        with engine.zero.GatheredParameters(params, modifier_rank=0):
            if rank == 0:
                for p in params:
                    p.data.mul_(0.5).add_(0.01)
    out = {}
    for precision in ("bf16", "fp32"):
        cast = torch.bfloat16 if precision == "bf16" else torch.float32
        for name in ("none", *EDIT_TIERS):
            torch.manual_seed(0)
            cfg = config(3, "sgd", {} if name == "none" else name, precision, nvme_path)
            if "param" in cfg["zero_optimization"]:  # nothing resident: the gathers after the edit read the files
                cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = 0
            eng = engine.initialize(model=_frozen_stack(), config=cfg)[0]
            edit([eng.module.layers[2].weight])
            for step, (x, y) in enumerate(make_batches(4, MICRO * GAS * world)):
                if step == 2:
                    edit([eng.module.layers[0].weight, eng.module.layers[1].weight])
                for xm, ym in micro_batches(x.to(cast), y.to(cast), rank, world, GAS):
                    eng.backward(eng(xm, ym))
                    eng.step()
            store = eng.zero_optimizer.partition.store
            out[(precision, name)] = {"params": {n: safe_get_full_fp32_param(p) if p.requires_grad else _gathered(p)
                                                 for n, p in eng.module.named_parameters()},
                                      "store": type(store).__name__,
                                      "file_dtype": str(store.dtype) if store.swapped else None}
            eng.destroy()
    return out


@pytest.fixture(scope="module")
def edits(tmp_path_factory):
    from tests.harness import run_distributed
    return run_distributed(_modifier_edits, 2, args=(str(tmp_path_factory.mktemp("edits")),), timeout=300)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_modifier_edits_reach_the_master_in_every_tier(edits, precision):
    for rank, result in enumerate(edits):
        for name in EDIT_TIERS:
            got = result[(precision, name)]
            if name in (PARAM_NVME, BOTH_NVME) and precision == "bf16":
                assert got["file_dtype"] == "torch.bfloat16", got["file_dtype"]
            if name in (NVME, NVME_FAST):  # the partition in memory, the master in the optimizer's files
                assert got["store"] == "TierMasterStore", got["store"]
            for param, want in result[(precision, "none")]["params"].items():
                diff = (got["params"][param] - want).abs().max().item()
                assert torch.equal(got["params"][param], want), f"rank {rank} {precision} {name} {param}: max |diff| {diff:.3e}"


def test_zero_init_on_nvme_without_a_config_is_one_error_naming_the_key(runs):
    for rank, result in enumerate(runs):
        problems = result["zero_init_nvme_without_config"]
        assert problems is not None and len(problems) == 1 and "offload_param.device" in problems[0], problems


def _failed_initialize(nvme_path: str) -> dict:
    """ZeRO-3, parameters and optimizer on NVMe, AdamW with 2 optimizer buffers (it swaps 3 per sub-group):
    initialize() fails after the parameter tier wrote its files; twice, as a notebook's retries would."""
    import engine
    from tests.offload_runs import _frozen_stack, config
    cfg = config(3, "adamw", BOTH_NVME, "fp32", nvme_path)
    cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = 2
    errors, left = [], []
    for _ in range(2):
        try:
            engine.initialize(model=_frozen_stack(), config=cfg)
        except ValueError as err:
            errors.append(str(err))
        left.append(sorted(str(p.relative_to(nvme_path)) for p in Path(nvme_path).rglob("*")))
    return {"errors": errors, "left": left}


def test_a_failed_initialize_leaves_no_swap_file(tmp_path):
    from tests.harness import run_distributed
    result = run_distributed(_failed_initialize, 1, args=(str(tmp_path),), timeout=120)[0]
    assert len(result["errors"]) == 2 and all("offload_optimizer.buffer_count" in e for e in result["errors"]), result
    assert result["left"] == [[], []], result["left"]


def _reads_ahead_across_steps(nvme_path: str) -> dict:
    """StackNet with both tiers on NVMe, every group read ahead between each step's last backward and its
    step (the prefetcher issues none there, but nothing says it cannot), against stage 3 without offload."""
    import torch.distributed as dist

    from tests.models import make_batches, micro_batches
    from tests.offload_runs import GAS, MICRO, _build, config, evict_kept
    from engine.utils import safe_get_full_fp32_param
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in ("none", BOTH_NVME):
        torch.manual_seed(0)
        eng = _build(config(3, "sgd", {} if name == "none" else name, "fp32", nvme_path), False, False, "stack")
        started = 0
        for x, y in make_batches(4, MICRO * GAS * world):
            for k, (xm, ym) in enumerate(micro_batches(x, y, rank, world, GAS)):
                eng.backward(eng(xm, ym, aux=k == 0))
                if k == GAS - 1 and name != "none":
                    evict_kept(eng.zero_optimizer.partition.store.pool)  # else no group needs reading
                    started += sum(bool(g.sources.read_ahead()) for g in eng.zero_optimizer.coordinator.groups)
                eng.step()
        out[name] = {n: safe_get_full_fp32_param(p).clone() for n, p in eng.module.named_parameters()}
        out[f"{name} started"] = started
        eng.destroy()
    return out


def test_a_read_issued_ahead_of_a_step_never_hands_back_the_master_before_it(tmp_path):
    # offload/param_swap.py's note (the master's file): the step writes the optimizer's files, not the
    # parameter store's, and still drops what was read ahead of it
    from tests.harness import run_distributed
    for rank, got in enumerate(run_distributed(_reads_ahead_across_steps, 2, args=(str(tmp_path),), timeout=300)):
        assert got[f"{BOTH_NVME} started"] > 0, f"rank {rank}: no group was read ahead"
        for n, want in got["none"].items():
            assert torch.equal(got[BOTH_NVME][n], want), f"rank {rank}: {n}"
