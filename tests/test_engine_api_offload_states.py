"""engine.offload_states() / reload_states() (DeepSpeed 0.19's names): at ZeRO stages 1-3 every state
named by `include` leaves its buffer (the storage of each tensor is 0 bytes while away, its bytes in a
host buffer: the engine reports the bytes moved per state, equal to the tensors' own), a forward runs
with the optimizer's states away (the RLHF generation phase), a backward is an error naming
reload_states, and after the reload every state is back bit for bit and training continues exactly as
a run that never offloaded (fp32 at stages 1-3, bf16 at stage 2). With offload_optimizer the host's
states are left out, as DeepSpeed; stage 0, an unknown include value, device "nvme" and offload_param
are errors naming them."""
from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.models import OddMLP, make_batches, micro_batches

WORLD, STEPS = 2, 4
STATES = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")


def _config(stage: int, bf16: bool = False, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "bf16": {"enabled": bf16},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 40, **zero}}


def _states(eng) -> dict[str, list[torch.Tensor]]:
    """Each state's tensors, read from the engine's ZeRO optimizer independently of offload_states.py."""
    zopt = eng.zero_optimizer
    return {"hp_params": list(zopt.partition.flat.values()),
            "lp_params": [p.data for p in zopt.params],
            "lp_grads": list(zopt.partition.flat_grad.values()),
            "optim_states": [t for s in zopt.optimizer.state.values() for t in s.values() if torch.is_tensor(t)],
            "contiguous_grad_buffer": []}


def _nbytes(ts) -> int:
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in ts}.values())


def _run(stage: int, offload: bool, bf16: bool = False) -> dict:
    import engine
    torch.manual_seed(0)
    eng, *_ = engine.initialize(model=OddMLP(), config=_config(stage, bf16))
    rank, world = eng.comm.rank, eng.comm.world_size
    out = {}
    for step, (x, y) in enumerate(make_batches(STEPS, 2 * world)):
        (xm, ym), = micro_batches(x, y, rank, world, 1)
        if bf16:  # bf16 weights (the 16-bit lp_params; hp_params stay fp32)
            xm, ym = xm.bfloat16(), ym.bfloat16()
        if offload and step == STEPS // 2:
            before = {k: [t.detach().clone() for t in ts] for k, ts in _states(eng).items()}
            held = {k: _nbytes(ts) for k, ts in _states(eng).items()}
            out["only_optim"] = eng.offload_states(include=["optim_states"])
            out["rest"] = eng.offload_states()  # what is not away yet
            out["away_bytes"] = {k: _nbytes(ts) for k, ts in _states(eng).items()}
            with pytest.raises(RuntimeError) as err:
                eng(xm, ym)  # the parameters are away too
            out["forward_error"] = str(err.value)
            out["reload"] = eng.reload_states()
            out["held"] = held
            out["exact"] = all(torch.equal(a, b) for k, ts in _states(eng).items() for a, b in zip(ts, before[k]))
            # the RLHF pattern: optimizer state and gradients away while the model runs forward
            eng.offload_states(include=["optim_states", "lp_grads"], pin_memory=False)
            with torch.no_grad():
                out["generated"] = float(eng(xm, ym))
            with pytest.raises(RuntimeError) as err:
                eng.backward(eng(xm, ym))
            out["backward_error"] = str(err.value)
            for call in (eng.training_state_dict, lambda: eng.save_checkpoint("unused")):
                with pytest.raises(RuntimeError, match="call engine.reload_states"):
                    call()
            eng.reload_states()
        eng.backward(eng(xm, ym))
        eng.step()
    with engine.zero.GatheredParameters(list(eng.module.parameters())):
        out["params"] = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    out["optim"] = [t.clone() for t in _states(eng)["optim_states"]]
    return out


def _all():
    runs = {stage: (_run(stage, True), _run(stage, False)) for stage in (1, 2, 3)}
    runs["bf16 stage 2"] = (_run(2, True, bf16=True), _run(2, False, bf16=True))
    return runs


def test_offloaded_states_leave_their_buffers_and_come_back_exactly():
    trainable = sum(p.numel() for p in OddMLP().parameters() if p.requires_grad)
    for per_rank in run_distributed(_all, WORLD, timeout=300):
        for stage, (r, plain) in per_rank.items():
            held = r["held"]
            assert held["optim_states"] > 0 and held["hp_params"] > 0 and held["lp_grads"] > 0
            assert r["only_optim"] == {"optim_states": held["optim_states"]}
            moved = {**r["only_optim"], **r["rest"]}
            assert moved == held, stage  # every byte the states hold, and no storage counted twice
            if stage == 3:
                assert 0 < held["lp_params"] < held["hp_params"]  # the persistent parameters only
            else:  # the full trainable weights: fp32, or bf16 beside the fp32 master partition
                assert held["lp_params"] == trainable * (2 if stage == "bf16 stage 2" else 4)
            assert r["away_bytes"] == dict.fromkeys(STATES, 0)  # the buffers are freed while away
            assert r["reload"] == held
            assert r["exact"], stage
            assert "forward() while engine.offload_states() moved" in r["forward_error"]
            assert "lp_params" in r["forward_error"] and "reload_states()" in r["forward_error"]
            assert "backward() while engine.offload_states() moved optim_states, lp_grads" in r["backward_error"]
            assert r["generated"] > 0
            for n, p in r["params"].items():
                assert torch.equal(p, plain["params"][n]), f"stage {stage} {n}"
            assert all(torch.equal(a, b) for a, b in zip(r["optim"], plain["optim"]))


