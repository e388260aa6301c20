"""Checkpoints under faults, and the tools around them.

One 2-rank run (ZeRO 2, fp32) saves periodically with `async_save` and `keep_last`, saves tag "good",
then is killed (SIGKILL, test hook) half-way through writing rank 1's file of tag "doomed". Afterwards:
no partial tag is visible, `latest` still names "good", and a fresh 1-rank job loads it exactly; a
flipped byte or a truncated file is reported with the file's name; `auto_resume` picks up the
periodic checkpoints; `dstrain ckpt info` and `dstrain ckpt consolidate` (torch and safetensors) work,
and the consolidated file loads into the plain model with `load_state_dict`.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

import engine
from engine.checkpoint import CheckpointError
from engine.checkpoint.writer import CRASH_ENV
from engine.cli import main as cli_main
from tests.harness import RankFailed, run_distributed
from tests.models import OddMLP, make_batches, micro_batches


def _config(root: Path, **checkpoint) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 600},
            "checkpoint": {"save_dir": str(root / "periodic"), **checkpoint}}


def _train(eng, steps: int, record=None) -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for x, y in make_batches(steps, 2 * world, seed=eng.global_steps):
        for xm, ym in micro_batches(x, y, rank, world, 1):
            eng.backward(eng(xm, ym))
            eng.step()
        if record is not None:
            record(eng)


def _weights(eng) -> dict:
    return {k: v.clone() for k, v in eng.module.state_dict().items()}


def _save_then_crash(root: str):
    root = Path(root)
    torch.manual_seed(0)
    eng, _, _, _ = engine.initialize(model=OddMLP(), config=_config(root, save_interval=2, keep_last=2,
                                                                      async_save=True))
    rank0 = torch.distributed.get_rank() == 0

    def record(e):
        if e.global_steps == 8 and rank0:
            torch.save(_weights(e), root / "step8.pt")
    _train(eng, 7, record)  # periodic async saves at steps 2, 4, 6 (and 8 below); keep_last 2
    eng.save_checkpoint(root / "manual", tag="good", client_state={"note": "good"})
    eng.wait_for_checkpoint()
    if rank0:
        torch.save(_weights(eng), root / "good.pt")
    _train(eng, 1, record)
    eng.wait_for_checkpoint()  # step 8's async save must not see the crash hook below
    os.environ[CRASH_ENV] = "1"  # rank 1 SIGKILLs itself half-way through its file
    eng.save_checkpoint(root / "manual", tag="doomed")
    eng.wait_for_checkpoint()
    return "survived"


def _load_error(eng, root: Path, tag: str) -> str:
    try:
        eng.load_checkpoint(root / "manual", tag=tag)
    except CheckpointError as e:
        return str(e)
    return "no error"


def _damage(root: Path) -> None:
    manual = root / "manual"
    shutil.copytree(manual / "good", manual / "flipped")
    data = bytearray((manual / "flipped" / "rank_00001.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (manual / "flipped" / "rank_00001.pt").write_bytes(bytes(data))
    shutil.copytree(manual / "good", manual / "truncated")
    with open(manual / "truncated" / "engine_state.pt", "r+b") as f:
        f.truncate(100)


def _after_crash(root: str):
    root = Path(root)
    torch.manual_seed(5)
    eng, _, _, _ = engine.initialize(model=OddMLP(), config=_config(root))
    path, client = eng.load_checkpoint(root / "manual")
    out = {"path": path, "client": client, "loaded": _weights(eng)}
    _damage(root)
    out["errors"] = {tag: _load_error(eng, root, tag) for tag in ("flipped", "truncated")}
    out["nothing"] = eng.load_checkpoint(root / "empty")
    torch.manual_seed(6)
    resumed, _, _, _ = engine.initialize(model=OddMLP(), config=_config(root, auto_resume=True))
    out["resumed"] = (resumed.global_steps, _weights(resumed))
    return out


@pytest.fixture(scope="module")
def crashed():
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with pytest.raises(RankFailed) as failure:
            run_distributed(_save_then_crash, 2, args=(str(root),), timeout=180)
        listing = sorted(p.name for p in (root / "manual").iterdir())
        latest = (root / "manual" / "latest").read_text()
        after = run_distributed(_after_crash, 1, args=(str(root),), timeout=180)[0]
        yield root, str(failure.value), listing, latest, after


def test_kill_mid_save_leaves_previous_tag(crashed):
    root, failure, listing, latest, after = crashed
    assert "rank 1 exited with -9" in failure and "survived" not in failure
    assert latest == "good"
    assert [n for n in listing if not n.startswith(".")] == ["good", "latest"]  # no partial tag visible
    assert any(n.startswith(".doomed.tmp-") for n in listing)
    assert after["path"].endswith("manual/good") and after["client"] == {"note": "good"}
    good = torch.load(root / "good.pt", weights_only=True)
    for k, v in good.items():
        assert torch.equal(after["loaded"][k], v), k


def test_damaged_files_are_named(crashed):
    errors = crashed[4]["errors"]
    assert "flipped/rank_00001.pt" in errors["flipped"] and "sha256" in errors["flipped"]
    assert "truncated/engine_state.pt" in errors["truncated"] and "truncated" in errors["truncated"]
    assert crashed[4]["nothing"] == (None, None)


def test_periodic_async_save_keep_last_and_auto_resume(crashed):
    root, after = crashed[0], crashed[4]
    periodic = root / "periodic"
    assert sorted(p.name for p in periodic.iterdir()) == ["global_step6", "global_step8", "latest"]
    steps, weights = after["resumed"]
    assert steps == 8
    for k, v in torch.load(root / "step8.pt", weights_only=True).items():
        assert torch.equal(weights[k], v), k


def test_info_and_consolidate(crashed, capsys):
    root = crashed[0]
    manual = root / "manual"
    assert cli_main(["ckpt", "info", str(manual)]) == 1  # "flipped" and "truncated" are damaged
    report = capsys.readouterr().out
    assert "good (latest): step 7, world size 2, ZeRO stage 2, fp32" in report and "checksums ok" in report
    assert "rank_00001.pt: sha256 mismatch" in report and ".doomed.tmp-" in report
    good = torch.load(root / "good.pt", weights_only=True)
    assert cli_main(["ckpt", "consolidate", str(manual), "--out", str(root / "model.pt")]) == 0
    plain = OddMLP()
    plain.load_state_dict(torch.load(root / "model.pt", weights_only=True))  # strict, no dstrain needed
    for k, v in plain.state_dict().items():
        assert torch.equal(v, good[k]), k
    safetensors = pytest.importorskip("safetensors.torch")
    assert cli_main(["ckpt", "consolidate", str(manual), "--tag", "good", "--out", str(root / "m.safetensors"),
                     "--safetensors", "--dtype", "bf16"]) == 0
    loaded = safetensors.load_file(str(root / "m.safetensors"))
    plain.load_state_dict(loaded)
    for k, v in loaded.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, good[k].to(torch.bfloat16)), k
    assert cli_main(["ckpt", "consolidate", str(manual), "--tag", "flipped", "--out", str(root / "x.pt")]) == 1
    assert "flipped/rank_00001.pt" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["info"], ["consolidate", "--out", "model.pt"]])
def test_a_missing_checkpoint_directory_is_an_error_naming_it(tmp_path, capsys, command):
    missing = str(tmp_path / "absent")
    assert cli_main(["ckpt", command[0], missing, *command[1:]]) == 1  # info said "no checkpoints", exit 0
    assert capsys.readouterr().err == (f"error: {missing}: no such checkpoint directory "
                                       "(give the save_dir holding `latest` and the tags)\n")


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_block_io_writes_and_hashes_exact_bytes(tmp_path, monkeypatch, direct):
    """Writes of odd sizes across block boundaries (and an empty file): the file holds exactly the
    bytes written, and the manifest hash and file_digest agree with hashlib, with and without O_DIRECT."""
    import hashlib
    from engine.checkpoint import blockio
    if not direct:
        monkeypatch.delattr(blockio.os, "O_DIRECT", raising=False)
    monkeypatch.setattr(blockio, "BLOCK", 1 << 16)
    g = torch.Generator().manual_seed(0)
    for sizes in ([], [1, 4095, 70_000, 3, 200_001, 65_536]):
        data = b"".join(bytes(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).tolist()) for n in sizes)
        f = blockio.HashingFile(tmp_path / "x")
        pos = 0
        for n in sizes:
            f.write(data[pos:pos + n])
            pos += n
        entry = f.close()
        assert (tmp_path / "x").read_bytes() == data
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        assert blockio.file_digest(tmp_path / "x", chunk=1 << 15) == (entry["sha256"], len(data))
