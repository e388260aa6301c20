"""`ModuleProfile`: parameters, FLOPs and forward latency per module for the forward passes run inside
it. FLOPs come from `FlopCounterMode` (the dispatcher); latency from forward hooks (on a GPU each hook
first waits for the device, so the profiled pass is slower than an ordinary one)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_backward_flop_count, sdpa_flop_count

_aten = torch.ops.aten


def _cpu_sdpa(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# torch's registry has the CUDA attention kernels but not the one SDPA runs on a CPU, which would
# count attention as zero there; same formulas (non-causal, as torch's and the 12·L·H·Q·T term).
CPU_ATTENTION_FLOPS = {op: fn for op, fn in (
    (getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None), _cpu_sdpa),
    (getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None), _cpu_sdpa_backward),
) if op is not None and op not in flop_registry}


@dataclass
class ModuleStats:
    name: str  # qualified name, "" for the root
    type: str
    depth: int
    params: int
    flops: int = 0
    latency_s: float = 0.0
    children: list[str] = field(default_factory=list)


class ModuleProfile:
    """Context manager: `with ModuleProfile(model) as prof: model(x)`; then `prof.stats`, `prof.total_flops`.
    `ignore`: module types (exact types) treated as DeepSpeed's `ignore_modules` (`_apply_ignored`)."""

    def __init__(self, model: torch.nn.Module, ignore: tuple[type, ...] = ()):
        self.model = model
        self.ignore = tuple(ignore)
        self.stats: dict[str, ModuleStats] = {}
        for name, mod in model.named_modules():
            params = sum(p.numel() for p in mod.parameters())
            depth = 0 if not name else name.count(".") + 1
            self.stats[name] = ModuleStats(name, type(mod).__name__, depth, params)
            if name:
                self.stats[name.rpartition(".")[0]].children.append(name)
        self._sync = self._device_sync(model)
        self._hooks: list = []
        self._started: dict[str, list[float]] = {}
        self._counter = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS)

    @staticmethod
    def _device_sync(model):
        p = next(model.parameters(), None)
        if p is not None and p.device.type == "cuda":
            return lambda: torch.cuda.synchronize(p.device)
        return lambda: None

    def __enter__(self) -> "ModuleProfile":
        for name, mod in self.model.named_modules():
            self._hooks.append(mod.register_forward_pre_hook(self._pre(name)))
            self._hooks.append(mod.register_forward_hook(self._post(name)))
        self._counter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._counter.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._collect_flops()

    def _pre(self, name: str):
        def hook(_mod, _args):
            self._sync()
            self._started.setdefault(name, []).append(time.perf_counter())
        return hook

    def _post(self, name: str):
        def hook(_mod, _args, _out):
            self._sync()
            self.stats[name].latency_s += time.perf_counter() - self._started[name].pop()
        return hook

    def _collect_flops(self) -> None:
        # FlopCounterMode names modules "<RootClass>.<qualified name>"; "Global" is everything counted.
        root = type(self.model).__name__
        counts = self._counter.get_flop_counts()
        self.total_flops = sum(counts.get("Global", {}).values())
        for key, ops in counts.items():
            if key == root:
                name = ""
            elif key.startswith(root + "."):
                name = key[len(root) + 1:]
            else:
                continue
            if name in self.stats:
                self.stats[name].flops = sum(ops.values())
        self._apply_ignored()

    def _apply_ignored(self) -> None:
        """DeepSpeed 0.19's `ignore_modules`: an ignored type gets no hooks, so the operations it runs
        itself (outside its submodules) count toward its nearest profiled ancestor, and its row shows
        only its submodules' FLOPs and time; totals and parameter counts do not change. (Nothing
        profiled above an ignored root: its own operations are not counted, as DeepSpeed's.)"""
        ignored = {n for n, m in self.model.named_modules() if type(m) in self.ignore}
        if not ignored:
            return
        # FlopCounterMode's per-module counts are inclusive; move each ignored module's own share up.
        own = {n: s.flops - sum(self.stats[c].flops for c in s.children) for n, s in self.stats.items()}
        for name in ignored:
            up = name
            while up in ignored and up:
                up = up.rpartition(".")[0] if "." in up else ""
            if up not in ignored:
                own[up] += own[name]
            else:  # the root is ignored: no profiled module to count it in
                self.total_flops -= own[name]
            own[name] = 0
        for name in sorted(self.stats, key=lambda n: -self.stats[n].depth):  # children before parents
            s = self.stats[name]
            s.flops = own[name] + sum(self.stats[c].flops for c in s.children)
            if name in ignored:
                s.latency_s = sum(self.stats[c].latency_s for c in s.children)

    @property
    def total_params(self) -> int:
        return self.stats[""].params

    @property
    def forward_latency_s(self) -> float:
        return self.stats[""].latency_s
