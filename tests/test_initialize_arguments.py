"""initialize()'s and zero.Init's DeepSpeed arguments either act or are refused, never dropped: the
rendezvous port, dist_init_required, config_overrides, the seed, dump_state, zero.Init's keywords,
and load_checkpoint's param-group hyperparameters."""
from __future__ import annotations

import os
import random
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import engine
import schemas
from tests.harness import free_port, run_distributed
from tests.models import OddMLP

CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}


def _port_is_used_for_the_rendezvous(port: int):
    dist.destroy_process_group()  # the harness initialised one; start as a fresh script would
    os.environ.pop("MASTER_PORT")
    engine.initialize(model=OddMLP(), config=CFG, distributed_port=port)
    return os.environ["MASTER_PORT"], dist.is_initialized()


def test_distributed_port_is_the_rendezvous_port_when_the_environment_has_none():
    port = free_port()
    assert run_distributed(_port_is_used_for_the_rendezvous, 1, args=(port,))[0] == (str(port), True)


def _port_that_cannot_apply():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.initialize(model=OddMLP(), config=CFG, distributed_port=1, dist_init_required=False)
    return [str(w.message) for w in caught]


def test_a_port_that_cannot_apply_says_so():
    messages = run_distributed(_port_that_cannot_apply, 1)[0]
    assert any("initialize(distributed_port=1) has no effect: the process group is already initialized" in m
               for m in messages), messages


def _refusals_before_any_process_group():
    dist.destroy_process_group()  # as a script that never initialised torch.distributed
    messages = []
    for kwargs in ({"dist_init_required": False}, {"distributed_port": 70000}):
        try:
            engine.initialize(model=OddMLP(), config=CFG, **kwargs)
        except (RuntimeError, ValueError) as err:
            messages.append(str(err))
    initialized = dist.is_initialized()
    engine.init_distributed()  # the harness tears a group down after this function
    return messages, initialized


def test_dist_init_required_false_needs_an_initialized_group_and_ports_are_checked():
    messages, initialized = run_distributed(_refusals_before_any_process_group, 1)[0]
    assert not initialized and len(messages) == 2
    assert "initialize(dist_init_required=False), but torch.distributed is not initialized" in messages[0]
    assert messages[1] == "distributed_port: 70000 is not a TCP port (1-65535)"


def _seeded_draws(seed: int):
    engine.initialize(model=OddMLP(), config={**CFG, "seed": seed})
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_seed_seeds_python_numpy_and_torch():
    first, again, other = (run_distributed(_seeded_draws, 1, args=(s,))[0] for s in (7, 7, 8))
    assert first == again
    assert all(a != b for a, b in zip(first, other))
    random.seed(7), np.random.seed(7), torch.manual_seed(7)  # rank 0: seed + 0
    assert first == (random.random(), float(np.random.rand()), float(torch.rand(1)))


def _dump_state_and_overrides():
    eng, opt, _, _ = engine.initialize(model=OddMLP(), config={**CFG, "dump_state": True, "gradient_clipping": "auto",
                                                               "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
                                       config_overrides={"gradient_clipping": 0.5, "optimizer.params.lr": 3e-4})
    return eng.config.gradient_clipping, opt.param_groups[0]["lr"]


def test_dump_state_prints_the_resolved_config_and_overrides_fill_auto(capfd):
    assert run_distributed(_dump_state_and_overrides, 1)[0] == (0.5, 3e-4)
    out = capfd.readouterr().out
    assert '[dstrain] config: {' in out and '"gradient_clipping": 0.5' in out and '"dump_state": true' in out


def _zero_init_arguments():
    refused = []
    # remote_device "cpu" and "nvme" and pin_memory are built (tests/test_offload_parity.py,
    # tests/test_offload_param_nvme.py); "nvme" with a config that keeps parameters off NVMe is a config
    # error naming the key, an unknown device is refused by name.
    try:
        engine.zero.Init(config=CFG, remote_device="nvme")
    except schemas.ConfigError as err:
        refused.append(str(err))
    for kwargs in ({"remote_device": "tape"}, {"mpu": object()},
                   {"zero_param_parallel_group": object()}, {"zero_quantized_weights": True},
                   {"zero_quantized_nontrainable_weights": True}, {"sequence_data_parallel_group": object()},
                   {"param_swapper": object()}):
        try:
            engine.zero.Init(config=CFG, **kwargs)
        except NotImplementedError as err:
            refused.append(str(err))
    try:
        engine.zero.Init(config=CFG, remote_devise="cpu")
    except TypeError as err:
        refused.append(str(err))
    with engine.zero.Init(config=CFG, remote_device="none", pin_memory=False, mem_efficient_linear=False):
        layer = torch.nn.Linear(4, 4)
    return refused, tuple(layer.weight.ds_shape)


def test_zero_init_refuses_what_is_not_built_and_unknown_keywords():
    refused, shape = run_distributed(_zero_init_arguments, 1)[0]
    assert len(refused) == 9 and shape == (4, 4)
    assert "zero_optimization.offload_param.device" in refused[0], refused[0]
    assert refused[1].startswith("engine.zero.Init: remote_device='tape'"), refused[1]
    assert "unexpected keyword argument 'remote_devise'" in refused[-1]


def _two_groups(model):
    return [{"params": [model.l1.weight, model.l1.bias]},
            {"params": [p for n, p in model.named_parameters() if not n.startswith("l1.")]}]


def _load_with_other_param_groups(root: str):
    model = OddMLP()
    eng, *_ = engine.initialize(model=model, model_parameters=_two_groups(model), config=CFG)
    eng.optimizer.param_groups[0]["lr"] = 0.5
    eng.save_checkpoint(root)
    one = OddMLP()
    fresh, *_ = engine.initialize(model=one, model_parameters=one.parameters(), config=CFG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.load_checkpoint(root)
    two = OddMLP()
    same, *_ = engine.initialize(model=two, model_parameters=_two_groups(two), config=CFG)
    same.load_checkpoint(root)
    return [str(w.message) for w in caught], fresh.optimizer.param_groups[0]["lr"], same.optimizer.param_groups[0]["lr"]


def test_load_checkpoint_says_when_param_groups_cannot_be_restored():
    with tempfile.TemporaryDirectory() as root:
        messages, fresh_lr, same_lr = run_distributed(_load_with_other_param_groups, 1, args=(str(Path(root)),))[0]
    assert (fresh_lr, same_lr) == (0.01, 0.5)
    assert any("the checkpoint has 2 optimizer param groups, the engine 1" in m for m in messages), messages
