"""Which optimizer state is per element, per tensor or scalar is the optimizer class's declaration
(ops/state_layout.py), used by the NVMe swap files, the partitions' state queries and checkpoints;
nothing is decided by comparing a state tensor's shape with its parameter's.

Oracles: an optimizer whose per-tensor state has, by coincidence, the shape of the tensor NVMe probes
the layout with is refused by name (a shape rule would swap it per element, cutting it into
sub-groups); one whose state changes set after the first step (a per-element key made at step 2,
which a probe of one step cannot see) is an error naming the key, not state silently dropped; at
ZeRO stage >= 1 (with CPU offload) an undeclared client optimizer, and one whose declared per-tensor
state the stage would cut into chunks, are refused at initialize naming the class; at stage 0, where
ranks hold whole tensors, undeclared state is saved whole, whatever its shape; and a checkpoint
refuses state whose shape is not its declared kind's. Every case but the engine's fails with main's
shape rule (run against main's code with this file and ops/state_layout.py added). The engine cases
run in tests/optimizer_runs.py's 2-rank spawn.
"""
from __future__ import annotations

import pytest
import torch

import engine
import schemas
from engine.checkpoint.state_layout import state_layout
from ops.state_layout import ELEMENTWISE, PER_TENSOR, SCALAR, StateLayoutError
from tests import optimizer_runs
from tests.test_offload_stepper import Swapped

HISTORY = 7  # the NVMe layout probe's parameter has 7 elements: equal by coincidence


class LrHistorySGD(torch.optim.SGD):
    """SGD that keeps, per tensor, the last HISTORY learning rates it used: per tensor, not per element."""

    STATE_LAYOUT = {"momentum_buffer": ELEMENTWISE, "lr_history": PER_TENSOR}

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                history = self.state[p].setdefault("lr_history", torch.zeros(HISTORY, device=p.device))
                history.copy_(history.roll(1)).index_fill_(0, torch.tensor([0], device=p.device), group["lr"])


class LateAverageSGD(torch.optim.SGD):
    """SGD that starts a per-element running average of its weights at its second step."""

    STATE_LAYOUT = {"momentum_buffer": ELEMENTWISE, "weight_average": ELEMENTWISE, "steps_seen": SCALAR}

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["steps_seen"] = state.get("steps_seen", 0) + 1
                if state["steps_seen"] >= 2:
                    state.setdefault("weight_average", p.detach().clone()).lerp_(p, 0.5)


class UndeclaredSGD(torch.optim.Optimizer):
    """A client optimizer of its own class, with no STATE_LAYOUT."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("velocity", torch.zeros_like(p))
                    buf.mul_(0.9).add_(p.grad)
                    p.sub_(buf, alpha=group["lr"])


def test_per_tensor_state_shaped_like_the_probe_is_refused_by_name(tmp_path):
    make = lambda params: LrHistorySGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    with pytest.raises(StateLayoutError) as refused:
        Swapped(tmp_path, make, numel=300, sub_group=128)
    assert "LrHistorySGD" in str(refused.value) and "'lr_history'" in str(refused.value)
    assert "per tensor" in str(refused.value)


def test_state_made_after_the_first_step_is_an_error_naming_it_not_dropped(tmp_path):
    swapped = Swapped(tmp_path, lambda params: LateAverageSGD(params, lr=0.1, momentum=0.9), numel=300, sub_group=128)
    try:
        master, grad = torch.ones(300, device="cpu"), torch.ones(300, device="cpu")
        swapped.part.initialize(lambda s, e: master[s:e])
        swapped.step(grad)
        with pytest.raises(StateLayoutError, match=r"LateAverageSGD made state \['weight_average'\] after"):
            swapped.step(grad)
    finally:
        swapped.close()


def test_undeclared_state_is_saved_whole_at_stage_0_whatever_its_shape():
    p = torch.nn.Parameter(torch.zeros(5, device="cpu"))
    optimizer = UndeclaredSGD([p])
    p.grad = torch.ones(5, device="cpu")
    optimizer.step()
    assert state_layout(optimizer) == {"velocity": PER_TENSOR}  # shaped like p, and still not cut into rows


class MisdeclaredSGD(UndeclaredSGD):
    """Declares its per-element velocity a scalar."""

    STATE_LAYOUT = {"velocity": SCALAR}


def test_a_checkpoint_refuses_state_of_another_shape_than_declared():
    p = torch.nn.Parameter(torch.zeros(5, device="cpu"))
    optimizer = MisdeclaredSGD([p])
    p.grad = torch.ones(5, device="cpu")
    optimizer.step()
    with pytest.raises(StateLayoutError, match=r"MisdeclaredSGD's state 'velocity' is declared scalar but has shape"):
        state_layout(optimizer)


def _refusal(optimizer_class) -> list[str] | None:
    from tests.test_optimizer_set import Net, _config
    model, cfg = Net(), _config("RMSprop", 1, 1, "cpu")  # RMSprop's config: zero_allow_untested_optimizer
    del cfg["optimizer"]
    try:
        engine.initialize(model=model, optimizer=optimizer_class(model.parameters(), lr=0.1), config=cfg)
    except schemas.ConfigError as error:
        return error.problems
    return None


def _refusals() -> dict:
    """ZeRO stage 1 with CPU offload, in optimizer_runs' 2-rank spawn: an undeclared client optimizer,
    and one whose declared per-tensor state the stage would cut into chunks."""
    return {"undeclared": _refusal(UndeclaredSGD), "per_tensor": _refusal(LrHistorySGD)}


def test_an_undeclared_optimizer_is_refused_at_stage_1_by_name():
    for rank, problems in enumerate(optimizer_runs.part(2, "layout_refusals")):
        assert problems["undeclared"] == [
            "optimizer UndeclaredSGD declares no state layout, so zero_optimization.stage 1 cannot tell which of "
            "its state is per element; set UndeclaredSGD.STATE_LAYOUT = {state key: 'elementwise', 'scalar'} for "
            "every key its step creates"], f"rank {rank}: {problems}"


def test_per_tensor_state_is_refused_at_stage_1_at_initialize_by_name():
    """A probe step at initialize sees the state: never run per chunk (which main's stages did silently)."""
    for rank, problems in enumerate(optimizer_runs.part(2, "layout_refusals")):
        assert problems["per_tensor"] == [
            "zero_optimization.stage 1: optimizer LrHistorySGD's state ['lr_history'] is per tensor, and ZeRO hands "
            "the optimizer dim-0 chunks of each tensor; use zero_optimization.stage 0"], f"rank {rank}: {problems}"
