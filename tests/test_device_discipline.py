"""Every tensor that reaches a collective names its device (DESIGN decision 9; engine/comm.py's note).

On CPU with gloo a buffer made without a device lands on the CPU by luck and works; under NCCL it is a
failed step. So the multi-process run here sets `torch.set_default_device("meta")` once the model is
built: from then on any allocation that does not name its device lands on `meta`, and the
communicator's device check (or the first op on it) fails, naming the call site. It covers ZeRO 1-3,
`zero.Init` (its model names its devices, so only dstrain's own allocations are on trial),
`GatheredParameters`, `save_16bit_model`, checkpoint save (sync and async) and load, with stage 0 in
bf16 (master weights) and stage 3 in fp16 (loss scaler) among them. SGD, because
torch's Adam creates its `step` counters without a device (torch's convention, not ours).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import engine
from engine.comm import Communicator, DeviceMismatchError
from tests.harness import run_distributed
from tests.models import make_batches


class Explicit(nn.Module):
    """Every parameter made on a named device, so the default device does not reach it."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(13, 24, device="cpu")
        self.mid = nn.Linear(24, 24, device="cpu")
        self.bias = nn.Parameter(torch.zeros(1, device="cpu"))  # a 1-element, persistent at stage 3
        self.out = nn.Linear(24, 5, device="cpu")

    def forward(self, x, y):
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        return nn.functional.mse_loss(self.out(h) + self.bias, y)


def _config(stage: int, async_save: bool = False, precision: dict | None = None) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 300}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=2, stage3_prefetch_bucket_size=400,
                    stage3_max_reuse_distance=0, stage3_gather_16bit_weights_on_model_save=True)
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
            "zero_allow_untested_optimizer": True,
            "zero_optimization": zero, "checkpoint": {"async_save": async_save}, **(precision or {})}


def _train_on_meta(root: str, stage: int, zero_init: bool, async_save: bool, precision=None) -> list[float]:
    torch.manual_seed(0)
    cfg = _config(stage, async_save, precision)
    dtype = torch.bfloat16 if "bf16" in (precision or {}) else torch.float16 if precision else torch.float32
    batches = [(x.to(dtype), y.to(dtype)) for x, y in make_batches(4, 4)]
    rank = torch.distributed.get_rank()
    if zero_init:
        torch.set_default_device("meta")  # zero.Init's own allocations are on trial too
        with engine.zero.Init(config=cfg):
            model = Explicit()
    else:
        model = Explicit()
        torch.set_default_device("meta")
    try:
        eng, _, _, _ = engine.initialize(model=model, config=cfg)
        losses = []
        for x, y in batches[:2]:
            xs, ys = x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]
            loss = eng(xs, ys)
            eng.backward(loss)
            eng.step()
            losses.append(float(loss))
        eng.save_checkpoint(f"{root}/s{stage}-{zero_init}-{async_save}")
        eng.wait_for_checkpoint()
        eng.load_checkpoint(f"{root}/s{stage}-{zero_init}-{async_save}")
        if stage == 3:
            with engine.zero.GatheredParameters(list(eng.module.parameters()), modifier_rank=0):
                pass
            eng.save_16bit_model(f"{root}/16bit-{zero_init}")
        x, y = batches[2]
        eng.backward(eng(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]))
        eng.step()
        return losses
    finally:
        torch.set_default_device("cpu")


def _cases(root: str) -> list:
    cases = [(0, False, False, {"bf16": {"enabled": True}}), (1, False, False), (2, False, True),
             (3, False, False, {"fp16": {"enabled": True}}), (3, True, True)]
    return [_train_on_meta(root, *case) for case in cases]


def test_no_collective_buffer_without_a_device(tmp_path):
    """ZeRO 1-3, zero.Init and checkpoints with `meta` as the default device: nothing lands there."""
    results = run_distributed(_cases, 2, args=(str(tmp_path),), timeout=150)
    for rank_cases in results:  # every case ran to its end on every rank, with finite losses
        assert len(rank_cases) == 5
        assert all(len(losses) == 2 and all(abs(v) < 1e3 for v in losses) for losses in rank_cases)


