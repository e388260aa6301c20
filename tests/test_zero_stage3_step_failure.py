"""ZeRO-3 with the optimizer on NVMe: a step that fails on ONE rank only (a write of its optimizer state
raising OffloadIOError halfway through the step). Before, that rank raised out of the step while the
other ranks went on into the persistent parameters' refresh all-gather after the step and waited there
until the process group's timeout (stage3.py's note: a step failed on some rank). Now every rank raises
from the same `engine.step()`: rank 1 its own OffloadIOError (naming the swap file and the key), rank 0
`PeerStepError` naming rank 1; the step is applied on no rank (two slots: the ranks that committed it
go back to the state before it, bit for bit), nothing stays gathered, and training on equals a run that
never saw the batch. With `swap_slots: 1` (written in place, nothing to go back to) every rank refuses
the next step until a checkpoint load, after which training equals that run too.

Rank 1's writes of its `exp_avg` swap files fail past the first sub-group (an EIO injected at
os.pwritev, the aio workers' write) in the step of batch FAILED only; parameters on NVMe too (fp32
files, which then read the master from the optimizer's files) or in memory, with persistent parameters
(the biases) or none (then the outcome rides an all-gather of its own), two param groups (a flat each),
and Lamb, whose first pass ends in an all-reduce of norms (before, rank 0 waited there)."""
from __future__ import annotations

import contextlib
import errno
import os

import torch

from tests.harness import run_distributed

FAILING_RANK = 1
STEPS, FAILED = 4, 2


def _engine(path: str, persistent: int, slots: int, param_nvme: bool, groups: int, optimizer: str, bf16: bool):
    import engine
    model, params = model_and_groups(groups)
    zero = {"stage": 3, "stage3_param_persistence_threshold": persistent, "sub_group_size": 512,
            "offload_optimizer": {"device": "nvme", "nvme_path": path, "swap_slots": slots}}
    if param_nvme:
        zero["offload_param"] = {"device": "nvme", "nvme_path": path, "max_in_cpu": 0}
    return engine.initialize(model=model, model_parameters=params, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "optimizer": {"type": optimizer, "params": {"lr": 0.01}},
        "aio": {"block_size": 4096}})[0]


