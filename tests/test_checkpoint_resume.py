"""Checkpoint and restart: a resumed run is the run that never stopped, at any world size and stage.

Exact resume (fp32 and fp16, CPU, 2 ranks): train 10 steps saving at step 5; a new process group
(a fresh engine in a new process group) loads step 5 and trains steps 6-10; losses and final weights are bitwise equal, for every built ZeRO
stage, with gradient accumulation, dropout (per-rank RNG), an LR schedule, the engine's data loader
(sampler position) and fp16 dynamic loss scaling that overflows at the start (scaler state, skips).
Reshard: the 2-rank step-5 checkpoints of every stage load at 1 and 4 ranks into every stage; fp32
master weights and Adam state equal the saved ones exactly, and training on continues to match the
uninterrupted run (atol 1e-5: only the reduction order differs at another world size); also where the
load at 1 rank keeps the micro-batch, so gradient_accumulation_steps follows the world (2 -> 4). Stage 3 is a
source and a target everywhere (its parameters are placeholders between uses), and its checkpoints
consolidate (`dstrain ckpt consolidate`) into the plain model.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

import engine
from engine.cli import main as cli_main
from engine.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from engine.zero import PARTITIONED_STAGES
from tests.harness import run_distributed
from tests.models import OddMLP
from tests.worlds import new_world

STAGES = [0, *sorted(PARTITIONED_STAGES), 3]  # a newly registered stage 1/2 is tested here automatically
STEPS, SAVE_AT, BATCH, SAMPLES = 10, 5, 8, 80  # one epoch of 10 global batches
CASES = [(stage, gas, prec) for stage in STAGES for gas, prec in ((1, "fp32"), (2, "fp32"), (2, "fp16"))]
STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


class DropoutMLP(OddMLP):
    """OddMLP with dropout, so each rank's RNG stream matters for the losses."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x, y):
        return super().forward(torch.nn.functional.dropout(x, self.p, self.training), y)


def _dataset():
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 13, generator=g), torch.randn(SAMPLES, 5, generator=g))


def _config(stage: int, gas: int, prec: str) -> dict:
    cfg = {"train_batch_size": BATCH, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 600, "allgather_bucket_size": 900}}
    if stage == 3:  # l1/l2/l3.weight partitioned, scale and l3.bias persistent, the frozen 7 partitioned
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 5
    if prec == "fp16":  # 2^20 overflows at first: the first steps are skipped and the scale drops
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 3, "hysteresis": 1}
    return cfg


def _engine(case, seed: int, micro: int | None = None):
    """`micro`: the micro-batch fixed instead of gradient_accumulation_steps, which then follows the world."""
    torch.manual_seed(seed)  # a different seed at restart: everything must come from the checkpoint
    # The fp32 gas-2 runs are the reshard sources: no dropout there (RNG streams differ across world sizes).
    model = DropoutMLP(0.0 if case[1:] == (2, "fp32") else 0.1)
    cfg = _config(*case)
    if micro is not None:
        del cfg["gradient_accumulation_steps"]
        cfg["train_micro_batch_size_per_gpu"] = micro
    eng, _, loader, _ = engine.initialize(model=model, config=cfg, training_data=_dataset())
    return eng, loader


def _train(eng, batches, steps: int) -> list[float]:
    losses = []
    dtype = eng.module.l1.weight.dtype
    for _ in range(steps):
        for _ in range(eng.gradient_accumulation_steps()):
            x, y = next(batches)
            loss = eng(x.to(dtype), y.to(dtype))
            eng.backward(loss)
            eng.step()
        losses.append(float(loss))
    return losses


def _full_state(eng) -> dict:
    """Full fp32 master weights and Adam state per parameter (collective at stages >= 1)."""
    out = {}
    for name, p in eng.module.named_parameters():
        if p.requires_grad:
            # clone: the stage 1/2 answer for scalar state ("step") is the live tensor, stepped in place
            values = [safe_get_full_fp32_param(p)] + [safe_get_full_optimizer_state(p, k) for k in STATE_KEYS]
            out[name] = [torch.as_tensor(v).clone() for v in values]
    return out


