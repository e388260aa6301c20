"""Pipeline × data parallelism on 4 ranks (2 stages × 2 data-parallel ranks): ZeRO-1 and ZeRO-2 over
the data axis equal single-process SGD; with clipping every rank reports, and clips with, the norm of
the whole model's gradient (the tied embedding counted once); an Inf produced on one stage makes every
rank skip that step; ZeRO-3 in each stage (gathered once per step for all micro-batches, reduce-scattered
once after the last) equals the same reference, also clipped with an Inf on one stage, under the
interleaved and zero-bubble schedules, and with optimizer and parameters offloaded to the host; in bf16
its update is within 5% of the fp32 reference's, as ZeRO-1's. In fp16 an overflow on one stage skips the
step on every rank with the loss scale halved everywhere and nothing stepped, ZeRO-3 bit for bit as
ZeRO-1; the NVMe tiers (optimizer at ZeRO-2; optimizer and parameters at ZeRO-3) train bit for bit as
the same runs in memory. Under "zb_h1" (weight gradients deferred, engine/pipe/zb_h1.py) ZeRO-1 with 4
micro-batches, ZeRO-2 and ZeRO-3 with 2 equal the same reference, the last two bit for bit as "1f1b".
All in one 4-rank spawn."""
from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.models import micro_batches
from tests.pipe_models import Reference, global_batches, lm_loss, reference_params, reference_sgd, tied_specs
from tests.test_pipeline import LR, MICRO, STEPS, _check_against_reference, _config

GAS, INF_STEP, CLIP = 2, 2, 0.05
FP16, MOMENTUM = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}, 0.9


def _poison_stage_one(eng, pm, inf_at: int | None) -> list:
    """A hook on the second stage's hidden layer that makes its gradient Inf while the returned list is
    non-empty (the caller fills it at step `inf_at`); no hook elsewhere or without `inf_at`."""
    poison: list = []
    if inf_at is not None and eng.stage_id == 1:
        layer = next(m for n, m in pm.named_children() if n.isdigit() and isinstance(m, torch.nn.Linear))
        layer.weight.register_hook(lambda g: g * float("inf") if poison else g)
    return poison


def _train_with(zero: int, clip: float = 0.0, inf_at: int | None = None, extra: dict | None = None,
                schedule: str = "1f1b", gas: int = GAS):
    import engine
    from engine.pipe import PipelineModule
    from engine.utils import safe_get_full_fp32_param
    pm = PipelineModule(tied_specs(4), num_stages=2, loss_fn=lm_loss, seed_layers=True, partition_method="uniform")
    eng, *_ = engine.initialize(model=pm, config=_config(schedule, gas, zero, {"gradient_clipping": clip, **(extra or {})}))
    dp, dp_rank = eng.comm.world_size, eng.comm.rank
    poison = _poison_stage_one(eng, pm, inf_at)
    low = extra is not None and "bf16" in extra
    start = {n: safe_get_full_fp32_param(p) for n, p in pm.named_parameters()} if low else None
    losses, norms = [], []
    for step, (x, y) in enumerate(global_batches(STEPS, MICRO * gas * dp, True)):
        poison[:] = [True] if step == inf_at else []
        losses.append(float(eng.train_batch(iter(list(micro_batches(x, y, dp_rank, dp, gas))))))
        norms.append(eng.get_global_grad_norm())
    if low:  # the fp32 master weights' total update (they start from the rounded weights)
        return ({n: safe_get_full_fp32_param(p) - start[n] for n, p in pm.named_parameters()}, losses, norms,
                eng.skipped_steps)
    return ({n: p.detach().clone() for n, p in pm.named_parameters()}, losses, norms, eng.skipped_steps)


