"""The benchmark suite's `--quick` mode (benchmarks/suite.py) writes a report whose every cell holds a
figure or says why not ("not run: why", "n/a: ...", "not counted: ..."), with the header a reader
needs (command, versions, machine, load), the plots, and figures that follow from their definitions:
ratios from the step times, and bytes per step in the suite's one convention, the bytes one rank
sends (benchmarks/comm_bytes.py: ring all-reduce 2(n-1)/n of the buffer, reduce-scatter and all-gather
(n-1)/n of the full tensor). On 2 ranks that is 4 bytes per fp32 parameter both for DDP (one all-reduce
of every gradient, counted in a comm hook) and for ZeRO-1 (reduce-scatter of the gradients + all-gather
of the parameters, dstrain's communicator counter): the ZeRO paper's equal volume. The dispatch-mode
counter is checked on real gloo collectives of known sizes, and DeepSpeed's comms_logger conversion
on the record its ZeRO-2 makes (reduce per owner, all-gather logged by its input shard). A DeepSpeed row
whose error is DeepSpeed's own known behaviour says why (a stand-in for DeepSpeed's python prints it)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from benchmarks.comm_bytes import DispatchBytes, bytes_sent, deepspeed_logged_payloads
from examples.gpt import GPT, count_parameters
from tests.harness import run_distributed
from tests.report_format import is_figure_or_reason, missing_header_lines, ratio_matches, tables

REPO = Path(__file__).resolve().parent.parent
SYSTEMS = ("ddp", "dstrain-z1", "dstrain-tp2-z3", "dstrain-pipe2-z3", "dstrain-pipe2-dp2-z3", "dstrain-z2-bf16")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("suite")
    # The smallest run that still fills every column: one torch peer, ZeRO-1, the model-parallel ZeRO-3
    # rows (pipe 2 x data 2 on 4 ranks: a spawn of its own), the mixed-precision ZeRO-2; no DeepSpeed.
    done = subprocess.run([sys.executable, "-m", "benchmarks.suite", "--quick", "--systems", ",".join(SYSTEMS),
                           "--worlds", "2", "--scaling-system", "dstrain-z1", "--no-deepspeed", "--out-dir", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = out.glob("*-quick.md")
    return out, path.read_text()


def test_every_cell_is_a_figure_or_says_why_not(report):
    _, text = report
    main, scaling = tables(text)
    header, *rows = main
    strategies = [s for s in SYSTEMS if s != "ddp"]
    labels = [f"{s} (4 ranks)" if s == "dstrain-pipe2-dp2-z3" else s for s in SYSTEMS]
    assert [r[0] for r in rows] == labels + [f"deepspeed ({s}'s config){' (4 ranks)' if '-dp2-' in s else ''}"
                                             for s in strategies]
    for row in rows + scaling[1:]:
        assert len(row) == len(header) if row in rows else len(row) == 3
        for cell in row[1:]:
            assert cell and (is_figure_or_reason(cell) or cell.startswith(("parameters (M) = ", "world size = "))), \
                (row[0], cell)
    for row in rows[:len(SYSTEMS)]:  # every dstrain and torch row ran (only its DeepSpeed ratio is "not run")
        assert [c for c in row if c.startswith("not run")] in ([], ["not run: DeepSpeed: --no-deepspeed given"]), row
    for deepspeed in rows[len(SYSTEMS):]:
        assert deepspeed[1] == "not run: --no-deepspeed given", deepspeed
    assert [r[0] for r in scaling[1:]] == ["parameters (M) = 0.01", "parameters (M) = 0.02", "parameters (M) = 0.07",
                                          "world size = 2"]


def test_header_says_command_versions_machine_load_and_how_bytes_are_counted(report):
    _, text = report
    assert missing_header_lines(text) == []
    assert "- command: `python -m benchmarks.suite --quick --systems ddp,dstrain-z1" in text
    assert re.search(r"- versions: .*, deepspeed not installed", text)
    for who in ("dstrain", "dstrain's pipeline and tensor-parallel rows", "ddp", "fsdp2", "deepspeed"):
        assert f"- bytes/step/rank of {who}: " in text


def test_ratios_and_bytes_follow_from_their_definitions(report):
    from benchmarks.suite import QUICK_MODEL
    _, text = report
    _, ddp, z1, *_ = tables(text)[0]
    step = {row[0]: float(row[1].split()[0]) for row in (ddp, z1)}
    assert ratio_matches(z1[3], step["dstrain-z1"], step["ddp"]), (z1[3], step)
    bound = float(re.search(r"- no-communication bound .*: ([\d.]+)", text).group(1))  # the header's figure
    assert ratio_matches(z1[6], step["dstrain-z1"], bound), (z1[6], step, bound)
    psi = count_parameters(GPT(QUICK_MODEL))
    # bytes one rank sends on 2 ranks: ZeRO-1 reduce-scatters 4Ψ and all-gathers 4Ψ, half of each leaves
    # the rank; DDP's ring all-reduce of 4Ψ sends 2(n-1)/n = 1 x 4Ψ. Equal, as the ZeRO paper says.
    assert float(z1[9].split()[0]) == pytest.approx(4 * psi / 2**20, rel=0.05)  # + padding and the norm's scalars
    assert float(ddp[9].split()[0]) == pytest.approx(4 * psi / 2**20, abs=0.0006)  # every gradient once
    assert float(z1[8]) == pytest.approx((8 * psi + 8 * psi / 2) / 2**20, abs=0.01)  # ZeRO-1 formula, 2 ranks


def test_model_parallel_and_mixed_precision_rows_follow_from_their_definitions(report):
    """The new rows' bytes and ZeRO-formula memory against counts from the model's shapes: on 2 ranks
    ZeRO-3 under tensor or pipeline parallelism has a data axis of one rank, so it sends exactly what
    the model parallelism does, and its formula is the whole 16 bytes of its share per parameter."""
    from benchmarks.bench_training import MICRO
    from benchmarks.suite import QUICK_MODEL as m, STRATEGIES
    _, text = report
    rows = {r[0]: r for r in tables(text)[0]}
    psi = count_parameters(GPT(m))
    mib = 2**20

    def cells(name):
        return float(rows[name][8]), float(rows[name][9].split()[0])
    # AutoTP halves qkv (weight and bias, column), fc (column), proj and out (row: weight only)
    d = m.d_model
    tp_share = psi - m.n_layer * (3 * d * d + 3 * d + d * d + 4 * d * d + 4 * d + 4 * d * d) // 2
    tp = STRATEGIES["dstrain-tp2-z3"][0]
    # each micro-batch: 2 all-reduces of the activations forward, 2 of their gradients backward; on 2
    # ranks a ring all-reduce of S sends S; plus the clipping norm's one float
    tp_bytes = tp["gradient_accumulation_steps"] * 4 * m.n_layer * MICRO * m.seq_len * d * 4 + 4
    assert cells("dstrain-tp2-z3") == (pytest.approx(16 * tp_share / mib, abs=0.005),
                                       pytest.approx(tp_bytes / mib, abs=0.0005))
    # stage 0 holds everything but the final norm (the last stage: the norm and the tied embeddings)
    pipe, stage0 = STRATEGIES["dstrain-pipe2-z3"][0], psi - 2 * d
    sends = pipe["gradient_accumulation_steps"] * pipe["train_micro_batch_size_per_gpu"] * m.seq_len * d * 4
    tied = m.vocab_size * d * 4  # the tied embedding's gradient, all-reduced over the 2 stages
    assert cells("dstrain-pipe2-z3") == (pytest.approx(16 * stage0 / mib, abs=0.005),
                                         pytest.approx((sends + tied) / mib, abs=0.0005))
    # pipe 2 x data 2: the same stage share partitioned over 2 ranks
    formula, sent = cells("dstrain-pipe2-dp2-z3 (4 ranks)")
    assert formula == pytest.approx(16 * stage0 / 2 / mib, abs=0.005) and sent > 0
    # mixed precision (the ZeRO paper's 2Ψ + 2Ψ + 12Ψ, ZeRO-2 partitions the last two): bf16 gradients
    # reduce-scattered and bf16 parameters all-gathered, half of ZeRO-1's fp32 bytes
    assert cells("dstrain-z2-bf16") == (pytest.approx((2 * psi + 14 * psi / 2) / mib, abs=0.005),
                                        pytest.approx(2 * psi / mib, rel=0.05))


def test_plots_are_written(report):
    out, text = report
    for name in re.findall(r"!\[([^\]]+)\]", text):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert len(re.findall(r"!\[", text)) == 2


def _collectives_of_known_size() -> dict:
    """Each c10d op the suite's dispatch mode has a rule for, on a 2-rank gloo group, alone under it."""
    device = torch.device("cpu")
    n, rank = dist.get_world_size(), dist.get_rank()
    x = torch.ones(1000, device=device)  # 4000 bytes
    out = {}
    ops = {"all_reduce": lambda: dist.all_reduce(x),
           "reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.empty(500, device=device), x),
           "all_gather": lambda: dist.all_gather_into_tensor(torch.empty(2000, device=device), x),
           "broadcast": lambda: dist.broadcast(x, src=0),
           "reduce": lambda: dist.reduce(x, dst=0),
           "send": lambda: dist.send(x, dst=1) if rank == 0 else dist.recv(x, src=0)}
    for name, op in ops.items():
        with DispatchBytes() as seen:
            op()
        out[name] = (seen.bytes, dict(seen.payloads), sorted(seen.unknown), n)
    return out