def _snapshot(eng) -> dict:
    # Stage 3 parameters are placeholders between uses: gather them (a no-op at stages 0-2).
    with engine.zero.GatheredParameters(list(eng.module.parameters())):
        weights = {k: v.clone() for k, v in eng.module.state_dict().items()}
    return {"weights": weights,
            "counters": (eng.global_steps, eng.global_samples, eng.micro_steps, eng.skipped_steps),
            "lr": eng.get_lr()}


def _uninterrupted(root: str):
    """Every case: 10 steps with a save at step 5 (the save must not disturb the run)."""
    out = {}
    for case in CASES:
        eng, loader = _engine(case, seed=0)
        batches = iter(loader)  # one pass: the save happens mid-epoch
        losses = _train(eng, batches, SAVE_AT)
        eng.save_checkpoint(Path(root) / str(case), client_state={"case": list(map(str, case))})
        saved = _full_state(eng) if case[2] == "fp32" else None
        at_save = _snapshot(eng)["weights"] if case[0] == 3 else None  # for the consolidate test
        losses += _train(eng, batches, STEPS - SAVE_AT)
        out[case] = {"losses": losses, "saved": saved, "at_save": at_save, **_snapshot(eng)}
    return out


def _resumed(root: str):
    out = {}
    for case in CASES:
        eng, loader = _engine(case, seed=1234)
        path, client = eng.load_checkpoint(Path(root) / str(case))
        assert client == {"case": list(map(str, case))} and path.endswith(f"global_step{SAVE_AT}")
        losses = _train(eng, iter(loader), STEPS - SAVE_AT)
        out[case] = {"losses": losses, **_snapshot(eng)}
    return out


def _every_world(root: str) -> dict:
    """All jobs in one spawn of 4 processes, as successive worlds (tests/worlds.py; a spawn costs a torch
    import per process): ranks 0-1 run the uninterrupted job, then the resumed one in a new process
    group (a fresh engine from another seed: everything must come from the checkpoint); ranks 2-3 wait
    in the 4-rank world's rendezvous, which then reshards at 4; last, rank 0 alone reshards at 1."""
    import torch.distributed as dist
    rank, out = dist.get_rank(), {}
    if rank < 2:
        new_world(f"{root}/world_full", rank, 2)
        out["full"] = _uninterrupted(root)
        new_world(f"{root}/world_resumed", rank, 2)
        out["resumed"] = _resumed(root)
    new_world(f"{root}/world_reshard", rank, 4)
    out[4] = _reshard(root)
    new_world(None, 0, 1)
    if rank == 0:
        out[1] = _reshard(root)
        out["derived"] = _reshard_derived_gas(root)
    return out


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_distributed(_every_world, 4, args=(root,), timeout=900)
        full, resumed = [r["full"] for r in per_rank[:2]], [r["resumed"] for r in per_rank[:2]]
        reshard = {w: per_rank[0][w] for w in (1, 4, "derived")}
        consolidated = {case: _consolidate(root, case) for case in CONSOLIDATE}
    return full, resumed, reshard, consolidated


CONSOLIDATE = [(3, 1, "fp32"), (3, 2, "fp16")]  # stages 0-2: test_checkpoint_faults.py


def _consolidate(root: str, case) -> dict:
    out = Path(root) / f"{case}.pt"
    dtype = "fp16" if case[2] == "fp16" else "fp32"
    assert cli_main(["ckpt", "consolidate", str(Path(root) / str(case)), "--out", str(out), "--dtype", dtype]) == 0
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("case", CONSOLIDATE, ids=[f"stage{s}-gas{g}-{p}" for s, g, p in CONSOLIDATE])
def test_consolidate_stage3_loads_into_plain_model(runs, case):
    """A stage-3 checkpoint (placeholders in the live module) consolidates to full tensors that load
    into the plain model and equal the engine's weights at the save (fp16: the same cast)."""
    consolidated, at_save = runs[3][case], runs[0][0][case]["at_save"]
    plain = OddMLP()
    if case[2] == "fp16":
        plain.half()
    plain.load_state_dict(consolidated)  # strict, no dstrain needed
    for key, value in at_save.items():
        assert torch.equal(consolidated[key], value), key