def _all_cases():
    return {"zero1": _train_with(1), "zero2": _train_with(2), "clip": _train_with(2, clip=CLIP),
            "inf": _train_with(0, inf_at=INF_STEP), "zero3": _zero3(), "zero3_clip_inf": _zero3(CLIP, INF_STEP), "in_init": _built_in_zero_init(),
            "one_bit": _one_bit_refused(),
            "bf16": _train_with(1, extra={"bf16": {"enabled": True}}),
            # ZeRO-3 under the multi-chunk schedules, in bf16, and with the optimizer and parameters on the host
            "zero3_interleaved": _zero3(schedule="interleaved_1f1b", virtual=2),
            "zero3_zero_bubble": _zero3(schedule="zero_bubble", virtual=2),
            "zero3_bf16": _zero3(extra={"bf16": {"enabled": True}}),
            "zero3_offload": _zero3(extra={"zero_optimization": {"offload_optimizer": {"device": "cpu"},
                                                                 "offload_param": {"device": "cpu"}}}),
            # fp16 with an overflow on one stage, with and without ZeRO-3; the NVMe tiers at stages 2 and 3
            "fp16_zero1": _fp16(1), "fp16_zero3": _fp16(3),
            "zero2_nvme": _offloaded_to_nvme(2), "zero3_nvme": _offloaded_to_nvme(3),
            # zb_h1: 4 micro-batches on 2 stages (a steady state with deferred weight gradients), and 2
            "zb_h1_zero1": _train_with(1, schedule="zb_h1", gas=4), "zb_h1_zero2": _train_with(2, schedule="zb_h1"),
            "zb_h1_zero3": _zero3(schedule="zb_h1")}


@pytest.fixture(scope="module")
def per_rank():
    return run_distributed(_all_cases, world_size=4, timeout=300)