def test_communicator_refuses_a_tensor_on_another_device_and_names_the_call_site():
    comm = Communicator(device="cpu")
    with pytest.raises(DeviceMismatchError) as info:
        comm.all_reduce(torch.zeros(3, device="meta"))  # the line the message must name
    line = test_communicator_refuses_a_tensor_on_another_device_and_names_the_call_site.__code__.co_firstlineno + 3
    assert f"test_device_discipline.py:{line}" in str(info.value), str(info.value)
    assert "meta" in str(info.value) and "cpu" in str(info.value)
    out = torch.empty(2)
    for call in (lambda: comm.all_gather(out, torch.zeros(1, device="meta")),
                 lambda: comm.reduce_scatter(torch.zeros(1, device="meta"), out),
                 lambda: comm.broadcast(torch.zeros(1, device="meta")),
                 lambda: comm.all_to_all(out, torch.zeros(2, device="meta"))):
        with pytest.raises(DeviceMismatchError):
            call()
    comm.all_reduce(torch.zeros(3))  # its own device passes
    assert comm.zeros(2).device == comm.empty(2).device == comm.tensor([1]).device == torch.device("cpu")


# -- process set-up (engine/dist.py): torch.cuda's answers stand in for a GPU machine ----------------
@pytest.mark.parametrize("local_rank, visible, expected", [(2, 4, 2), (3, 1, 0), (0, 1, 0)])
def test_each_rank_binds_its_local_gpu_or_the_only_one_it_sees(monkeypatch, local_rank, visible, expected):
    from engine.dist import local_device_index
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    assert local_device_index() == expected


def test_local_rank_beyond_the_visible_gpus_is_one_clear_error(monkeypatch):
    from engine.dist import local_device_index
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=5, but this process sees 4 CUDA devices .*--gpus-per-task=1"):
        local_device_index()


def test_device_is_bound_when_the_user_created_the_process_group(monkeypatch):
    import torch.distributed as dist
    from engine.dist import init_distributed
    bound = []
    monkeypatch.setenv("DSTRAIN_DEVICE", "cuda")  # gloo with CUDA tensors: the path a CPU can take
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        init_distributed()  # already initialised: only binds
    finally:
        dist.destroy_process_group()
    assert bound == [1]


def test_cuda_rng_state_is_this_ranks_own_device(monkeypatch):
    from engine.checkpoint.state import _own_cuda_state
    states = [torch.tensor([0]), torch.tensor([1])]  # a checkpoint from before: every visible device's
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert _own_cuda_state(states) is states[1]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # resumed where it sees fewer GPUs
    assert _own_cuda_state(states) is states[1]
    assert _own_cuda_state(states[0]) is states[0]  # this rank's own, as saved now


class _OneRank:
    world_size = 1

    def all_reduce(self, tensor):
        pass


def test_powersgd_reads_nothing_back_from_a_device():
    """On a device tensor (meta here: reading its values raises) PowerSGD's non-finite reset runs as
    device ops; a host read per bucket would raise."""
    from ops.powersgd import PowerSGD
    psgd = PowerSGD(_OneRank(), rank=2, start_step=0)
    flat = torch.empty(40 * 30 + 7, device="meta")
    psgd.reduce_(0, flat, [torch.Size([40, 30]), torch.Size([7])])
    assert psgd._qs[0][0].device.type == "meta"


def test_loaded_step_counters_stay_where_torch_keeps_them():
    """A resumed torch Adam keeps `step` on the host (else its bias correction reads it back every step)
    unless fused/capturable, where it lives with the parameter; moments always with the parameter."""
    from engine.checkpoint.state import state_device
    p, q = (torch.nn.Parameter(torch.empty(3, device="meta")) for _ in range(2))
    opt = torch.optim.Adam([{"params": [p]}, {"params": [q], "capturable": True}])
    assert state_device(opt, p, "step", rows=False) == torch.device("cpu")
    assert state_device(opt, q, "step", rows=False) == torch.device("meta")
    assert state_device(opt, p, "exp_avg", rows=True) == torch.device("meta")
