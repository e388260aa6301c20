"""DeepSpeed's optimizer set (Adagrad, Lion, Lamb, Muon) and a torch.optim class by name equal
single-process training at every ZeRO stage, with and without gradient accumulation; with the
optimizer offloaded (`offload_optimizer.device` "cpu" and "nvme" at stages 1-3; Lamb's and Muon's
whole-tensor rules step in two passes over swapped sub-groups that cut their tensors) each equals its
own run without offload bit for bit (Lamb and Muon also with `swap_slots` 1, written in place, and the
gradient in host memory); an Inf on one
rank skips Lamb's and Muon's swapped step and leaves their swap files' SHA-256 unchanged.

References: torch's own class where one exists (Adagrad, RMSprop; AdamW for Muon's non-matrix half);
for Lion, Lamb and Muon's matrix half a plain per-tensor implementation written here from the papers'
equations (Lion: arXiv:2302.06675 Alg. 2; LAMB: arXiv:1904.00962 Alg. 2 with DeepSpeed's ratio clip;
Muon: Jordan 2024, DeepSpeed's Nesterov form and aspect-ratio scale). The model's matrices are
non-square and their dim-0 chunks cross the partition boundary; at 4 ranks one rank holds no row of
`mid`. Offload runs with DSTRAIN_OFFLOAD_STAGE_COPIES=1, so the accelerator's copy path (gradient segments
staged to the host, weights copied out for the all-gather) runs on this CPU-only machine. Tolerance: fp32, atol 2e-5 after 5 steps — only summation order differs between the ranks'
reductions and one process (measured below 2e-6 for the elementwise optimizers; Lamb's and Muon's
norms amplify it slightly, measured below 5e-6).
"""
from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from torch import nn

import engine
import ops
import schemas
from engine.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from engine.zero.per_tensor import assign_owners
from ops.state_layout import ELEMENTWISE, declared_layout
from tests import optimizer_runs
from tests.optimizer_runs import record
from tests.offload_runs import _swap_hashes
from tests.models import make_batches, micro_batches

STEPS, MICRO = 5, 2
# a torch class by name is stepped like any elementwise optimizer: a few cases show it (time budget)
RMSPROP_CASES = {(0, 1), (1, 2), (2, 2), (3, 1), (3, 2)}  # (s, 2): the offload cases' baselines
OPTIMIZERS = {
    "Adagrad": {"lr": 0.05, "weight_decay": 0.01},
    "Lion": {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.1},
    "Lamb": {"lr": 0.02, "weight_decay": 0.01, "max_coeff": 2.0, "min_coeff": 0.05},
    "Muon": {"muon_lr": 0.03, "adam_lr": 0.01, "momentum": 0.9, "weight_decay": 0.1},
    "RMSprop": {"lr": 0.005, "momentum": 0.5},  # a torch.optim class by name (elementwise)
}


class Net(nn.Module):
    """Non-square matrices (9x13, 7x9, 5x7), biases, and a matrix Muon must leave to AdamW ("embed")."""

    def __init__(self):
        super().__init__()
        self.embed_proj = nn.Parameter(torch.randn(13, 13) * 0.3)
        self.inp, self.mid, self.out = nn.Linear(13, 9), nn.Linear(9, 7), nn.Linear(7, 5)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x @ self.embed_proj))
        return nn.functional.mse_loss(self.out(torch.tanh(self.mid(h))), y)


# NVMe: sub-groups of 64 elements (a multiple of nvme_tier.LANES), so each rank's ~200-element partition
# is stepped in several swapped pieces.
NVME_SUB_GROUP = 64


def _offload(offload: str, nvme_path: str | None) -> dict:
    if offload == "cpu":
        return {"offload_optimizer": {"device": "cpu"}}
    # "nvme": the gradient partition swapped too (swap_gradients true); "nvme1": offload_optimizer.swap_slots 1,
    # the state files written in place, and swap_gradients unset, so the gradient stays in host memory
    # (engine/zero/grad_swap.py's note: when) and the two passes read it there
    if offload.startswith("nvme"):
        return {"sub_group_size": NVME_SUB_GROUP, "offload_optimizer": {
            "device": "nvme", "nvme_path": nvme_path,
            **({"swap_slots": 1} if offload == "nvme1" else {"swap_gradients": True})}}
    return {}