def model_and_groups(groups: int) -> tuple[torch.nn.Module, list[dict]]:
    """The test's model, seeded, and its parameters in `groups` param groups: a flat each, stepped one after
    the other."""
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (torch.nn.Linear(32, 32), torch.nn.Tanh())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(32, 4))
    params = list(model.parameters())
    return model, [{"params": [p for i, p in enumerate(params) if i // 2 % groups == k], "weight_decay": 0.01 * k}
                   for k in range(groups)]


@contextlib.contextmanager
def swap_io_fails(armed: bool, call: str, fails):
    """FAILING_RANK's `os.<call>` ("preadv" or "pwritev": the aio workers' reads and writes) raises EIO
    where `fails(file name, byte offset)`, while `armed`."""
    real = getattr(os, call)

    def failing(fd, buffers, at):
        if fails(os.readlink(f"/proc/self/fd/{fd}"), at):
            raise OSError(errno.EIO, f"injected {'read' if call == 'preadv' else 'write'} error")
        return real(fd, buffers, at)
    if armed and torch.distributed.get_rank() == FAILING_RANK:
        setattr(os, call, failing)
    try:
        yield
    finally:
        setattr(os, call, real)


def _state_writes_fail(armed: bool, groups: int, state: str = "exp_avg"):
    """FAILING_RANK's writes of its `state` swap files past the first sub-group fail (EIO) while `armed`,
    of the last param group's flat only (the others are stepped and committed first)."""
    return swap_io_fails(armed, "pwritev",
                         lambda name, at: f"group{groups - 1}-" in name and f".{state}." in name and at > 0)


def _weights(eng) -> list[torch.Tensor]:
    import engine
    params = list(eng.module.parameters())
    with engine.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def _train(eng, data, fail_at: int | None, errors: dict, batches, groups: int = 1) -> None:
    for i in batches:
        x, y = data[i]
        try:
            eng.backward(torch.nn.functional.mse_loss(eng(x.to(eng.module[0].weight.dtype)).float(), y))
            with _state_writes_fail(i == fail_at, groups):
                eng.step()
        except RuntimeError as err:
            errors.setdefault(i, []).append((type(err).__name__, str(err)))


def rank_batches(n: int) -> list:
    """`n` (input, target) batches of this rank's own: ranks draw different data, as data parallelism does."""
    g = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    return [(torch.randn(2, 32, generator=g), torch.randn(2, 4, generator=g)) for _ in range(n)]


def _run(tmp: str, persistent: int, slots: int, param_nvme: bool, groups: int, optimizer: str, bf16: bool) -> dict:
    """The failing run and a reference without batch FAILED, one after the other on the same ranks."""
    data = rank_batches(STEPS)
    out = {"errors": {}}
    for name in ("ref", "fail"):
        path = os.path.join(tmp, name)
        os.makedirs(path, exist_ok=True)
        eng = _engine(path, persistent, slots, param_nvme, groups, optimizer, bf16)
        assert bool(eng.zero_optimizer.persistent) == bool(persistent)
        assert len(eng.zero_optimizer.nvme.parts) == groups
        if name == "ref":
            _train(eng, data, None, out["errors"], [i for i in range(STEPS) if i != FAILED])
        else:
            eng.save_checkpoint(os.path.join(path, "ckpt"), tag="start")
            _train(eng, data, FAILED, out["errors"], range(STEPS), groups)
            coord = eng.zero_optimizer.coordinator
            out["left"] = ([g.name for g in coord.groups if g.gathered], sorted(coord.pending), coord.in_pass)
            if slots == 1:  # refused (batch 3 above) until a load; then the reference's batches
                eng.load_checkpoint(os.path.join(path, "ckpt"), tag="start")
                _train(eng, data, None, out["errors"], [i for i in range(STEPS) if i != FAILED])
        out[name] = _weights(eng)
        eng.destroy()
    return out


def _check(tmp_path, persistent: int = 32, slots: int = 2, param_nvme: bool = True, groups: int = 1,
           optimizer: str = "AdamW", bf16: bool = False) -> None:
    ranks = run_distributed(_run, world_size=2, args=(str(tmp_path), persistent, slots, param_nvme, groups,
                                                      optimizer, bf16), timeout=60)
    check_ranks(ranks, slots, "exp_avg")
    for out in ranks:
        assert out["left"] == ([], [], False), out["left"]


def check_ranks(ranks: list[dict], slots: int, state: str) -> None:
    """Every rank raised at batch FAILED (FAILING_RANK its OffloadIOError naming its `state` file, the
    others PeerStepError naming it), with one slot again at the next step, and ends bit for bit equal to
    the reference run."""
    for rank, out in enumerate(ranks):
        errors = out["errors"]
        assert sorted(errors) == ([FAILED] if slots == 2 else [FAILED, FAILED + 1]), errors
        (kind, msg), = errors[FAILED]
        if rank == FAILING_RANK:  # its own error, naming the swap file and the key
            assert kind == "OffloadIOError" and f".{state}." in msg and "offload_optimizer.nvme_path" in msg, msg
        else:
            assert kind == "PeerStepError" and f"rank {FAILING_RANK}'s optimizer step failed" in msg, msg
            assert "\n" not in msg
        if slots == 1:
            (kind, msg), = errors[FAILED + 1]
            assert kind == "OffloadIOError" and "load a checkpoint" in msg, (rank, msg)
        for a, b in zip(out["fail"], out["ref"]):
            assert torch.equal(a, b), (rank, (a - b).abs().max())


def test_one_rank_failing_its_step_fails_it_on_every_rank(tmp_path):
    _check(tmp_path)


def test_bf16_parameter_files(tmp_path):
    # the step writes the 16-bit parameter files (their master is the optimizer's): undone there too
    _check(tmp_path, bf16=True)


def test_without_persistent_parameters(tmp_path):
    _check(tmp_path, persistent=0)


def test_parameters_in_memory(tmp_path):
    _check(tmp_path, param_nvme=False)


def test_the_failing_rank_undoes_the_flats_it_stepped_before_the_failure(tmp_path):
    # two param groups: rank 1 commits the first flat's step, then fails in the second's
    _check(tmp_path, groups=2)


def test_in_place_slots_refuse_until_a_load(tmp_path):
    _check(tmp_path, slots=1, param_nvme=False)


def test_lamb_fails_in_its_first_pass_on_every_rank(tmp_path):
    # Lamb's moments pass writes exp_avg, then every rank sums the norms: before, rank 0 waited in that sum
    _check(tmp_path, optimizer="Lamb")