def _mid_window(stage: int, offload: bool) -> dict:
    """gas 2: offload after the window's first micro-step, reload, finish the window."""
    import engine
    torch.manual_seed(0)
    eng, *_ = engine.initialize(model=OddMLP(), config={**_config(stage), "gradient_accumulation_steps": 2})
    rank, world = eng.comm.rank, eng.comm.world_size
    out = {}
    for step, (x, y) in enumerate(make_batches(3, 4 * world)):
        for k, (xm, ym) in enumerate(micro_batches(x, y, rank, world, 2)):
            eng.backward(eng(xm, ym))
            eng.step()
            if offload and step == 1 and k == 0:
                window = [p.grad.clone() for p in eng.zero_optimizer.params if p.grad is not None]
                out["moved"] = eng.offload_states(include=["lp_grads"])["lp_grads"]
                out["window_bytes"] = sum(g.numel() * g.element_size() for g in window)
                out["window_away"] = _nbytes([p.grad for p in eng.zero_optimizer.params if p.grad is not None])
                eng.reload_states()
                out["window_back"] = all(torch.equal(a, p.grad) for a, p in
                                         zip(window, [p for p in eng.zero_optimizer.params if p.grad is not None]))
    out["params"] = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    return out


def _mid_windows():
    return {stage: (_mid_window(stage, True), _mid_window(stage, False)) for stage in (1, 2)}


def test_offload_inside_an_accumulation_window_moves_the_window_so_far():
    for per_rank in run_distributed(_mid_windows, WORLD, timeout=300):
        for stage, (r, plain) in per_rank.items():
            flat_grad = r["moved"] - r["window_bytes"]
            if stage == 1:  # the window's gradients wait in .grad until the boundary reduces them
                assert r["window_bytes"] > 0 and flat_grad > 0
                assert r["window_away"] == 0 and r["window_back"]
            else:  # stage 2 reduced them into the partition gradient already
                assert r["window_bytes"] == 0
            for n, p in r["params"].items():
                assert torch.equal(p, plain["params"][n]), f"stage {stage} {n}"


def _stepped_twice(stage: int):
    import engine
    torch.manual_seed(0)
    eng, *_ = engine.initialize(model=OddMLP(), config=_config(stage))
    rank, world = eng.comm.rank, eng.comm.world_size
    for x, y in make_batches(2, 2 * world):
        (xm, ym), = micro_batches(x, y, rank, world, 1)
        eng.backward(eng(xm, ym))
        eng.step()
    return eng


def _safe_gets(stage: int) -> dict:
    """engine.utils.safe_get_* while the state each reads is away (and while another one is), and after."""
    from engine.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                              safe_get_local_fp32_param, safe_get_local_optimizer_state)
    eng = _stepped_twice(stage)
    p = next(eng.module.parameters())
    calls = {"hp_params": (lambda: safe_get_full_fp32_param(p), lambda: safe_get_local_fp32_param(p)),
             "optim_states": (lambda: safe_get_full_optimizer_state(p, "exp_avg"),
                              lambda: safe_get_local_optimizer_state(p, "exp_avg")),
             "lp_grads": (lambda: safe_get_full_grad(p),)}
    before = {state: [f() for f in fs] for state, fs in calls.items()}
    out = {"errors": [], "others_read": True}
    for state, fs in calls.items():
        eng.offload_states(include=[state])
        for f in fs:
            with pytest.raises(RuntimeError) as err:
                f()
            out["errors"].append(str(err.value))
        others = [f() for other, gs in calls.items() if other != state for f in gs]  # not away: read
        out["others_read"] &= all(o is None or torch.is_tensor(o) for o in others)
        eng.reload_states()
    out["back"] = all(torch.equal(a, f()) if torch.is_tensor(a) else a == f()
                      for state, fs in calls.items() for a, f in zip(before[state], fs))
    return out


def test_safe_get_helpers_name_reload_states_while_their_state_is_away():
    for stage in (2, 3):
        r = run_distributed(_safe_gets, 1, args=(stage,), timeout=200)[0]
        assert len(r["errors"]) == 5 and r["others_read"] and r["back"], stage
        for error in r["errors"]:
            assert error.startswith("engine.utils.safe_get_") and "call engine.reload_states() first" in error, error