def test_two_stages_by_two_data_ranks(per_rank):
    for zero in ("zero1", "zero2"):
        _check_against_reference([r[zero][:3] for r in per_rank], tied=True, gas=GAS, dp=2, n_layers=6)
    # clipping: the world's norm, identical on all 4 ranks, and the reference's clipped trajectory
    ref_norms: list = []
    ref, _ = reference_sgd(tied_specs(4), global_batches(STEPS, MICRO * GAS * 2, True), lm_loss, LR, STEPS,
                           clip=CLIP, norms=ref_norms)
    assert ref_norms[-1] > CLIP  # clipping really acted
    want = reference_params(ref)
    for r in per_rank:
        params, _, norms, _ = r["clip"]
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        for name, p in params.items():
            torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6, msg=f"clipped {name}")
    # an Inf on stage 1 only: every rank skips that step, and only that one
    ref, _ = reference_sgd(tied_specs(4), global_batches(STEPS, MICRO * GAS * 2, True), lm_loss, LR, STEPS,
                           skip={INF_STEP})
    want = reference_params(ref)
    for r in per_rank:
        params, _, norms, skipped = r["inf"]
        assert skipped == 1
        assert not torch.isfinite(torch.tensor(norms[INF_STEP]))
        for name, p in params.items():
            torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6, msg=f"after the skip, {name}")
    # bf16 weights, fp32 master weights at ZeRO-1: each parameter's total update (master − its start) within
    # 5% of the fp32 reference's. bf16 rounds activations and gradients to ~0.4%, so a few percent is
    # what 5 steps drift; a gradient off by 2x (a missing 1/m, a tied gradient counted twice) is 100%.
    ref, _ = reference_sgd(tied_specs(4), global_batches(STEPS, MICRO * GAS * 2, True), lm_loss, LR, STEPS)
    want, init = reference_params(ref), reference_params(Reference(tied_specs(4)))
    want_update = {name: want[name] - init[name] for name in want}
    for r in per_rank:
        params, _, _, skipped = r["bf16"]
        assert skipped == 0
        for name, p in params.items():
            torch.testing.assert_close(p, want[name] - init[name], rtol=5e-2, atol=2e-4,
                                       msg=f"bf16 update of {name}")
    # ZeRO-3 in each stage (engine/pipe/zero3.py): the reference's weights; per step each of the stage's
    # groups all-gathered once whatever the GAS micro-batches, plus one id check for them all (zero3.py's
    # note: the gathers follow one fixed list), the gradients reduce-scattered once per bucket after the
    # last one; the gathered copies released before the optimizer step starts (not only by the step's own
    # release of stale copies) and nothing gathered between steps
    _check_against_reference([r["zero3"]["run"][:3] for r in per_rank], tied=True, gas=GAS, dp=2, n_layers=6)
    for r in per_rank:
        z3 = r["zero3"]
        assert z3["groups"] > 1 and z3["between"] == [0] * STEPS and z3["after_eval"] == 0, z3
        assert z3["at_step"] == [0] * STEPS, z3["at_step"]
        assert z3["evaluated"] == pytest.approx(z3["run"][1][0], rel=1e-6), z3
        for calls in z3["calls"]:
            assert calls.get("all_gather", 0) == z3["groups"] + 1, (calls, z3["groups"])
            assert calls.get("reduce_scatter", 0) == z3["buckets"], (calls, z3["buckets"])
    whole = {n: p for r in per_rank for n, p in r["zero3"]["run"][0].items()}
    saved = per_rank[0]["zero3"]["saved"]
    assert set(saved) == set(whole) and all(s["zero3"]["saved"] is None for s in per_rank[1:]), sorted(saved)
    for name, p in whole.items():
        torch.testing.assert_close(saved[name], p, rtol=0, atol=0, msg=f"save_16bit_model: {name}")
    # the same reference under interleaved 1F1B and zero-bubble (two chunks per rank: the held groups
    # serve both chunks) and with CPU offload of optimizer and parameters; bf16 as the ZeRO-1 bf16 run
    for case in ("zero3_interleaved", "zero3_zero_bubble", "zero3_offload"):
        _check_against_reference([r[case]["run"][:3] for r in per_rank], tied=True, gas=GAS, dp=2, n_layers=6)
        assert all(r[case]["between"] == [0] * STEPS and r[case]["at_step"] == [0] * STEPS for r in per_rank), case
    assert all(r["zero3_offload"]["staged"] and not r["zero3"]["staged"] for r in per_rank), "no staged host tier"
    for r in per_rank:
        params, _, _, skipped = r["zero3_bf16"]["run"]
        assert skipped == 0
        for name, p in params.items():
            torch.testing.assert_close(p, want_update[name], rtol=5e-2, atol=2e-4, msg=f"ZeRO-3 bf16 update of {name}")
    for r in per_rank:
        assert r["in_init"] is not None and "PipelineModule inside engine.zero.Init is not supported" in r["in_init"]
        assert r["one_bit"] is not None and "optimizer.type: OneBitAdam (a 1-bit optimizer) with a pipeline is " \
            "not built yet" in r["one_bit"], r["one_bit"]
    # ZeRO-3 clipped, with an Inf on stage 1 at INF_STEP: the reference's clipped run without that step, its
    # norms reported on every rank, that step skipped everywhere
    ref_norms = []
    ref, _ = reference_sgd(tied_specs(4), global_batches(STEPS, MICRO * GAS * 2, True), lm_loss, LR, STEPS,
                           clip=CLIP, skip={INF_STEP}, norms=ref_norms)
    want = reference_params(ref)
    for r in per_rank:
        params, _, norms, skipped = r["zero3_clip_inf"]["run"]
        assert skipped == 1 and not torch.isfinite(torch.tensor(norms[INF_STEP])), norms
        finite = [n for s, n in enumerate(norms) if s != INF_STEP]
        assert finite == pytest.approx([n for s, n in enumerate(ref_norms) if s != INF_STEP], rel=1e-5)
        for name, p in params.items():
            torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6, msg=f"ZeRO-3 clipped, {name}")