def _config(kind: str, stage: int, gas: int, offload: str = "none", nvme_path: str | None = None) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
            "optimizer": {"type": kind.lower(), "params": OPTIMIZERS[kind]},
            "zero_allow_untested_optimizer": kind == "RMSprop",
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 150, "allgather_bucket_size": 200,
                                  "stage3_param_persistence_threshold": 10, **_offload(offload, nvme_path)}}


def _train(kind: str, stage: int, gas: int, offload: str = "none", nvme_path: str | None = None,
           inf_step: int | None = None) -> dict:
    """`inf_step`: rank 1's last micro-batch loss of that step is multiplied by Inf (the step is skipped)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    eng, _, _, _ = engine.initialize(model=Net(), config=_config(kind, stage, gas, offload, nvme_path))
    norms, step_calls, unchanged = [], [], None
    stats = eng.zero_optimizer.comm.stats
    for step, (x, y) in enumerate(make_batches(STEPS, MICRO * gas * world)):
        before = _swap_hashes(eng.zero_optimizer) if step == inf_step and offload == "nvme" else None
        for k, (xm, ym) in enumerate(micro_batches(x, y, rank, world, gas)):
            loss = eng(xm, ym)
            if step == inf_step and rank == 1 and k == gas - 1:
                loss = loss * float("inf")
            eng.backward(loss)
            if k == gas - 1:  # the boundary: count what the step itself sends
                stats.reset()
            eng.step()
        if before is not None:
            unchanged = len(before) > 0 and before == _swap_hashes(eng.zero_optimizer)
        step_calls.append({op: stats.calls[op] for op in ("all_reduce", "all_to_all")})
        norms.append(eng.get_global_grad_norm())
    result = {"params": {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters()}, "norms": norms,
              "step_calls": step_calls, "skipped": eng.skipped_steps, "unchanged": unchanged}
    zopt = eng.zero_optimizer
    orthogonalizer = getattr(zopt.optimizer, "orthogonalize_flats", None)
    if orthogonalizer is not None:
        result["owned_cost"] = orthogonalizer.owned_cost()
    if gas == 2 and stage >= 1:  # the offload parity's pairs: their per-element state too (from the swap files on NVMe)
        result["state"] = _elementwise_state(eng)
    if offload != "none":  # where the step ran: staged host flats, or swap files with no state in memory
        result["tier"] = {"home": str(zopt.tier.home), "staged": zopt.tier.staged,
                          "nvme": getattr(zopt, "nvme", None) is not None,
                          "grad_swapped": getattr(zopt, "grad_swap", None) is not None,  # engine/zero/grad_swap.py
                          "state_in_memory": sum(len(s) for s in zopt.optimizer.state.values())}
    if offload.startswith("nvme"):
        eng.destroy()  # removes the swap directory (destroy's gc.collect costs ~1 s: only where needed)
    return result


def _elementwise_state(eng) -> dict:
    """(parameter, key) -> the whole state tensor, for every per-element key the class declares: a wrong
    gradient that a sign-based update hides (Lion's) still shows in its momentum."""
    keys = [k for k, kind in declared_layout(eng.optimizer).items() if kind == ELEMENTWISE]
    out = {}
    for name, p in eng.module.named_parameters():
        for key in keys:
            value = safe_get_full_optimizer_state(p, key)
            if value is not None:
                out[(name, key)] = value
    return out


class ClientSGD(torch.optim.SGD):
    """A client's optimizer class: nothing tells the swapped step its update is elementwise."""


def _refused(nvme_path: str) -> list[str] | None:
    model, cfg = Net(), _config("RMSprop", 2, 1, "nvme", nvme_path)  # RMSprop's: zero_allow_untested_optimizer
    del cfg["optimizer"]
    try:
        engine.initialize(model=model, optimizer=ClientSGD(model.parameters(), lr=0.01), config=cfg)
    except schemas.ConfigError as error:
        return error.problems
    return None


class Matrices(nn.Module):
    """20 Muon matrices against a 3072-element swap pool (3 buffers of 1024): each 64x64 matrix is a
    round larger than the pool, alone; the 16x64 and 64x16 ones go three to a round; their halves (one
    rank's fragments, 2048 and 512 elements) cross the 1024-element sub-groups."""

    DIMS = [64] + [64, 16, 64, 16, 64] * 4

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(self.DIMS, self.DIMS[1:]))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return nn.functional.mse_loss(x, y)


