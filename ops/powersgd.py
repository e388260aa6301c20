"""PowerSGD gradient compression with error feedback (Vogels et al., NeurIPS 2019, Algorithm 1/2).

Each gradient matrix M (a parameter viewed as shape[0] × rest) plus this rank's error e is
approximated at rank r by one step of subspace iteration, warm-started from the previous step's Q:
    P = (M+e)·Q;  all-reduce P;  P ← orthonormal(P);  Q = (M+e)ᵀ·P;  all-reduce Q, /world;
    M̄ ≈ P·Qᵀ;  e ← (M+e) − P·Qᵀ
so a matrix of n×m floats costs (n+m)·r on the wire. Vectors and matrices too small to gain are
averaged exactly, in the same all-reduce as P. Q starts from the same seeded random matrix on every
rank (the sum of the P's needs one Q). Error feedback keeps what the low-rank step missed for the
next step, which is what makes rank 1-4 converge like full SGD in the paper.

[Note: non-finite gradients] An fp16 overflow makes P and Q non-finite on every rank; the engine skips
that step. Error and Q entries that are not finite are reset (to 0 and to the previous Q), so one
overflow does not poison later steps. With a dynamic loss scale the error is kept in scaled units; a
scale change then rescales a small residual by 2, which error feedback absorbs.
"""
from __future__ import annotations

import torch


def _orthonormalize(p: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(p, mode="reduced").Q


class PowerSGD:
    """Averages flat gradient buckets over `comm` (any object with `world_size` and `all_reduce`).

    `reduce_(key, flat, shapes)`: `flat` holds the parameters of `shapes` back to back; it is replaced
    by the (approximate) mean over ranks. Exact all-reduce for the first `start_step` steps (counted by
    `finish_step()`), PowerSGD afterwards."""

    def __init__(self, comm, rank: int = 4, start_step: int = 100, seed: int = 0):
        self.comm, self.rank, self.start_step, self.seed = comm, rank, start_step, seed
        self.steps = 0
        self._errors: dict = {}
        self._qs: dict = {}

    @property
    def compressing(self) -> bool:
        return self.steps >= self.start_step

    def finish_step(self) -> None:
        self.steps += 1

    def _layout(self, shapes) -> tuple[list, list]:
        """(offset, n, m, r) of the matrices worth compressing, and (offset, numel) of the rest."""
        mats, plain, offset = [], [], 0
        for shape in shapes:
            numel = shape.numel()
            n = shape[0] if len(shape) >= 2 else numel
            m = numel // n if n else 0
            r = min(self.rank, n, m)
            if len(shape) >= 2 and (n + m) * r < numel:
                mats.append((offset, n, m, r))
            else:
                plain.append((offset, numel))
            offset += numel
        return mats, plain

    def _initial_q(self, key, mats) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed + hash(key) % 10_000)
        return [torch.randn(m, r, generator=gen) for _, _, m, r in mats]

    def reduce_(self, key, flat: torch.Tensor, shapes) -> None:
        world = self.comm.world_size
        if not self.compressing:
            self.comm.all_reduce(flat)
            flat.div_(world)
            return
        mats, plain = self._layout(shapes)
        full = flat.float() + self._errors.get(key, 0.0)
        qs = self._qs.setdefault(key, [q.to(flat.device) for q in self._initial_q(key, mats)])
        ms = [full[o:o + n * m].view(n, m) for o, n, m, _ in mats]
        ps = [mat @ q for mat, q in zip(ms, qs)]
        exact = [full[o:o + k] for o, k in plain]
        first = torch.cat([p.reshape(-1) for p in ps] + exact) if ps or exact else full[:0]
        self.comm.all_reduce(first)
        sizes = [p.numel() for p in ps] + [k for _, k in plain]
        parts = list(first.split(sizes)) if sizes else []
        ps = [_orthonormalize(part.view_as(p)) for part, p in zip(parts, ps)]
        new_qs = [mat.T @ p for mat, p in zip(ms, ps)]
        if new_qs:
            second = torch.cat([q.reshape(-1) for q in new_qs])
            self.comm.all_reduce(second)
            second.div_(world)
            new_qs = [part.view_as(q) for part, q in zip(second.split([q.numel() for q in new_qs]), new_qs)]
        averaged = torch.zeros_like(full)
        for (o, n, m, _), p, q in zip(mats, ps, new_qs):
            averaged[o:o + n * m] = (p @ q.T).reshape(-1)
        for (o, k), part in zip(plain, parts[len(ps):]):
            averaged[o:o + k] = part / world
        error = full - averaged
        for (o, k) in plain:
            error[o:o + k] = 0.0  # averaged exactly: nothing to carry over
        if not torch.isfinite(error.sum()):  # one read of the error instead of a `where` every step
            error = torch.where(torch.isfinite(error), error, 0.0)
        self._errors[key] = error
        self._qs[key] = [torch.where(torch.isfinite(new), new, old) for new, old in zip(new_qs, qs)]
        flat.copy_(averaged)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "errors": dict(self._errors), "qs": dict(self._qs)}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self._errors, self._qs = state["steps"], dict(state["errors"]), dict(state["qs"])