def test_zb_h1_with_zero_equals_the_reference(per_rank):
    """"zb_h1" at ZeRO-1 (4 micro-batches: weight gradients deferred in the steady state too), ZeRO-2 and
    ZeRO-3 (2): the single-process reference; at ZeRO-2 and ZeRO-3 also bit for bit the "1f1b" runs of
    the same config (each micro-batch's weight gradient is the same autograd computation, only later),
    ZeRO-3 gathering once per step and holding nothing between steps as under "1f1b"."""
    _check_against_reference([r["zb_h1_zero1"][:3] for r in per_rank], tied=True, gas=4, dp=2, n_layers=6)
    _check_against_reference([r["zb_h1_zero2"][:3] for r in per_rank], tied=True, gas=GAS, dp=2, n_layers=6)
    _check_against_reference([r["zb_h1_zero3"]["run"][:3] for r in per_rank], tied=True, gas=GAS, dp=2, n_layers=6)
    for rank, r in enumerate(per_rank):
        for zb, plain in ((r["zb_h1_zero2"], r["zero2"]), (r["zb_h1_zero3"]["run"], r["zero3"]["run"])):
            assert zb[1] == plain[1] and zb[2] == plain[2] and zb[3] == plain[3] == 0, (rank, zb[1:], plain[1:])
            for name, p in zb[0].items():
                assert torch.equal(p, plain[0][name]), f"rank {rank}: zb_h1 against 1f1b, {name}"
        z3 = r["zb_h1_zero3"]  # eval_batch (zb_h1's forward-only loop) first: the loss train_batch then reports
        assert z3["between"] == [0] * STEPS and z3["at_step"] == [0] * STEPS and z3["after_eval"] == 0, z3
        assert z3["evaluated"] == pytest.approx(z3["run"][1][0], rel=1e-6), z3
        assert all(calls.get("all_gather", 0) == z3["groups"] + 1 for calls in z3["calls"]), z3["calls"]


def test_fp16_overflow_on_one_stage_skips_everywhere_with_and_without_zero3(per_rank):
    """An Inf on stage 1 only: with ZeRO-1 and with ZeRO-3 every rank skips that one step, halves the loss
    scale (hysteresis 1), and leaves every master weight and momentum buffer as it was; the updates are
    the fp32 reference's (which skips the same step) within 5% or 1e-4 (fp16 rounds to ~0.05%; they differ
    by at most 3e-5 on updates up to 3.5e-2, a gradient off by 2x or unscaled by 256 by far more), and
    ZeRO-3's equal ZeRO-1's bit for bit: both run the same fp16 forward and backward and, on 2 data ranks,
    add the same two gradients (an all-reduce against a reduce-scatter: a + b either way)."""
    ref, _ = reference_sgd(tied_specs(4), global_batches(STEPS, MICRO * GAS * 2, True), lm_loss, LR, STEPS,
                           skip={INF_STEP}, momentum=MOMENTUM)
    want, init = reference_params(ref), reference_params(Reference(tied_specs(4)))
    scale = 2.0 ** FP16["initial_scale_power"]
    for rank, r in enumerate(per_rank):
        for case in ("fp16_zero1", "fp16_zero3"):
            got = r[case]
            assert got["skipped"] == 1, (rank, case, got["skipped"])
            assert got["scales"] == [scale] * INF_STEP + [scale / 2] * (STEPS - INF_STEP), (rank, case, got["scales"])
            before, after = got["around"]
            for name, (master, momentum) in before.items():
                assert torch.equal(master, after[name][0]) and torch.equal(momentum, after[name][1]), (rank, case, name)
            for name, update in got["update"].items():
                torch.testing.assert_close(update, want[name] - init[name], rtol=5e-2, atol=1e-4,
                                           msg=f"rank {rank} {case}: update of {name}")
        for name, update in r["fp16_zero3"]["update"].items():
            assert torch.equal(update, r["fp16_zero1"]["update"][name]), f"rank {rank}: ZeRO-3 against ZeRO-1, {name}"


def test_nvme_tiers_in_a_pipeline_equal_the_runs_in_memory_bit_for_bit(per_rank):
    """The optimizer on NVMe at ZeRO-2, and optimizer and parameters on NVMe at ZeRO-3 (every gather of
    the held step reading the files): weights, losses and norms equal to the same run in memory."""
    for rank, r in enumerate(per_rank):
        for nvme, memory in (("zero2_nvme", r["zero2"]), ("zero3_nvme", r["zero3"]["run"])):
            got = r[nvme]
            assert got["swap_files"] > 0, (rank, nvme)
            run = got["run"] if nvme == "zero2_nvme" else got["run"]["run"]
            params, losses, norms, skipped = run
            assert skipped == 0 and losses == memory[1] and norms == memory[2], (rank, nvme, losses, memory[1])
            for name, p in params.items():
                assert torch.equal(p, memory[0][name]), f"rank {rank} {nvme}: {name} differs from the run in memory"
        assert r["zero3_nvme"]["run"]["param_read"] > 0, f"rank {rank}: no parameter read from the files"