MUON_POOL = {"sub_group_size": 1024, "buffer_count": 3}


def _peak_allocated(prof) -> int:
    """The most bytes of CPU tensors this thread had alive at once inside the profiled region, beyond
    those alive at its start: the running sum of its allocations and frees (the events' own
    `total_allocated` is process-wide, other threads' allocations included)."""
    from torch._C._profiler import _EventType

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.children)
    events = sorted((n.start_time_ns, n.extra_fields.alloc_size) for n in
                    walk(prof.profiler.kineto_results.experimental_event_tree()) if n.tag == _EventType.Allocation)
    live = peak = 0
    for _, size in events:
        live += size
        peak = max(peak, live)
    return peak


def _muon_nvme_memory(nvme_path: str) -> dict:
    """Matrices trained 2 steps with Muon at stage 2, in memory and on NVMe, with a param group per
    parameter (initialize's default: rounds span flats) and with one group (rounds within one flat);
    on NVMe the peak of the swapped step's own tensor allocations (torch's profiler) at the second
    step, the first that reads state (the first makes it)."""
    return {grouping: _muon_nvme_memory_run(nvme_path, grouping) for grouping in ("per parameter", "one group")}


def _muon_nvme_memory_run(nvme_path: str, grouping: str) -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    for where in ("memory", "nvme"):
        torch.manual_seed(0)
        cfg = _config("Muon", 2, 1)
        if where == "nvme":
            cfg["zero_optimization"].update(sub_group_size=MUON_POOL["sub_group_size"], offload_optimizer={
                "device": "nvme", "nvme_path": nvme_path, "buffer_count": MUON_POOL["buffer_count"]})
        model = Matrices()
        params = model.parameters() if grouping == "per parameter" else [{"params": list(model.parameters())}]
        eng, _, _, _ = engine.initialize(model=model, model_parameters=params, config=cfg)
        peaks, calls = [], []
        if where == "nvme":
            stepper = eng.zero_optimizer.nvme.per_tensor
            unmeasured = stepper.step

            def measured():
                calls.append(1)
                if len(calls) == 1:
                    return unmeasured()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
                    unmeasured()
                peaks.append(_peak_allocated(prof))
            stepper.step = measured
            out["rounds"] = [len(r.orthogonalizer.matrices) for r in stepper.rounds]
            out["flats"] = len(stepper.matrix_keys)
            out["pool_elements"] = eng.zero_optimizer.nvme.pool.buffer_count * eng.zero_optimizer.nvme.pool.buffer_size
        for x, y in make_batches(2, MICRO * world, d_in=64, d_out=64, seed=1):
            eng.backward(eng(x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]))
            eng.step()
        out[where] = {n: safe_get_full_fp32_param(p) for n, p in eng.module.named_parameters()}
        if where == "nvme":
            out["peaks"] = peaks
            eng.destroy()
    return out


def _runs(cases, nvme_path: str | None = None) -> dict:
    out = {case: _train(*case, nvme_path=nvme_path) for case in cases}
    if nvme_path is not None and torch.distributed.get_world_size() == 2:
        record(out, "muon_nvme_memory", _muon_nvme_memory, nvme_path)
    if nvme_path is not None:
        for case in INF_CASES:
            out[("inf", *case)] = _train(*case, nvme_path=nvme_path, inf_step=INF_STEP)
        out["refused"] = _refused(nvme_path)
        out["left_in_nvme_path"] = sorted(os.listdir(nvme_path))
    return out