def test_dispatch_mode_counts_bytes_sent_by_the_ring_formula():
    rank0, rank1 = run_distributed(_collectives_of_known_size, 2, timeout=60)
    # all-reduce of 4000 B: 2(n-1)/n x 4000; reduce-scatter of a 4000 B input and all-gather into an
    # 8000 B output: (n-1)/n of the full tensor; reduce and broadcast: (n-1)/n, the group's average
    for row in (rank0, rank1):
        assert row["all_reduce"][:3] == (4000.0, {("all_reduce", 2): 4000}, [])
        assert row["reduce_scatter"][:2] == (2000.0, {("reduce_scatter", 2): 4000})
        assert row["all_gather"][:2] == (4000.0, {("all_gather", 2): 8000})
        assert row["broadcast"][0] == row["reduce"][0] == 2000.0
    assert (rank0["send"][0], rank1["send"][0]) == (4000.0, 0.0)  # what a rank sends; a receive sends nothing


def test_deepspeed_comms_logger_record_converts_to_the_same_convention():
    # DeepSpeed 0.19's ZeRO-2 on gloo, one step of Ψ fp32 parameters on 2 ranks: a reduce to each owner
    # of its half (logged: the slice, 4Ψ in all) and an all_gather_into_tensor logged by its input shard
    # (2Ψ); comms_logger's total (6Ψ) is neither the payload (8Ψ) nor the bytes sent (4Ψ).
    psi = 1000
    payloads, unknown = deepspeed_logged_payloads({"reduce": 4 * psi, "all_gather_into_tensor": 2 * psi,
                                                  "all_reduce": 4, "barrier": 0}, world=2)
    assert unknown == set()
    assert payloads == {("reduce", 2): 4 * psi, ("all_gather", 2): 4 * psi, ("all_reduce", 2): 4}
    assert bytes_sent(payloads) == 4 * psi + 4
    assert deepspeed_logged_payloads({"batch_isend_irecv": 10}, world=2)[1] == {"batch_isend_irecv"}