def _built_in_zero_init() -> str | None:
    """A PipelineModule built inside engine.zero.Init: refused before any layer is built."""
    import engine
    from engine.pipe import PipelineModule
    try:
        with engine.zero.Init():
            PipelineModule(tied_specs(4), num_stages=2, loss_fn=lm_loss)
    except ValueError as err:
        return str(err)
    return None


def _one_bit_refused() -> str | None:
    """A 1-bit optimizer with a pipeline: refused by name at initialize (its compressed steps agree the norm
    over the data axis only, so stages would clip and skip apart)."""
    import engine
    import schemas
    from engine.pipe import PipelineModule
    pm = PipelineModule(tied_specs(4), num_stages=2, loss_fn=lm_loss, partition_method="uniform")
    try:
        engine.initialize(model=pm, config={"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
                                            "optimizer": {"type": "OneBitAdam",
                                                          "params": {"lr": LR, "freeze_step": 2}}})
    except schemas.ConfigError as err:
        return str(err)
    return None


def _zero3(clip: float = 0.0, inf_at: int | None = None, schedule: str = "1f1b", virtual: int = 1,
           extra: dict | None = None):
    """ZeRO-3 on 2 pipe × 2 data, every parameter partitioned (persistence threshold 0): the trained
    parameters (gathered), losses, norms, skips, and per step the collectives' calls on this rank (the
    stage-3 gather group shares the reduction group's counters) and the stage's gather groups and
    gradient buckets, to count them against. `clip`, `inf_at`: as `_train_with`'s; `schedule` with
    `virtual` stages per rank; `extra` config (bf16, offload): then the parameters are the fp32 master
    weights' total update, as `_train_with`'s low-precision runs."""
    import tempfile

    import torch.distributed as dist

    import engine
    from engine.pipe import PipelineModule
    from engine.utils import safe_get_full_fp32_param
    pm = PipelineModule(tied_specs(4), num_stages=2, loss_fn=lm_loss, seed_layers=True, partition_method="uniform",
                        virtual_stages=virtual)
    extra = extra or {}
    cfg = _config(schedule, GAS, 3, {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                           "stage3_gather_16bit_weights_on_model_save": True,
                                                           **extra.get("zero_optimization", {})},
                                     "gradient_clipping": clip,
                                     **{k: v for k, v in extra.items() if k != "zero_optimization"}})
    import os
    offload = "offload_optimizer" in extra.get("zero_optimization", {})
    # offload: the accelerator's copy path (staged host flats), which a CPU-only machine skips unless asked
    os.environ["DSTRAIN_OFFLOAD_STAGE_COPIES"] = "1" if offload else "0"
    try:
        eng, *_ = engine.initialize(model=pm, config=cfg)
    finally:
        os.environ.pop("DSTRAIN_OFFLOAD_STAGE_COPIES")
    zopt, dp, dp_rank = eng.zero_optimizer, eng.comm.world_size, eng.comm.rank
    poison = _poison_stage_one(eng, pm, inf_at)
    losses, norms, calls, between, at_step = [], [], [], [], []
    opt_step = zopt.step  # wrapped: the parameter elements this rank holds when the optimizer step starts
    zopt.step = lambda *a, **k: (at_step.append(sum(p.numel() for p in pm.parameters())), opt_step(*a, **k))[1]
    batches = global_batches(STEPS, MICRO * GAS * dp, True)
    start = {n: safe_get_full_fp32_param(p) for n, p in pm.named_parameters()} if "bf16" in extra else None
    # eval_batch holds and releases the same way: on the first batch, the loss train_batch then reports
    evaluated = float(eng.eval_batch(iter(list(micro_batches(*batches[0], dp_rank, dp, GAS)))))
    after_eval = sum(p.numel() for p in pm.parameters())
    for step, (x, y) in enumerate(batches):
        poison[:] = [True] if step == inf_at else []
        eng.comm.stats.reset()
        losses.append(float(eng.train_batch(iter(list(micro_batches(x, y, dp_rank, dp, GAS))))))
        calls.append(dict(eng.comm.stats.calls))
        norms.append(eng.get_global_grad_norm())
        between.append(sum(p.numel() for p in pm.parameters()))  # placeholders between steps: 0
    if start is not None:
        params = {n: safe_get_full_fp32_param(p) - start[n] for n, p in pm.named_parameters()}
    else:
        with engine.zero.GatheredParameters(list(pm.parameters())):
            params = {n: p.detach().clone() for n, p in pm.named_parameters()}
    with tempfile.TemporaryDirectory() as d:  # save_16bit_model: both stages' layers in one file, rank 0's
        assert eng.save_16bit_model(d)
        saved = torch.load(f"{d}/pytorch_model.bin", weights_only=True) if dist.get_rank() == 0 else None
    zopt.step = opt_step
    return {"run": (params, losses, norms, eng.skipped_steps), "calls": calls, "between": between, "saved": saved,
            "at_step": at_step,
            "evaluated": evaluated, "after_eval": after_eval,
            "groups": len(zopt.coordinator.groups), "buckets": len(zopt.buckets), "staged": zopt.tier.staged,
            "param_read": zopt.partition.store.bytes_read if zopt.partition.store.swapped else 0}