def _gathered_while_away() -> dict:
    """ZeRO-3: GatheredParameters while the master partition or the parameters are away, and after."""
    from engine.zero import GatheredParameters
    eng = _stepped_twice(3)
    params = list(eng.module.parameters())
    with GatheredParameters(params):
        before = [p.detach().clone() for p in params]
    out = {"errors": []}
    for state in ("hp_params", "lp_params"):
        eng.offload_states(include=[state])
        with pytest.raises(RuntimeError) as err:
            with GatheredParameters(params):
                pass
        out["errors"].append(str(err.value))
        eng.reload_states()
    with GatheredParameters(params):
        out["back"] = all(torch.equal(a, p) for a, p in zip(before, params))
    return out


def test_gathered_parameters_names_reload_states_while_the_parameters_are_away():
    for r in run_distributed(_gathered_while_away, WORLD, timeout=200):
        assert r["back"] and len(r["errors"]) == 2
        for error in r["errors"]:
            assert error.startswith("engine.zero.GatheredParameters() while engine.offload_states() moved") \
                and "call engine.reload_states() first" in error, error


def _pipe_run(offload: bool) -> dict:
    import engine
    from engine.pipe import PipelineModule
    from tests.pipe_models import global_batches, mlp_specs, mse
    pm = PipelineModule(mlp_specs(6), num_stages=2, loss_fn=mse, seed_layers=True, partition_method="uniform")
    eng, *_ = engine.initialize(model=pm, config={**_config(1), "gradient_accumulation_steps": 2})
    out = {}
    for i, (x, y) in enumerate(global_batches(4, 4, tied=False)):
        if offload and i == 2:
            out["moved"] = sum(eng.offload_states().values())
            with pytest.raises(RuntimeError) as err:
                eng.eval_batch(iter(list(micro_batches(x, y, 0, 1, 2))))
            out["eval_error"] = str(err.value)
            with pytest.raises(RuntimeError) as err:
                eng.train_batch(iter(list(micro_batches(x, y, 0, 1, 2))))
            out["error"] = str(err.value)
            eng.reload_states()
        eng.train_batch(iter(list(micro_batches(x, y, 0, 1, 2))))
    out["params"] = {n: p.detach().clone() for n, p in pm.named_parameters()}
    return out


def _pipe_runs():
    return _pipe_run(True), _pipe_run(False)


def test_pipeline_engine_offloads_and_refuses_train_and_eval_batch_until_reloaded():
    for r, plain in run_distributed(_pipe_runs, WORLD, timeout=300):
        assert r["moved"] > 0
        assert "engine.train_batch() while engine.offload_states() moved" in r["error"]
        assert "engine.eval_batch() while engine.offload_states() moved" in r["eval_error"]
        for n, p in r["params"].items():
            assert torch.equal(p, plain["params"][n]), n


def _errors() -> dict:
    import engine
    out = {}
    eng, *_ = engine.initialize(model=OddMLP(), config=_config(0))
    with pytest.raises(RuntimeError) as err:
        eng.offload_states()
    out["stage0"] = str(err.value)
    eng, *_ = engine.initialize(model=OddMLP(), config=_config(2))
    for kwargs in ({"include": ["optim_states", "master_weights"]}, {"device": "nvme"}, {"device": "gpu"}):
        with pytest.raises(ValueError) as err:
            eng.offload_states(**kwargs)
        out[str(kwargs)] = str(err.value)
    # offload_optimizer "cpu": master weights and optimizer state live on the host already (DeepSpeed)
    eng, *_ = engine.initialize(model=OddMLP(), config=_config(2, offload_optimizer={"device": "cpu"}))
    (x, y), = make_batches(1, 2)
    eng.backward(eng(x, y))
    eng.step()
    out["cpu_optimizer"] = sorted(eng.offload_states())
    eng.reload_states()
    eng, *_ = engine.initialize(model=OddMLP(), config=_config(3, offload_param={"device": "cpu"}))
    with pytest.raises(RuntimeError) as err:
        eng.offload_states()
    out["offload_param"] = str(err.value)
    return out


def test_unsupported_stage_include_and_device_are_errors():
    r = run_distributed(_errors, 1, timeout=120)[0]
    assert "needs ZeRO stage 1, 2 or 3" in r["stage0"] and "zero_optimization.stage 0" in r["stage0"]
    assert "include value 'master_weights' is not one of 'optim_states'" in r[str({"include": ["optim_states",
                                                                                               "master_weights"]})]
    assert "device \"nvme\" is not supported" in r[str({"device": "nvme"})]
    assert "device 'gpu' is not one of 'none', 'cpu', 'nvme'" in r[str({"device": "gpu"})]
    assert r["cpu_optimizer"] == ["contiguous_grad_buffer", "lp_grads", "lp_params"]
    assert "with zero_optimization.offload_param is not supported" in r["offload_param"]


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
