"""PowerSGD gradient compression with error feedback (Vogels et al., NeurIPS 2019, Algorithm 1/2).

Each gradient matrix M (a parameter viewed as shape[0] × rest) plus this rank's error e is
approximated at rank r by one step of subspace iteration, warm-started from the previous step's Q:
    P = (M+e)·Q;  all-reduce P;  P ← orthonormal(P);  Q = (M+e)ᵀ·P;  all-reduce Q, /world;
    M̄ ≈ P·Qᵀ;  e ← (M+e) − P·Qᵀ
so a matrix of n×m floats costs (n+m)·r on the wire. Vectors and matrices too small to gain are
averaged exactly, in the same all-reduce as P. Q starts from the same seeded random matrix on every
rank (the sum of the P's needs one Q). Error feedback keeps what the low-rank step missed for the
next step, which is what makes rank 1-4 converge like full SGD in the paper.

[Note: CPU cost] A step reads the bucket three times (e += M, P = (M+e)·Q, Qᵀ = Pᵀ·(M+e)) and writes it
twice (M̄ = P·Qᵀ, e −= M̄), in place: the error buffer of each bucket is kept across steps and holds
M+e while the step runs. The thin products use the layouts BLAS streams through: Q is stored as a
contiguous r×m matrix (M·Q is then M·(Qᵀ)ᵀ) and (M+e)ᵀ·P is computed as (Pᵀ·(M+e))ᵀ; the other
layouts were 4-10x slower on one CPU thread (docs/compression.md, "Measured").

[Note: non-finite gradients] An fp16 overflow makes P and Q non-finite on every rank; the engine skips
that step. Error and Q entries that are not finite are reset (to 0 and to the previous Q), so one
overflow does not poison later steps. On the CPU that check is one reduction read back (no device to
wait for, cheaper than rewriting the bucket every step); on an accelerator a read would be a host sync
per bucket inside backward, so there the reset runs unconditionally, as device ops. With a dynamic loss scale the error is kept in scaled units; a
scale change then rescales a small residual by 2, which error feedback absorbs.
"""
from __future__ import annotations

import zlib

import torch


def _orthonormalize(p: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(p, mode="reduced").Q


def _row_major_t(q: torch.Tensor) -> torch.Tensor:
    """`q` (m × r) as the transpose of a contiguous r × m matrix (same values)."""
    return q.T.contiguous().T


class PowerSGD:
    """Averages flat gradient buckets over `comm` (any object with `world_size` and `all_reduce`).

    `reduce_(key, flat, shapes)`: `flat` holds the parameters of `shapes` back to back; it is replaced
    by the (approximate) mean over ranks. Exact all-reduce for the first `start_step` steps (counted by
    `finish_step()`), PowerSGD afterwards."""

    def __init__(self, comm, rank: int = 4, start_step: int = 100, seed: int = 0):
        self.comm, self.rank, self.start_step, self.seed = comm, rank, start_step, seed
        self.steps = 0
        self._errors: dict = {}  # key -> fp32 error of the whole bucket (0 where averaged exactly)
        self._qs: dict = {}  # key -> [Q (m × r, stored r × m)] per compressed matrix
        self._outputs: dict = {}  # key -> fp32 buffer for M̄ when the bucket is not fp32

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
        # A stable seed per bucket on every rank (str hashes are salted per process).
        salt = key if isinstance(key, int) else zlib.crc32(repr(key).encode())
        gen = torch.Generator().manual_seed(self.seed + salt % 10_000)
        return [_row_major_t(torch.randn(m, r, generator=gen, device="cpu")) for _, _, m, r in mats]

    def reduce_(self, key, flat: torch.Tensor, shapes) -> None:
        world = self.comm.world_size
        if not self.compressing:
            self.comm.all_reduce(flat)
            flat.div_(world)
            return
        mats, plain = self._layout(shapes)
        full = self._errors.get(key)
        if full is None:
            full = self._errors[key] = torch.zeros(flat.numel(), device=flat.device)
        full.add_(flat)  # M + e (e is 0 where averaged exactly); it becomes the new error below
        qs = self._qs.get(key)
        if qs is None:
            qs = [q.to(flat.device) for q in self._initial_q(key, mats)]
        ms = [full[o:o + n * m].view(n, m) for o, n, m, _ in mats]
        ps = [mat @ q for mat, q in zip(ms, qs)]
        exact = [full[o:o + k] for o, k in plain]
        first = torch.cat([p.reshape(-1) for p in ps] + exact) if ps or exact else full[:0]
        self.comm.all_reduce(first)
        sizes = [p.numel() for p in ps] + [k for _, k in plain]
        parts = list(first.split(sizes)) if sizes else []
        ps = [_orthonormalize(part.view_as(p)) for part, p in zip(parts, ps)]
        new_qs = []
        if ps:
            second = torch.cat([(p.T @ mat).reshape(-1) for mat, p in zip(ms, ps)])  # Qᵀ, r × m each
            self.comm.all_reduce(second)
            second.div_(world)
            new_qs = [part.view(r, m).T for part, (_, _, m, r) in zip(second.split([m * r for _, _, m, r in mats]),
                                                                      mats)]
        averaged = flat if flat.dtype == torch.float32 else self._output(key, flat)
        for (o, n, m, _), p, q in zip(mats, ps, new_qs):
            torch.mm(p, q.T, out=averaged[o:o + n * m].view(n, m))
        for (o, k), part in zip(plain, parts[len(ps):]):
            torch.div(part, world, out=averaged[o:o + k])
        error = full.sub_(averaged)
        for (o, k) in plain:
            error[o:o + k] = 0.0  # averaged exactly: nothing to carry over
        host = error.device.type == "cpu"  # module note: non-finite gradients
        if not host or not torch.isfinite(error.sum()):
            torch.nan_to_num_(error, nan=0.0, posinf=0.0, neginf=0.0)
        if new_qs and (not host or not torch.isfinite(second).all()):
            new_qs = [_row_major_t(torch.where(torch.isfinite(new), new, old)) for new, old in zip(new_qs, qs)]
        self._qs[key] = new_qs
        if averaged is not flat:
            flat.copy_(averaged)

    def _output(self, key, flat: torch.Tensor) -> torch.Tensor:
        out = self._outputs.get(key)
        if out is None or out.numel() != flat.numel():
            out = self._outputs[key] = torch.empty(flat.numel(), device=flat.device)
        return out

    def state_dict(self) -> dict:
        return {"steps": self.steps, "errors": {k: e.clone() for k, e in self._errors.items()},
                "qs": {k: [q.clone() for q in qs] for k, qs in self._qs.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]
        self._errors = {k: e.float().clone() for k, e in state["errors"].items()}
        self._qs = {k: _packed(qs) for k, qs in state["qs"].items()}


def _packed(qs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A bucket's Qs as a step leaves them: transposes of consecutive r × m blocks of one buffer
    (reduce_'s `second`). BLAS rounds M·Q by where Q lies (its alignment picks the kernel), so Qs loaded
    each into a buffer of its own made a resumed run differ from the uninterrupted one in the last bit."""
    if not qs:
        return []
    flat = torch.cat([q.T.reshape(-1) for q in qs])
    return [part.view(q.shape[1], q.shape[0]).T for part, q in zip(flat.split([q.numel() for q in qs]), qs)]