def _fp16(zero: int) -> dict:
    """fp16 weights (dynamic loss scale from 2**8, hysteresis 1: an overflow halves it at once), SGD with
    momentum and no clipping, an Inf on stage 1 at INF_STEP; `zero` 1 or 3 (every parameter partitioned).
    Returns the fp32 master weights' total update, the skips, the loss scale after each step, and the
    master weights and momentum around the skipped step (each as every parameter's full tensor)."""
    import engine
    from engine.pipe import PipelineModule
    from engine.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    pm = PipelineModule(tied_specs(4), num_stages=2, loss_fn=lm_loss, seed_layers=True, partition_method="uniform")
    sgd = {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}}
    cfg = _config("1f1b", GAS, zero, {"fp16": FP16, "optimizer": sgd,
                                      "zero_optimization": {"stage": zero, "stage3_param_persistence_threshold": 0}})
    eng, *_ = engine.initialize(model=pm, config=cfg)
    dp, dp_rank = eng.comm.world_size, eng.comm.rank
    poison = _poison_stage_one(eng, pm, INF_STEP)

    def state() -> dict:
        return {n: (safe_get_full_fp32_param(p), safe_get_full_optimizer_state(p, "momentum_buffer"))
                for n, p in pm.named_parameters()}
    start, scales, around = state(), [], []
    for step, (x, y) in enumerate(global_batches(STEPS, MICRO * GAS * dp, True)):
        poison[:] = [True] if step == INF_STEP else []
        if step == INF_STEP:
            around.append(state())
        eng.train_batch(iter(list(micro_batches(x, y, dp_rank, dp, GAS))))
        scales.append(eng.zero_optimizer.guard.scaler.loss_scale)
        if step == INF_STEP:
            around.append(state())
    update = {n: master - start[n][0] for n, (master, _) in state().items()}
    return {"update": update, "skipped": eng.skipped_steps, "scales": scales, "around": around}


def _offloaded_to_nvme(zero: int) -> dict:
    """fp32 SGD with the optimizer on NVMe (`zero` 2: its state and master; 3: and the parameters, none
    kept in host memory: every gather reads the files) under a fresh directory: `_zero3`'s or
    `_train_with`'s result, to compare bit for bit with the same run in memory."""
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        tiers = {"offload_optimizer": {"device": "nvme", "nvme_path": d}}
        if zero == 2:
            run = _train_with(2, extra={"zero_optimization": {"stage": 2, **tiers}})
        else:
            tiers["offload_param"] = {"device": "nvme", "nvme_path": d, "max_in_cpu": 0, "buffer_count": 1}
            run = _zero3(extra={"zero_optimization": tiers})
        return {"run": run, "swap_files": sum(len(files) for _, _, files in os.walk(d))}