# -- references, per tensor, from the equations -------------------------------------------------------
class PaperLion(torch.optim.Optimizer):
    def __init__(self, params, lr, betas, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                c = g["betas"][0] * m + (1 - g["betas"][0]) * p.grad
                p.mul_(1 - g["lr"] * g["weight_decay"]).sub_(g["lr"] * torch.sign(c))
                m.mul_(g["betas"][1]).add_((1 - g["betas"][1]) * p.grad)


class PaperLamb(torch.optim.Optimizer):
    def __init__(self, params, lr, weight_decay, max_coeff, min_coeff, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, wd=weight_decay, hi=max_coeff, lo=min_coeff, betas=betas, eps=eps))
        self.t = 0

    @torch.no_grad()
    def step(self):
        self.t += 1
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                st = self.state[p]
                m, v = st.setdefault("m", torch.zeros_like(p)), st.setdefault("v", torch.zeros_like(p))
                m.mul_(b1).add_((1 - b1) * p.grad)
                v.mul_(b2).add_((1 - b2) * p.grad * p.grad)
                u = (m / (1 - b1 ** self.t)) / ((v / (1 - b2 ** self.t)).sqrt() + g["eps"]) + g["wd"] * p
                w_norm, u_norm = p.norm().item(), u.norm().item()
                ratio = min(max(w_norm / u_norm, g["lo"]), g["hi"]) if w_norm > 0 and u_norm > 0 else 1.0
                p.sub_(g["lr"] * ratio * u)


class PaperMuon(torch.optim.Optimizer):
    """Muon for the matrices; the rest go to torch's AdamW (see `_reference_optimizer`)."""

    def __init__(self, params, lr, momentum, weight_decay):
        super().__init__(params, dict(lr=lr, beta=momentum, wd=weight_decay))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                m.mul_(g["beta"]).add_((1 - g["beta"]) * p.grad)
                x = (1 - g["beta"]) * p.grad + g["beta"] * m
                rows, cols = x.shape
                x = x.T if rows > cols else x
                x = x / (x.norm() + 1e-7)
                for _ in range(5):
                    a = x @ x.T
                    x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
                x = (x.T if rows > cols else x) * math.sqrt(max(1.0, rows / cols))
                p.mul_(1 - g["lr"] * g["wd"]).sub_(g["lr"] * x)


class Both:
    def __init__(self, *opts):
        self.opts = opts

    def step(self):
        for o in self.opts:
            o.step()


