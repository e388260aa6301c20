"""The engine's public surface behaves like DeepSpeed's: initialize's tuple, accumulation boundaries,
no_sync, schedules stepped per optimizer step, client optimizers, the data loader's sharding, and the
environment discovery of init_distributed."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

import engine
import schemas
from engine.dist import Topology, _first_slurm_host, discover_env
from tests.harness import run_distributed
from tests.models import OddMLP, make_batches


def _cfg(**extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                                        "warmup_num_steps": 4, "warmup_type": "linear"}}}
    cfg.update(extra)
    return cfg


def _surface():
    torch.manual_seed(0)
    dataset = torch.utils.data.TensorDataset(torch.arange(40).float().unsqueeze(1))
    eng, opt, loader, sched = engine.initialize(model=OddMLP(), config=_cfg(), training_data=dataset)
    out = {"types": (type(eng).__name__, type(opt).__name__, type(sched).__name__),
           "loader_batches": [b[0].squeeze(1).tolist() for b in loader]}
    lrs, boundaries = [], []
    for x, y in make_batches(8, 2):
        boundaries.append(eng.is_gradient_accumulation_boundary())
        eng.backward(eng(x, y))
        eng.step()
        lrs.append(eng.get_lr()[0])
    out.update(lrs=lrs, boundaries=boundaries, global_steps=eng.global_steps, micro_steps=eng.micro_steps,
               samples=eng.global_samples)
    # no_sync: backward inside is fine, step inside is an error naming the fix.
    x, y = make_batches(1, 2)[0]
    with eng.no_sync():
        eng.backward(eng(x, y))
        try:
            eng.step()
            out["step_in_no_sync"] = None
        except RuntimeError as e:
            out["step_in_no_sync"] = str(e)
    eng.set_gradient_accumulation_boundary(True)
    out["forced_boundary"] = eng.is_gradient_accumulation_boundary()
    return out


def test_engine_surface_single_rank():
    r = run_distributed(_surface, 1)[0]
    assert r["types"] == ("Engine", "SGD", "WarmupLR")
    assert r["boundaries"] == [False, True] * 4
    assert (r["global_steps"], r["micro_steps"], r["samples"]) == (4, 8, 16)
    # WarmupLR linear, N=4: lr(t) = 0.1 * t/4, t = optimizer steps taken so far - 1
    expected = []
    for micro in range(8):
        t = (micro + 1) // 2 - 1
        expected.append(0.0 if t < 0 else 0.1 * min(t / 4, 1.0))
    assert r["lrs"] == pytest.approx(expected)
    assert "inside engine.no_sync()" in r["step_in_no_sync"]
    assert r["forced_boundary"] is True
    assert sorted(sum(r["loader_batches"], [])) == [float(i) for i in range(40)]


def _loader_shards():
    dataset = torch.utils.data.TensorDataset(torch.arange(20).float())
    _, _, loader, _ = engine.initialize(model=OddMLP(), config=_cfg(), training_data=dataset)
    first = [b[0].tolist() for b in loader]
    second = [b[0].tolist() for b in loader]  # next epoch reshuffles
    return first, second, len(loader)


def test_loader_gives_each_rank_a_disjoint_shard_per_epoch():
    (a1, a2, n), (b1, b2, _) = run_distributed(_loader_shards, 2)
    assert n == 5 and all(len(batch) == 2 for batch in a1)
    assert sorted(sum(a1, []) + sum(b1, [])) == [float(i) for i in range(20)]
    assert sorted(sum(a2, []) + sum(b2, [])) == [float(i) for i in range(20)]
    assert a1 != a2


def test_a_loader_resumed_at_an_epoch_end_or_left_mid_epoch_goes_on_with_the_next_epoch():
    """engine/data.py: a checkpoint taken at an epoch's last step resumes into the next epoch (it resumed as
    an empty pass: an epoch lost, and a pipeline's repeating loader ended); a pass left with `break` makes
    the next iter() the next epoch (it replayed the same one)."""
    from engine.data import DistributedDataLoader
    dataset = torch.utils.data.TensorDataset(torch.arange(8))

    def passes(loader, n):
        return [[b[0].tolist() for b in loader] for _ in range(n)]
    whole = passes(DistributedDataLoader(dataset, 2, 0, 1, seed=1), 3)
    saved = DistributedDataLoader(dataset, 2, 0, 1, seed=1)
    list(saved)
    state = {**saved.state_dict(), "epoch": 0, "batches_in_epoch": len(saved)}  # as saved at the epoch's last step
    resumed = DistributedDataLoader(dataset, 2, 0, 1, seed=1)
    resumed.load_state_dict(state)
    assert passes(resumed, 2) == whole[1:]
    left = DistributedDataLoader(dataset, 2, 0, 1, seed=1)
    for _ in zip(range(2), left):  # two batches, then break
        pass
    assert left.state_dict() == {"epoch": 0, "batches_in_epoch": 2}
    assert passes(left, 2) == whole[1:]


def _client_objects():
    model = OddMLP()
    eng, opt, _, sched = engine.initialize(
        model=model, config={"train_batch_size": 2},
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    x, y = make_batches(1, 2)[0]
    eng.backward(eng(x, y))
    eng.step()
    return type(opt).__name__, type(sched).__name__, eng.get_lr()


def test_client_optimizer_and_scheduler_callables():
    opt, sched, lr = run_distributed(_client_objects, 1)[0]
    assert (opt, sched) == ("SGD", "StepLR") and lr == [0.25]


def test_config_from_args_and_errors(tmp_path):
    parser = engine.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed_config", str(tmp_path / "c.json")])
    assert args.deepspeed_config.endswith("c.json")
    with pytest.raises(schemas.ConfigError, match="no config"):
        engine.initialize(model=OddMLP())
    with pytest.raises(schemas.ConfigError, match="config given twice"):
        engine.initialize(args=args, model=OddMLP(), config={"train_batch_size": 1})


def test_environment_discovery(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert discover_env() is None
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[07-09,12],gpu1")
    env = discover_env()
    assert env == {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node07", "MASTER_PORT": "29500"}
    assert _first_slurm_host("single") == "single"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert discover_env()["WORLD_SIZE"] == "2"  # torchrun/dslaunch variables win over SLURM's


def test_topology_grid_is_pipe_data_model():
    topo = Topology(data=2, pipe=2, model=2)
    assert topo.world_size == 8
    assert topo.coords(5) == (1, 0, 1)
    assert topo.data_parallel_ranks(5) == [5, 7]
    assert Topology(data=4).data_parallel_ranks(2) == [0, 1, 2, 3]


def test_clipping_is_active_in_the_parity_tests():
    # test_data_parallel clips at 0.5: make sure that bound actually bites on its data.
    torch.manual_seed(0)
    model = OddMLP()
    x, y = make_batches(1, 8)[0]
    model(x, y).backward()
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None))
    assert norm > 0.5


def _breakdown():
    eng, _, _, _ = engine.initialize(model=OddMLP(), config=_cfg(wall_clock_breakdown=True,
                                                                  gradient_accumulation_steps=1))
    x, y = make_batches(1, 2)[0]
    eng.backward(eng(x, y))
    eng.step()
    return dict(eng.timers.count), {k: v > 0 for k, v in eng.timers.total_ms.items()}


def test_wall_clock_breakdown_times_each_phase():
    counts, positive = run_distributed(_breakdown, 1)[0]
    assert counts == {"forward": 1, "backward": 1, "allreduce": 1, "step": 1}
    assert all(positive.values())


def _zero_grad_and_thaw() -> dict:
    """At ZeRO 0-3, gas 2, SGD: (1) `eng.zero_grad()` after every `eng.step()` (a torch habit), with
    set_to_none true and false, against the same run without it; (2) a parameter frozen at initialize
    and unfrozen after a step."""
    from engine.utils import safe_get_full_fp32_param
    from tests.models import micro_batches
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batches = make_batches(3, 2 * 2 * world)
    out = {}
    for stage in range(4):
        cfg = _cfg(zero_optimization={"stage": stage}, zero_allow_untested_optimizer=True)
        for habit in (None, True, False):
            torch.manual_seed(0)
            eng = engine.initialize(model=OddMLP(), config=cfg)[0]
            for x, y in batches:
                for xm, ym in micro_batches(x, y, rank, world, 2):
                    eng.backward(eng(xm, ym))
                    eng.step()
                    if habit is not None:
                        eng.zero_grad(set_to_none=habit)
            out[(stage, habit)] = {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters()
                                   if p.requires_grad}
            eng.destroy()
        torch.manual_seed(0)
        model = OddMLP()
        model.l1.requires_grad_(False)
        eng = engine.initialize(model=model, config=cfg)[0]
        try:
            for step, (x, y) in enumerate(batches):
                if step == 1:
                    model.l1.requires_grad_(True)  # gradual unfreezing
                for xm, ym in micro_batches(x, y, rank, world, 2):
                    eng.backward(eng(xm, ym))
                    eng.step()
            out[(stage, "thawed")] = None
        except RuntimeError as err:
            out[(stage, "thawed")] = (str(err), eng.global_steps)
        eng.destroy()
    return out


@pytest.fixture(scope="module")
def zero_grad_runs():
    return run_distributed(_zero_grad_and_thaw, 2, timeout=300)


@pytest.mark.parametrize("stage", range(4))
def test_zero_grad_within_a_window_keeps_the_window_at_every_stage(zero_grad_runs, stage):
    for rank, result in enumerate(zero_grad_runs):
        for habit in (True, False):
            for name, want in result[(stage, None)].items():
                got = result[(stage, habit)][name]
                assert torch.equal(got, want), f"rank {rank} set_to_none={habit} {name}: {(got - want).abs().max():.3e}"


@pytest.mark.parametrize("stage", range(4))
def test_a_parameter_unfrozen_after_initialize_is_an_error_naming_it(zero_grad_runs, stage):
    for result in zero_grad_runs:
        said = result[(stage, "thawed")]
        assert said is not None, "unfreezing after initialize trained on silently"
        message, steps = said
        assert "l1.weight" in message and "before initialize()" in message and steps == 1, said
