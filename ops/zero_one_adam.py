"""0/1 Adam (Lu et al., arXiv:2202.06009, Algorithm 1; DeepSpeed's `ZeroOneAdam`).

Two ideas on top of 1-bit Adam, both driven by step counts:
- Adaptive variance freezing. Up to `var_freeze_step`, v is updated only at steps t in T_v, where the
  interval between updates doubles every `var_update_scaler` updates (k_{j+1} − k_j = 2^⌊j/κ⌋, κ =
  var_update_scaler). At those steps the engine all-reduces gradients at full precision; at the other
  steps the local gradient is averaged with the 1-bit all-reduce and only m is updated.
- 1-bit sync with local steps. After `var_freeze_step`, v is fixed and ranks take local Adam steps
  with their own gradients, accumulating u = −Σ lr·update. Every H steps they synchronise: undo the
  local steps, average u·(√v̂+ε) (= −Σ lr·m̂) with the 1-bit all-reduce, set m from it (m̂ = −ū/Σlr),
  and apply the averaged displacement ū/(√v̂+ε). H starts at 1 and doubles every `local_step_scaler`
  steps, up to `local_step_clipper` (H in the paper).
The error buffers are zeroed when local steps begin: before, they hold gradient residuals; after,
residuals of accumulated momentum (DeepSpeed does the same).

[Note: bias correction] As in `ops.onebit_adam`: m̂ = m/(1−β1^t), v̂ = v/(1−β2^k) with k the number of
variance updates, so the first `var_update_scaler` steps (interval 1) are exactly AdamW.
"""
from __future__ import annotations

import torch

from .compressed_optimizer import CompressedOptimizer, host_copy
from .moments import adam_denominator


