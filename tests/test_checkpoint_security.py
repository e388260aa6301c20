"""Checkpoints against an attacker (issue 16, point 4): no secret in any saved file, a `latest` that
points outside the directory, dtype names that are not dtypes.

One 1-rank ZeRO-1 run saves with `comet.api_key` set; the rest tampers with copies of that checkpoint
as someone with write access to a shared checkpoint directory could.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

import engine
from engine.checkpoint import CheckpointError
from engine.cli import main as cli_main
from tests.harness import run_distributed
from tests.models import OddMLP, make_batches

SECRET = "comet-s3cr3t-4pi-k3y"


def _config() -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 1}, "comet": {"api_key": SECRET, "project": "p"}}


def _save(root: str):
    torch.manual_seed(0)
    eng, _, _, _ = engine.initialize(model=OddMLP(), config=_config())
    assert eng.config.comet.api_key == SECRET  # the secret is really in the resolved config
    for x, y in make_batches(2, 2, seed=0):
        eng.backward(eng(x, y))
        eng.step()
    eng.save_checkpoint(Path(root) / "ckpt", tag="t1", client_state={"note": "kept"})
    return {k: v.clone() for k, v in eng.module.state_dict().items()}


def _load(root: str, tag=None):
    torch.manual_seed(1)
    eng, _, _, _ = engine.initialize(model=OddMLP(), config=_config())
    try:
        path, _ = eng.load_checkpoint(Path(root) / "ckpt", tag=tag)
    except CheckpointError as e:
        return f"CheckpointError: {e}"
    return f"loaded {path}"


@pytest.fixture(scope="module")
def saved():
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_save, 1, args=(tmp,), timeout=120)
        yield Path(tmp)


def test_no_secret_in_any_saved_file(saved):
    files = [p for p in (saved / "ckpt").rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"metadata.json", "manifest.json", "engine_state.pt", "rank_00000.pt", "latest"}
    for path in files:
        assert SECRET.encode() not in path.read_bytes(), path
    meta = json.loads((saved / "ckpt" / "t1" / "metadata.json").read_text())
    assert meta["config"]["comet"]["api_key"] == "<redacted>" and meta["config"]["comet"]["project"] == "p"
    assert meta["config"]["comet"]["experiment_key"] is None  # unset stays visibly unset


def _fresh_copy(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved / "ckpt", tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_latest_naming_a_path_outside_is_refused(saved, tmp_path):
    ckpt = _fresh_copy(saved, tmp_path)
    shutil.copytree(ckpt / "t1", tmp_path / "outside")  # a loadable checkpoint, but not in this directory
    shutil.rmtree(ckpt / "t1")
    (ckpt / "latest").write_text("../outside")
    (result,) = run_distributed(_load, 1, args=(str(tmp_path),), timeout=120)
    assert result.startswith("CheckpointError: ") and f"{ckpt / 'latest'} (the `latest` pointer)" in result
    assert "'../outside' is not usable" in result and "\n" not in result
    (result,) = run_distributed(_load, 1, args=(str(tmp_path), "../outside"), timeout=120)
    assert result.startswith("CheckpointError: ") and "tag='../outside'" in result
    assert cli_main(["ckpt", "consolidate", str(ckpt), "--out", str(tmp_path / "m.pt")]) == 1
    assert not (tmp_path / "m.pt").exists()


def test_latest_that_is_a_symlink_is_refused(saved, tmp_path, capsys):
    ckpt = _fresh_copy(saved, tmp_path)
    (tmp_path / "elsewhere").write_text("t1")
    os.remove(ckpt / "latest")
    os.symlink(tmp_path / "elsewhere", ckpt / "latest")
    assert cli_main(["ckpt", "consolidate", str(ckpt), "--out", str(tmp_path / "m.pt")]) == 1
    err = capsys.readouterr().err
    assert f"{ckpt / 'latest'}: cannot be read" in err and len(err.strip().splitlines()) == 1


def _set_dtype(ckpt: Path, dtype: str) -> None:
    """Rewrites one parameter's dtype and the manifest entry that guards metadata.json."""
    meta_path, manifest_path = ckpt / "t1" / "metadata.json", ckpt / "t1" / "manifest.json"
    meta = json.loads(meta_path.read_text())
    next(iter(meta["params"].values()))["dtype"] = dtype
    data = json.dumps(meta).encode()
    meta_path.write_bytes(data)
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["metadata.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest_path.write_text(json.dumps(manifest))


def test_dtype_names_go_through_an_allow_list(saved, tmp_path, capsys):
    ckpt = _fresh_copy(saved, tmp_path)
    _set_dtype(ckpt, "load")  # getattr(torch, "load") is a function, not a dtype
    assert cli_main(["ckpt", "consolidate", str(ckpt), "--out", str(tmp_path / "m.pt")]) == 1
    err = capsys.readouterr().err
    assert "metadata.json: parameter" in err and "dtype 'load' is not a tensor dtype" in err
    assert "Traceback" not in err
    (result,) = run_distributed(_load, 1, args=(str(tmp_path),), timeout=120)
    assert "dtype 'load' is not a tensor dtype" in result


def test_untampered_checkpoint_still_loads(saved, tmp_path):
    _fresh_copy(saved, tmp_path)
    (result,) = run_distributed(_load, 1, args=(str(tmp_path),), timeout=120)
    assert result == f"loaded {tmp_path / 'ckpt' / 't1'}"


def test_library_code_never_unpickles():
    """What holds (issue 16, point 5), kept holding: every torch.load passes weights_only=True, and no
    library module imports pickle (or a relative) or calls an unsafe yaml loader."""
    import ast
    root = Path(__file__).resolve().parent.parent
    problems = []
    for package in ("engine", "schemas", "ops", "offload", "launcher"):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                where = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                    if any(str(n).split(".")[0] in ("pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve")
                           for n in names):
                        problems.append(f"{where}: imports {names}")
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    call = f"{getattr(node.func.value, 'id', '?')}.{node.func.attr}"
                    kwargs = {k.arg: getattr(k.value, "value", None) for k in node.keywords}
                    if call == "torch.load" and kwargs.get("weights_only") is not True:
                        problems.append(f"{where}: torch.load without weights_only=True")
                    if call in ("yaml.load", "yaml.unsafe_load", "yaml.full_load", "yaml.load_all"):
                        problems.append(f"{where}: {call}")
    assert not problems, problems
