"""`engine.offload_states()` / `engine.reload_states()` (DeepSpeed 0.19's names and arguments): free
accelerator memory between phases (an RLHF loop offloads the trainer's optimizer states while another
model generates), then bring the states back bit for bit.

States, by DeepSpeed's `OffloadStateTypeEnum`, as dstrain's ZeRO optimizers hold them (stages 1-3, as
DeepSpeed: its stage 0 optimizers have no such method):
- "hp_params": the fp32 master partition flats (at stage 3 also what the parameter gathers read);
- "lp_params": the trainable parameters' own storage (stages 1-2: the full model weights; stage 3: the
  persistent parameters; the gathered ones are released first, `empty_partition_cache`, as DeepSpeed);
- "lp_grads": the fp32 gradient partition flats, and inside an accumulation window the gradients it
  accumulated so far (stage 1 keeps them in `.grad` until the boundary);
- "optim_states": the optimizer's state tensors (exp_avg, ...);
- "contiguous_grad_buffer": the reduce buckets' send buffers; dstrain drops each one when its
  reduction finished (zero/partitioned.py's note: freeing), so between steps there is none to move.
As DeepSpeed, with `offload_optimizer` on "cpu"/"nvme" the master weights and optimizer state already
live on the host and are left out (at stage 3 the gradients too); `offload_param` is refused.

[Note: moved by storage] Each distinct storage is copied to a host buffer (page-locked when `pin_memory`
and the engine runs on an accelerator, so the copy can be asynchronous) and then resized to 0 bytes:
the accelerator memory is freed while every tensor, view and slot that refers to it (the buckets'
gradient slots, the optimizer's keys, the parameters) stays the same Python object. Reloading resizes
the storage back and copies the bytes in, so nothing needs re-linking (DeepSpeed re-points `.data` and
rebuilds its links instead). On a CPU-only machine the engine's device is the host: the same copies
run, which is what the tests observe (storage bytes 0 while offloaded, bytes moved, exact values).
While a state is away, the calls that would read it are errors naming `reload_states`.
"""
from __future__ import annotations

import warnings
from enum import Enum

import torch