class ZeroOneAdam(CompressedOptimizer):
    """Adam with adaptive variance freezing and 1-bit synchronisation with local steps."""

    _counters = ("step_count", "var_interval", "var_counter", "var_updates", "local_interval", "local_counter")

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 var_freeze_step: int = 100000, var_update_scaler: int = 16, local_step_scaler: int = 32678,
                 local_step_clipper: int = 16, bias_correction: bool = True, amsgrad: bool = False,
                 cuda_aware: bool = False, comm_backend_name: str = "nccl", comm=None, block_size: int = 256):
        if amsgrad:
            raise ValueError("0/1 Adam does not support amsgrad (the variance is frozen)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults, comm, block_size)
        self.var_freeze_step, self.var_update_scaler = int(var_freeze_step), int(var_update_scaler)
        self.local_step_scaler, self.local_step_clipper = int(local_step_scaler), int(local_step_clipper)
        self.cuda_aware, self.comm_backend_name = cuda_aware, comm_backend_name
        self.var_interval, self.var_counter, self.var_updates = 1, 0, 0
        self.local_interval, self.local_counter = 1, 0
        # √v̂ + ε changes only when v does (variance steps): kept between them, not checkpointed.
        self._denominators: dict[torch.Tensor, torch.Tensor] = {}
        self._scratch: torch.Tensor | None = None  # one parameter's update, reused (no fresh pages per step)

    def needs_gradient_all_reduce(self) -> bool:
        """Full-precision gradients only for the coming step's variance update (t ∈ T_v)."""
        nxt = self.step_count + 1
        return nxt <= self.var_freeze_step and nxt % self.var_interval == 0

    def _entries(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                    state["momentum_accumulator"] = torch.zeros_like(p)  # u of the paper
                    state["lr_sum"] = 0.0
                yield group, p, state

    def _bias(self, group) -> tuple[float, float]:
        beta1, beta2 = group["betas"]
        if not group["bias_correction"]:
            return 1.0, 1.0
        return 1 - beta1 ** self.step_count, 1 - beta2 ** max(self.var_updates, 1)

    def _update(self) -> None:
        entries = list(self._entries())
        if self.step_count <= self.var_freeze_step:
            self._variance_phase_step(entries)
        else:
            if self.step_count == self.var_freeze_step + 1:
                self.reset_errors()
            self._local_phase_step(entries)

    def _denominator(self, group, p, state) -> torch.Tensor:
        """√v̂ + ε of `p`, computed once per variance update."""
        denom = self._denominators.get(p)
        if denom is None:
            denom = self._denominators[p] = adam_denominator(state["exp_avg_sq"], self._bias(group)[1], group["eps"])
        return denom

    def _variance_phase_step(self, entries) -> None:
        var_step = self.step_count % self.var_interval == 0
        if not var_step:  # the engine left the gradients local: average them compressed
            self.compressed_average_([p.grad for _, p, _ in entries])
        else:
            self.var_updates += 1
            self._denominators = {}
        for group, p, state in entries:
            beta1, beta2 = group["betas"]
            state["exp_avg"].lerp_(p.grad, 1 - beta1)
            if var_step:
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            bc1, _ = self._bias(group)
            if group["weight_decay"]:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            p.addcdiv_(state["exp_avg"], self._denominator(group, p, state), value=-group["lr"] / bc1)
        if var_step:
            self.var_counter += 1
            if self.var_counter == self.var_update_scaler:
                self.var_counter, self.var_interval = 0, self.var_interval * 2

    def _update_buffer(self, p) -> torch.Tensor:
        if self._scratch is None or self._scratch.numel() < p.numel() or self._scratch.device != p.device:
            self._scratch = torch.empty(max(q.numel() for g in self.param_groups for q in g["params"]),
                                        device=p.device)
        return self._scratch[:p.numel()].view_as(p)

    def _local_phase_step(self, entries) -> None:
        denoms = []
        for group, p, state in entries:
            beta1 = group["betas"][0]
            state["exp_avg"].lerp_(p.grad, 1 - beta1)
            bc1, _ = self._bias(group)
            denom = self._denominator(group, p, state)
            if group["weight_decay"]:
                update = torch.div(state["exp_avg"], bc1, out=self._update_buffer(p)).div_(denom)
                update.add_(p, alpha=group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
                state["momentum_accumulator"].add_(update, alpha=-group["lr"])
            else:  # −lr·m̂/(√v̂+ε), formed twice instead of stored once
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bc1)
                state["momentum_accumulator"].addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bc1)
            state["lr_sum"] += group["lr"]
            denoms.append(denom)
        if self.step_count % self.local_interval == 0:
            self._synchronise(entries, denoms)
        self.local_counter += 1
        if self.local_counter == self.local_step_scaler:
            self.local_counter = 0
            self.local_interval = min(self.local_step_clipper, self.local_interval * 2)

    def _synchronise(self, entries, denoms) -> None:
        """Replace the local steps since the last sync by the averaged ones (paper Alg. 1, lines 13-16)."""
        accumulators = [state["momentum_accumulator"] for _, _, state in entries]
        for _, p, state in entries:
            p.sub_(state["momentum_accumulator"])
        # Average u·(√v̂+ε) = −Σ lr·(m̂ + wd·x·(√v̂+ε)), comparable across ranks (the product is formed
        # on the way into the compressor's buffer).
        averaged = self.compressed_average(accumulators, denoms)
        for (group, p, state), denom, u in zip(entries, denoms, averaged):
            bc1, _ = self._bias(group)
            if state["lr_sum"] > 0:  # a schedule at lr 0 moved nothing: keep m
                torch.mul(u, -bc1 / state["lr_sum"], out=state["exp_avg"])
                if group["weight_decay"]:
                    # [Note: decay is not momentum] ū also carries the decoupled decay's displacement,
                    # Σ lr·wd·x·(√v̂+ε); left in m it would be applied again through m at every later
                    # step (about 1/(1−β1) times over: DeepSpeed's zoadam does so). Taken out with x at
                    # the last synchronisation (p here, the same on every rank): exact where each window
                    # is one step (local_step_clipper 1), otherwise up to the drift of x over the window.
                    state["exp_avg"].addcmul_(p, denom, value=-bc1 * group["weight_decay"])
            p.addcdiv_(u, denom)
            state["lr_sum"] = 0.0
        torch._foreach_zero_(accumulators)

    def load_state_dict(self, state_dict: dict) -> None:
        self._denominators = {}
        super().load_state_dict(state_dict)

    # Once local steps have begun each rank's parameters, m and u are its own: between synchronisations
    # they differ by the local steps, and after one by rounding (x + u − u is not x), so the row layout
    # of a file checkpoint (one copy, cut over the ranks) would stitch ranks together. The rank file
    # keeps this rank's own (engine/checkpoint/rank_state.py).
    _LOCAL = ("exp_avg", "momentum_accumulator")

    def _stepped(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if self.state.get(p)]

    def rank_state(self) -> dict:
        state = super().rank_state()
        if self.step_count > self.var_freeze_step:
            stepped = self._stepped()
            state["local"] = host_copy({"params": [p.detach() for p in stepped],
                                        **{k: [self.state[p][k] for p in stepped] for k in self._LOCAL}})
        return state

    def load_rank_state(self, saved: dict, same_world: bool) -> None:
        super().load_rank_state(saved, same_world)
        local = saved.get("local")
        if local is None:
            return
        stepped = self._stepped()
        if [tuple(p.shape) for p in stepped] != [tuple(t.shape) for t in local["params"]]:
            raise ValueError(f"{type(self).__name__}: the checkpoint's local-step state has parameters of shapes "
                             f"{[tuple(t.shape) for t in local['params']]}, this model "
                             f"{[tuple(p.shape) for p in stepped]}; load it into the model it was saved from")
        with torch.no_grad():
            for i, p in enumerate(stepped):
                p.copy_(local["params"][i])
                for k in self._LOCAL:
                    self.state[p][k].copy_(local[k][i])