def test_a_deepspeed_failure_known_as_deepspeeds_own_says_why(tmp_path):
    # A stand-in for DeepSpeed's python that prints the peer's rows: the ZeRO-Infinity row failed as DeepSpeed
    # 0.19.8 does on the 25M GPT (its NVMe parameter swapper's buffers), the other with an error nobody knows.
    from benchmarks import suite
    from benchmarks.suite_strategies import DEEPSPEED_KNOWN_ERRORS
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho '[{\"error\": \"AssertionError: Not enough buffers 0 for swapping 1\"}, "
                    "{\"error\": \"RuntimeError: something new\"}]'\n")
    fake.chmod(0o755)
    items = [(f"deepspeed:{s}", {"model": {}, "config": {}}) for s in ("dstrain-z3-offload-nvme", "dstrain-z3")]
    rounds = suite._deepspeed_peer_call(items, 2, 3, fake, load=0.0)
    (why,) = [w for text, w in DEEPSPEED_KNOWN_ERRORS["dstrain-z3-offload-nvme"] if text == "Not enough buffers"]
    assert rounds["deepspeed:dstrain-z3-offload-nvme"].error == \
        f"{why} (AssertionError: Not enough buffers 0 for swapping 1)"
    assert rounds["deepspeed:dstrain-z3"].error == "RuntimeError: something new"
    # the same text from another strategy's row is not taken for it
    assert suite.deepspeed_error("deepspeed:dstrain-z3", "AssertionError: Not enough buffers 0 for swapping 1") == \
        "AssertionError: Not enough buffers 0 for swapping 1"