def _reference_optimizer(kind: str, model: Net):
    cfg = OPTIMIZERS[kind]
    if kind == "Adagrad":
        return torch.optim.Adagrad(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"], eps=1e-10)
    if kind == "Lion":
        return PaperLion(model.parameters(), cfg["lr"], tuple(cfg["betas"]), cfg["weight_decay"])
    if kind == "Lamb":
        return PaperLamb(model.parameters(), cfg["lr"], cfg["weight_decay"], cfg["max_coeff"], cfg["min_coeff"])
    if kind == "RMSprop":
        return torch.optim.RMSprop(model.parameters(), **cfg)
    matrices = [model.inp.weight, model.mid.weight, model.out.weight]
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
    return Both(PaperMuon(matrices, cfg["muon_lr"], cfg["momentum"], cfg["weight_decay"]),
                torch.optim.AdamW(rest, lr=cfg["adam_lr"], betas=(0.9, 0.95), eps=1e-10,
                                  weight_decay=cfg["weight_decay"]))


def _reference(kind: str, world: int, gas: int):
    torch.manual_seed(0)
    model = copy.deepcopy(Net())
    opt, norms = _reference_optimizer(kind, model), []
    for x, y in make_batches(STEPS, MICRO * gas * world):
        model(x, y).backward()  # the mean over the global batch: what the ranks' averaged micro-batches give
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
        opt.step()
        for p in model.parameters():
            p.grad = None
    return {n: p.detach() for n, p in model.named_parameters()}, norms


def _assert_matches(got: dict, kind: str, world: int, gas: int, label: str) -> None:
    want, want_norms = _reference(kind, world, gas)
    for name, w in want.items():
        err = (got["params"][name] - w).abs().max().item()
        assert err < 2e-5, f"{label} {name}: max |w - w_ref| = {err:.2e}"
        moved = (w - _initial()[name]).abs().max().item()
        assert moved > 1e-3, f"{label} {name}: the reference did not move ({moved:.1e})"
    assert got["norms"] == pytest.approx(want_norms, rel=1e-5), f"{label}: grad norms"


def _initial() -> dict:
    torch.manual_seed(0)
    return {n: p.detach() for n, p in Net().named_parameters()}


# -- 2 ranks: every optimizer x stage x accumulation, and each with offload, in one spawn ----------------
TWO_RANK_CASES = [(k, s, g, "none") for k in OPTIMIZERS for s in (0, 1, 2, 3) for g in (1, 2)
                  if k != "RMSprop" or (s, g) in RMSPROP_CASES]
NVME_ELEMENTWISE, NVME_PER_TENSOR = ("Adagrad", "Lion", "RMSprop"), ("Lamb", "Muon")
OFFLOAD_CASES = ([(k, s, 2, "cpu") for k in OPTIMIZERS for s in (1, 2, 3)]
                 + [(k, s, 2, "nvme") for k in NVME_ELEMENTWISE for s in (1, 2, 3)]
                 + [(k, s, 2, "nvme") for k in NVME_PER_TENSOR for s in (1, 2, 3)]
                 # their two passes with the state files written in place (swap_slots 1)
                 + [("Lamb", 3, 2, "nvme1"), ("Muon", 2, 2, "nvme1")])
# An Inf at step INF_STEP, with and without NVMe: Lamb at stage 3, Muon at stage 2.
INF_STEP = 2
INF_CASES = [(k, s, 2, offload) for k, s in (("Lamb", 3), ("Muon", 2)) for offload in ("none", "nvme")]


FOUR_RANK_CASES = [(k, s, 2, "none") for k in ("Muon", "Lamb") for s in (1, 3)]
CASES = {2: TWO_RANK_CASES + OFFLOAD_CASES, 4: FOUR_RANK_CASES}  # run by tests/optimizer_runs.py


@pytest.fixture(scope="module")
def two_ranks():
    return optimizer_runs.part(2, "set")


@pytest.mark.parametrize("kind, stage, gas, offload", TWO_RANK_CASES, ids=lambda v: str(v))
def test_optimizer_matches_single_process(two_ranks, kind, stage, gas, offload):
    for rank, results in enumerate(two_ranks):
        _assert_matches(results[(kind, stage, gas, offload)], kind, 2, gas, f"rank {rank} {kind} stage {stage} gas {gas}")


@pytest.mark.parametrize("kind, stage, gas, offload", OFFLOAD_CASES, ids=lambda v: str(v))
def test_offloaded_optimizer_equals_no_offload_bit_for_bit(two_ranks, kind, stage, gas, offload):
    """The offload tier changes where the step runs, not what it computes (DeepSpeed's Muon and Lion
    diverged with CPU offload): weights, every step's gradient norm and every per-element state tensor
    equal the in-memory run's."""
    for rank, results in enumerate(two_ranks):
        got, want = results[(kind, stage, gas, offload)], results[(kind, stage, gas, "none")]
        assert got["tier"]["home"] == "cpu" and got["tier"]["staged"], f"rank {rank}: {got['tier']}"
        if offload.startswith("nvme"):  # the state, and with "nvme" the gradient partition, in the swap files only
            assert got["tier"]["nvme"] and got["tier"]["state_in_memory"] == 0, f"rank {rank}: {got['tier']}"
            assert got["tier"]["grad_swapped"] == (offload == "nvme"), f"rank {rank}: {got['tier']}"
        for name, w in want["params"].items():
            g = got["params"][name]
            assert torch.equal(g, w), f"rank {rank} {kind} {offload} stage {stage} {name}: {(g - w).abs().max():.2e}"
        assert got["norms"] == want["norms"], f"rank {rank} {kind} {offload} stage {stage}: gradient norms"
        assert got["state"].keys() == want["state"].keys() and got["state"], f"rank {rank}: {sorted(got['state'])}"
        for key, value in want["state"].items():
            assert torch.equal(got["state"][key], value), f"rank {rank} {kind} {offload} stage {stage} {key}"


def test_nvme_refuses_an_optimizer_it_cannot_swap_by_name(two_ranks):
    for rank, results in enumerate(two_ranks):
        problems = results["refused"]
        assert problems is not None and len(problems) == 1, f"rank {rank}: {problems}"
        assert problems[0].startswith('zero_optimization.offload_optimizer.device: "nvme" with optimizer '
                                      'ClientSGD is not built yet (the swapped step is built for Adam, AdamW, '
                                      'SGD, Adagrad, Lion, Lamb, Muon, or torch'), problems[0]
        assert 'use offload_optimizer.device "cpu"' in problems[0]
        assert results["left_in_nvme_path"] == [], f"rank {rank}: swap files left {results['left_in_nvme_path']}"


@pytest.mark.parametrize("kind, stage, gas, offload", [c for c in INF_CASES if c[-1] == "nvme"], ids=lambda v: str(v))
def test_inf_skips_the_swapped_per_tensor_step_and_leaves_the_swap_files_unchanged(two_ranks, kind, stage, gas,
                                                                                     offload):
    for rank, results in enumerate(two_ranks):
        got, want = results[("inf", kind, stage, gas, offload)], results[("inf", kind, stage, gas, "none")]
        assert got["skipped"] == want["skipped"] == 1, f"rank {rank}: skipped {got['skipped']}, {want['skipped']}"
        assert got["unchanged"] is True, f"rank {rank} {kind}: the skipped step changed a swap file"
        assert not math.isfinite(got["norms"][INF_STEP])
        for name, w in want["params"].items():  # the steps after the skip: bit for bit
            assert torch.equal(got["params"][name], w), f"rank {rank} {kind} {name}"
        finite = [n for i, n in enumerate(got["norms"]) if i != INF_STEP]
        assert finite == [n for i, n in enumerate(want["norms"]) if i != INF_STEP]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_per_tensor_steps_communicate_once_per_step(two_ranks, stage):
    """The step's own collectives: the gradient norm's all-reduce (every optimizer), plus Lamb's one
    all-reduce of all per-parameter partial norms, plus Muon's two all-to-alls (fragments to owners, slices back)."""
    for results in two_ranks:
        for gas in (1, 2):
            assert results[("Lion", stage, gas, "none")]["step_calls"] == [{"all_reduce": 1, "all_to_all": 0}] * STEPS
            assert results[("Lamb", stage, gas, "none")]["step_calls"] == [{"all_reduce": 2, "all_to_all": 0}] * STEPS
            assert results[("Muon", stage, gas, "none")]["step_calls"] == [{"all_reduce": 1, "all_to_all": 2}] * STEPS
        # with the state on NVMe too: the two passes share the one reduction / the two all-to-alls
        assert results[("Lamb", stage, 2, "nvme")]["step_calls"] == [{"all_reduce": 2, "all_to_all": 0}] * STEPS
        assert results[("Muon", stage, 2, "nvme")]["step_calls"] == [{"all_reduce": 1, "all_to_all": 2}] * STEPS


def test_muon_nvme_host_memory_is_bounded_by_the_pool_and_the_largest_matrix(two_ranks):
    """engine/zero/nvme_muon.py's memory note. A round of whole-matrix size W <= max(pool, largest matrix)
    = 4096 elements here holds U, the all-to-all send and receive buffers, the owner's whole matrices and
    results, and Newton-Schulz's temporaries of one matrix. The peak of the step's tensor allocations
    is measured by torch's profiler: 172-238 kB (at most 14.5·W fp32) over 7 runs on both ranks; the
    step that orthogonalises the rank's whole matrix partition (16384 elements) at once peaked at
    426 kB. The bound asserted, 20·W fp32 (327 kB), holds the first and not the second; it does not
    grow with the partition, the unbounded step does. The rounds change nothing: bit for bit the
    in-memory run, with a param group per parameter (rounds span flats) and with one group."""
    for rank, results in enumerate(two_ranks):
        for grouping, got in results["muon_nvme_memory"].items():
            where = f"rank {rank}, {grouping}"
            assert got["flats"] == (20 if grouping == "per parameter" else 1), f"{where}: {got['flats']} flats"
            assert got["rounds"] == [1, 3, 1] * 4, f"{where}: matrices per round {got['rounds']}"
            bound = 20 * 4 * max(got["pool_elements"], 64 * 64)
            assert len(got["peaks"]) == 1 and max(got["peaks"]) <= bound, f"{where}: peaks {got['peaks']} > {bound}"
            for name, w in got["memory"].items():
                assert torch.equal(got["nvme"][name], w), f"{where} {name}: {(got['nvme'][name] - w).abs().max():.2e}"


def test_lion_and_lamb_step_large_cpu_flats_in_blocks_as_the_references():
    """ops/lion.py's and ops/lamb.py's blocks: tensors longer than a block (and a short one between) step
    as the papers' equations per tensor; Lion's blocks equal its whole-tensor foreach step bit for bit."""
    from ops.lamb import BLOCK
    from ops.tensor_segments import FlatRuns, SegmentedReduction
    sizes = [BLOCK + 100, 300, BLOCK + 70]
    torch.manual_seed(0)
    start = [torch.randn(n, device="cpu") * 0.1 for n in sizes]
    grads = [[torch.randn(n, device="cpu") * 0.01 for n in sizes] for _ in range(2)]
    lion, lamb = OPTIMIZERS["Lion"], OPTIMIZERS["Lamb"]
    blocked = [nn.Parameter(t.clone()) for t in start]
    whole = [nn.Parameter(t.clone()) for t in start]
    paper = [nn.Parameter(t.clone()) for t in start]
    flat = nn.Parameter(torch.cat(start))
    paper_lamb = [nn.Parameter(t.clone()) for t in start]
    opt_blocked = ops.Lion(blocked, lr=lion["lr"], betas=lion["betas"], weight_decay=lion["weight_decay"])
    opt_whole = ops.Lion(whole, lr=lion["lr"], betas=lion["betas"], weight_decay=lion["weight_decay"])
    opt_paper = PaperLion(paper, lion["lr"], tuple(lion["betas"]), lion["weight_decay"])
    opt_lamb = ops.Lamb([flat], lr=lamb["lr"], weight_decay=lamb["weight_decay"],
                                      max_coeff=lamb["max_coeff"], min_coeff=lamb["min_coeff"])
    runs = [(sum(sizes[:i]), n, i) for i, n in enumerate(sizes)]  # boundaries inside 64-element rows
    opt_lamb.segmented = SegmentedReduction({flat: FlatRuns(runs, flat.device, cache=True)}, 3, lambda v: v)
    opt_paper_lamb = PaperLamb(paper_lamb, lamb["lr"], lamb["weight_decay"], lamb["max_coeff"], lamb["min_coeff"])
    for step_grads in grads:
        for params in (blocked, whole, paper, paper_lamb):
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
        flat.grad = torch.cat(step_grads)
        opt_blocked.step()
        with torch.no_grad():
            for p in whole:
                opt_whole.state[p].setdefault("exp_avg", torch.zeros_like(p))
            opt_whole._foreach_step(opt_whole.param_groups[0], whole)
        opt_paper.step()
        opt_lamb.step()
        opt_paper_lamb.step()
    for got, same, want, before in zip(blocked, whole, paper, start):
        assert torch.equal(got, same)
        assert (got - want).abs().max() < 1e-6 and (want - before).abs().max() > 1e-3
    for got, want in zip(torch.split(flat.detach(), sizes), paper_lamb):
        assert (got - want).abs().max() < 1e-6, (got - want).abs().max()


# -- Muon and Lamb on 4 ranks: a rank without rows of a matrix; owners spread ----------------------------
@pytest.fixture(scope="module")
def four_ranks():
    return optimizer_runs.part(4, "set")


@pytest.mark.parametrize("kind", ["Muon", "Lamb"])
@pytest.mark.parametrize("stage", [1, 3])
def test_per_tensor_optimizers_on_four_ranks(four_ranks, kind, stage):
    for rank, results in enumerate(four_ranks):
        _assert_matches(results[(kind, stage, 2, "none")], kind, 4, 2, f"rank {rank} {kind} stage {stage}")


def test_muon_owners_spread_the_newton_schulz_cost(four_ranks):
    costs = four_ranks[0][("Muon", 1, 2, "none")]["owned_cost"]
    # three Muon matrices (9x13, 7x9, 5x7) on four ranks: each on its own rank, none twice
    assert sorted(costs) == sorted([0, 9 * 13 * 9, 7 * 9 * 7, 5 * 7 * 5])
    assert all(r[("Muon", 1, 2, "none")]["owned_cost"] == costs for r in four_ranks)  # every rank agrees


def test_owner_assignment_is_balanced_largest_first():
    owners = assign_owners([8, 7, 6, 5, 4], world=2)
    loads = [sum(c for c, o in zip([8, 7, 6, 5, 4], owners) if o == r) for r in range(2)]
    assert loads == [17, 13]  # LPT: within 4/3 of the best split (15, 15)
    assert assign_owners([5, 5, 5], world=4) == [0, 1, 2]