class OffloadStateTypeEnum(str, Enum):
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class OffloadDeviceEnum(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


def _parse(enum, value, what: str):
    try:
        return enum(value.value if isinstance(value, Enum) else value)
    except ValueError:
        raise ValueError(f"engine.offload_states(): {what} {value!r} is not one of "
                         f"{', '.join(repr(e.value) for e in enum)}") from None


def _tensors(zopt, state: OffloadStateTypeEnum) -> list[torch.Tensor]:
    if state is OffloadStateTypeEnum.hp_params:
        return [f.detach() for f in zopt.partition.flat.values()]
    if state is OffloadStateTypeEnum.lp_params:
        return [p.data for p in zopt.params]
    if state is OffloadStateTypeEnum.lp_grads:  # and, inside an accumulation window, the window so far
        window = [p.grad for p in zopt.params if p.grad is not None] + list(getattr(zopt, "_accum", {}).values())
        return [g for g in zopt.partition.flat_grad.values() if not g.is_meta] + window
    if state is OffloadStateTypeEnum.optim_states:
        return [t for s in zopt.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return [b.send for b in zopt.buckets if b.send is not None]


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class OffloadedStates:
    """What `offload_states` moved, per state: (storage, host copy) pairs (module note)."""

    def __init__(self, eng):
        self.eng = eng
        if eng.zero_optimizer is not None:  # safe_get_* reach the engine's states through their owner
            eng.zero_optimizer.offloaded_states = self  # (engine/utils.py)
        self.moved: dict[OffloadStateTypeEnum, list[tuple[torch.UntypedStorage, torch.Tensor]]] = {}
        self._storages: set[int] = set()  # storages moved under any state (a storage is moved once)

    def _refine(self, include) -> list[OffloadStateTypeEnum]:
        eng = self.eng
        zopt = eng.zero_optimizer
        stage = eng.config.zero_optimization.stage
        if zopt is None or stage == 0:
            raise RuntimeError(f"engine.offload_states() needs ZeRO stage 1, 2 or 3 (as DeepSpeed 0.19); this engine "
                               f"has {'no optimizer' if zopt is None else 'zero_optimization.stage 0'}")
        zero = eng.config.zero_optimization
        if zero.offload_param is not None and zero.offload_param.device != "none":
            raise RuntimeError("engine.offload_states() with zero_optimization.offload_param is not supported (as in "
                               "DeepSpeed): the parameters already live off the device; remove offload_param")
        states = list(OffloadStateTypeEnum) if include is None else [
            _parse(OffloadStateTypeEnum, s, "include value") for s in include]
        if zero.offload_optimizer is not None and zero.offload_optimizer.device in ("cpu", "nvme"):
            on_host = {OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states}
            if stage == 3:
                on_host.add(OffloadStateTypeEnum.lp_grads)
            states = [s for s in states if s not in on_host]  # already on the host (DeepSpeed leaves them)
        return states

    def offload(self, include, device, pin_memory: bool, non_blocking: bool) -> dict[str, int]:
        device = _parse(OffloadDeviceEnum, device, "device")
        if device is OffloadDeviceEnum.nvme:
            raise ValueError("engine.offload_states(): device \"nvme\" is not supported (as in DeepSpeed); use \"cpu\"")
        states = self._refine(include)
        if device is OffloadDeviceEnum.none:
            warnings.warn("engine.offload_states(device=\"none\"): nothing is moved", stacklevel=3)
            return {}
        eng = self.eng
        eng.empty_partition_cache()  # stage 3: the gathered parameters are released, not moved
        pin = pin_memory and eng.device.type != "cpu"  # page-locked memory exists next to an accelerator only
        report = {}
        for state in states:
            if state in self.moved:
                continue  # already away (DeepSpeed skips it too)
            pairs = []
            for t in _tensors(eng.zero_optimizer, state):
                storage = t.untyped_storage()
                if storage._cdata in self._storages or storage.nbytes() == 0 or t.device != eng.device:
                    continue
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
                host.copy_(_bytes_of(storage), non_blocking=non_blocking and pin)
                storage.resize_(0)  # stream-ordered on an accelerator: freed after the copy read it
                self._storages.add(storage._cdata)
                pairs.append((storage, host))
            self.moved[state] = pairs
            report[state.value] = sum(h.numel() for _, h in pairs)
        if not non_blocking and eng.device.type == "cuda":
            torch.cuda.synchronize(eng.device)
        return report

    def reload(self, non_blocking: bool) -> dict[str, int]:
        report = {}
        for state, pairs in self.moved.items():
            for storage, host in pairs:
                storage.resize_(host.numel())
                _bytes_of(storage).copy_(host, non_blocking=non_blocking and host.is_pinned())
                self._storages.discard(storage._cdata)
            report[state.value] = sum(h.numel() for _, h in pairs)
        self.moved.clear()
        if not non_blocking and self.eng.device.type == "cuda":
            torch.cuda.synchronize(self.eng.device)
        return report

    def require(self, call: str, needed: tuple[OffloadStateTypeEnum, ...] | None = None,
                owner: str = "engine.") -> None:
        """`call` reads states: an error naming them while they are away (`needed` None: every state)."""
        away = [s.value for s, pairs in self.moved.items() if pairs and (needed is None or s in needed)]
        if away:
            raise RuntimeError(f"{owner}{call}() while engine.offload_states() moved {', '.join(away)} off the "
                               "device; call engine.reload_states() first")

    def require_for_forward(self, call: str = "forward") -> None:
        """A forward (`call`: a pipeline's eval_batch) reads the parameters; at stage 3 its gathers read
        the master partition."""
        needed = (OffloadStateTypeEnum.lp_params,)
        if self.eng.config.zero_optimization.stage == 3:
            needed += (OffloadStateTypeEnum.hp_params,)
        self.require(call, needed)