@pytest.mark.parametrize("case", CASES, ids=[f"stage{s}-gas{g}-{p}" for s, g, p in CASES])
def test_exact_resume_is_bitwise(runs, case):
    full, resumed = runs[:2]
    for rank in range(2):
        a, b = full[rank][case], resumed[rank][case]
        assert b["losses"] == a["losses"][SAVE_AT:], f"rank {rank}: losses of steps 6-10 differ"
        assert b["counters"] == a["counters"] and b["lr"] == a["lr"]
        for key, value in a["weights"].items():
            assert torch.equal(b["weights"][key], value), f"rank {rank}: {key} differs"
    if case[2] == "fp16":
        assert full[0][case]["counters"][3] > 0, "the fp16 case should have skipped steps (scaler state)"


def _reshard_pairs(world: int) -> list[tuple[int, int]]:
    """(saved stage, loading stage): all pairs at 1 rank; at 4 (oversubscribed) each stage once as source
    and once as target, every pair a change of stage."""
    if world == 1:
        return [(a, b) for a in STAGES for b in STAGES]
    return [(a, STAGES[(i + 1) % len(STAGES)]) for i, a in enumerate(STAGES)]


def _reshard(root: str):
    """Load 2-rank fp32 step-5 checkpoints into other stages at this world size."""
    out = {}
    for saved_stage, stage in _reshard_pairs(torch.distributed.get_world_size()):
        eng, loader = _engine((stage, 2, "fp32"), seed=99)
        eng.load_checkpoint(Path(root) / str((saved_stage, 2, "fp32")))
        state = _full_state(eng)
        _train(eng, iter(loader), STEPS - SAVE_AT)
        out[(saved_stage, stage)] = {"state": state, **_snapshot(eng)}
    return out


def _reshard_derived_gas(root: str):
    """At 1 rank with the saving run's micro-batch (2) and train_batch_size (8): gradient_accumulation_steps
    becomes 4 where the 2-rank save had 2, so the saved micro-step count (10) is not a window start."""
    out = {}
    for saved_stage, stage in ((1, 1), (3, 2)):
        eng, loader = _engine((stage, 2, "fp32"), seed=99, micro=BATCH // 4)
        eng.load_checkpoint(Path(root) / str((saved_stage, 2, "fp32")))
        boundaries = [eng.is_gradient_accumulation_boundary()]
        _train(eng, iter(loader), STEPS - SAVE_AT)
        out[(saved_stage, stage)] = {"gas": eng.gradient_accumulation_steps(), "first_boundary": boundaries[0],
                                     **_snapshot(eng)}
    return out


def test_a_load_that_changes_the_accumulation_steps_starts_a_whole_window(runs):
    """(restore.py's restore_counters) the windows after the load are whole: training equals the run never stopped."""
    full, reshard = runs[0], runs[2]
    for (saved_stage, stage), got in reshard["derived"].items():
        where = f"saved stage {saved_stage} x2 (gas 2) -> stage {stage} x1"
        assert got["gas"] == 4 and not got["first_boundary"], (where, got["gas"])
        assert got["counters"][0] == STEPS, where
        for key, value in full[0][(stage, 2, "fp32")]["weights"].items():
            torch.testing.assert_close(got["weights"][key], value, atol=1e-5, rtol=0, msg=lambda m: f"{where}: {key}: {m}")


@pytest.mark.parametrize("world", [1, 4])
def test_reshard_across_world_sizes_and_stages(runs, world):
    full, reshard = runs[0], runs[2]
    for (saved_stage, stage), got in reshard[world].items():
        where = f"saved stage {saved_stage} x2 -> stage {stage} x{world}"
        saved = full[0][(saved_stage, 2, "fp32")]["saved"]
        for name, tensors in saved.items():
            for kind, a, b in zip(("fp32",) + STATE_KEYS, tensors, got["state"][name]):
                assert torch.equal(torch.as_tensor(a).float(), torch.as_tensor(b).float()), f"{where}: {name} {kind}"
        assert got["counters"][:2] == full[0][(saved_stage, 2, "fp32")]["counters"][:2]
        ref = full[0][(stage, 2, "fp32")]["weights"]
        for key, value in ref.items():
            torch.testing.assert_close(got["weights"][key], value, atol=1e-5, rtol=0, msg=lambda m: f"{where}: {key}: {m}")
