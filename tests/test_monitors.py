"""Monitors (engine/monitors): DeepSpeed's tags, file layout and x-axis (global samples), written on
rank 0 only, with values checked against a single-process reference run with SGD (the update is
linear in the gradient, so a wrong loss or gradient scale shows in the logged loss and grad norm).

One 2-rank run writes csv, TensorBoard, wandb and Comet (both offline: no account) at once; the
TensorBoard events are read back with TensorBoard's own reader, the wandb run from its offline history
file, the Comet run from the archive its offline mode writes."""
from __future__ import annotations

import copy
import csv
import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

import schemas
from tests.harness import run_distributed
from tests.models import OddMLP, make_batches, micro_batches

STEPS, WORLD, MICRO, LR = 4, 2, 3, 0.1
PEAK_TFLOPS = 0.5


def _config(out: Path) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 2,
            "gradient_clipping": 0.0,  # clipping would hide a wrong gradient scale from the loss
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "mfu": {"peak_tflops": PEAK_TFLOPS},
            "csv_monitor": {"enabled": True, "output_path": str(out / "csv"), "job_name": "job"},
            "tensorboard": {"enabled": True, "output_path": str(out / "tb"), "job_name": "job"},
            "wandb": {"enabled": True, "project": "dstrain-test", "group": "g"},
            "comet": {"enabled": True, "project": "dstrain-test", "online": False, "samples_log_interval": 1}}


def _train(out: str):
    import engine
    torch.manual_seed(0)
    model = OddMLP()
    config_file = Path(out) / f"ds_config_{os.environ['RANK']}.json"
    config_file.write_text(json.dumps(_config(Path(out))))
    eng, _, _, _ = engine.initialize(model=model, config=str(config_file))
    rank = int(os.environ["RANK"])
    for x, y in make_batches(STEPS, WORLD * MICRO):
        for xm, ym in micro_batches(x, y, rank, WORLD, 1):
            eng.backward(eng(xm, ym))
            eng.step()
        eng.log_scalars({"User/score": 10.0 * eng.global_steps})
    eng.monitor.write_events([("User/ds_style", 1.5, 7)])
    eng.destroy()
    return rank


def _reference():
    """Single process, global batch: the loss before each step and the gradient norm."""
    torch.manual_seed(0)
    model = copy.deepcopy(OddMLP())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for x, y in make_batches(STEPS, WORLD * MICRO):
        loss = model(x, y)
        loss.backward()
        norms.append(float(torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))))
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, norms


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("monitors")
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(out / "wandb"), "WANDB_SILENT": "true",
           "COMET_OFFLINE_DIRECTORY": str(out / "comet")}
    (out / "wandb").mkdir()
    run_distributed(_train, WORLD, args=(str(out),), timeout=120, env=env)
    return out


def _csv(path: Path) -> tuple[list[str], list[tuple[int, float]]]:
    rows = list(csv.reader(path.open()))
    return rows[0], [(int(s), float(v)) for s, v in rows[1:]]


def test_csv_files_headers_rows_and_values_match_the_reference(run_dir):
    losses, norms = _reference()
    job = run_dir / "csv" / "job"
    samples = [WORLD * MICRO * (i + 1) for i in range(STEPS)]  # x-axis: global samples
    header, rows = _csv(job / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"]
    assert [s for s, _ in rows] == samples
    assert [v for _, v in rows] == pytest.approx(losses, rel=1e-5)
    header, rows = _csv(job / "Train_Samples_grad_norm.csv")
    assert header == ["step", "grad_norm"] and [v for _, v in rows] == pytest.approx(norms, rel=1e-5)
    header, rows = _csv(job / "Train_Samples_lr.csv")
    assert header == ["step", "lr"] and [v for _, v in rows] == [LR] * STEPS
    _, skipped = _csv(job / "Train_Samples_skipped_steps.csv")
    assert [v for _, v in skipped] == [0.0] * STEPS
    assert _csv(job / "User_score.csv") == (["step", "score"], [(s, 10.0 * (i + 1)) for i, s in enumerate(samples)])
    assert _csv(job / "User_ds_style.csv") == (["step", "ds_style"], [(7, 1.5)])


def test_tflops_and_mfu_follow_the_counted_flops(run_dir):
    job = run_dir / "csv" / "job"
    _, sps = _csv(job / "Train_Samples_samples_per_sec.csv")
    _, tflops = _csv(job / "Train_Samples_TFLOPS.csv")
    _, mfu = _csv(job / "Train_Samples_MFU.csv")
    fwd_per_sample = 2 * (13 * 37 + 37 * 37 + 37 * 5)  # OddMLP's three matmuls, 2 FLOPs per MAC
    for (_, s), (_, t), (_, m) in zip(sps, tflops, mfu):
        assert t == pytest.approx(3 * fwd_per_sample * s / WORLD / 1e12, rel=1e-6)
        assert m == pytest.approx(t / PEAK_TFLOPS, rel=1e-6)
    assert len(tflops) == STEPS  # counted on step 1, so known from step 1 on


def test_tensorboard_events_read_back_with_tensorboards_reader(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    losses, _ = _reference()
    acc = EventAccumulator(str(run_dir / "tb" / "job"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/grad_norm", "Train/Samples/MFU",
            "Train/Samples/samples_per_sec", "User/score"} <= tags
    events = acc.Scalars("Train/Samples/train_loss")
    assert [e.step for e in events] == [WORLD * MICRO * (i + 1) for i in range(STEPS)]
    assert [e.value for e in events] == pytest.approx(losses, rel=1e-5)


def _wandb_records(path: Path):
    """The protobuf records of a wandb transaction log: a 7-byte `:W&B` header, then LevelDB's log
    format (32 KiB blocks of chunks with a 7-byte header: crc32c, length, type FULL/FIRST/MIDDLE/LAST)."""
    raw, block, pos, pending = path.read_bytes(), 32768, 7, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(raw[pos + 4:pos + 6], "little"), raw[pos + 6]
        chunk, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue  # zero fill
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            yield pending


def test_wandb_offline_history(run_dir):
    losses, _ = _reference()
    runs = list((run_dir / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1  # rank 0 only
    from wandb.proto import wandb_internal_pb2
    logged = []
    for data in _wandb_records(next(runs[0].glob("*.wandb"))):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            if "Train/Samples/train_loss" in items:
                logged.append((items["_step"], items["Train/Samples/train_loss"]))
    assert [s for s, _ in logged] == [WORLD * MICRO * (i + 1) for i in range(STEPS)]
    assert [v for _, v in logged] == pytest.approx(losses, rel=1e-5)


def test_comet_offline_archive(run_dir):
    losses, _ = _reference()
    archives = list((run_dir / "comet").glob("*.zip"))
    assert len(archives) == 1  # rank 0 only
    with zipfile.ZipFile(archives[0]) as z:
        messages = [json.loads(line) for line in z.read("messages.json").splitlines() if line.strip()]
    metrics = [m["payload"]["metric"] for m in messages if m["type"] == "metric_msg"]
    logged = [(m["step"], m["metricValue"]) for m in metrics if m["metricName"] == "Train/Samples/train_loss"]
    assert [s for s, _ in logged] == [WORLD * MICRO * (i + 1) for i in range(STEPS)]
    assert [float(v) for _, v in logged] == pytest.approx(losses, rel=1e-5)


def test_only_rank_zero_writes(run_dir):
    # Each monitor writes one directory: csv/job, tb/job with one events file, one wandb run.
    assert len(list((run_dir / "tb" / "job").glob("events.out.tfevents.*"))) == 1
    assert all(sum(1 for _ in p.open()) == STEPS + 1 for p in (run_dir / "csv" / "job").glob("Train_*.csv"))


def test_a_missing_library_is_one_line_naming_the_key_and_the_install(monkeypatch):
    import sys

    from engine.monitors import build_monitors
    monkeypatch.setitem(sys.modules, "wandb", None)  # Python's own spelling of "not importable"
    cfg = schemas.load_config({"train_batch_size": 1, "wandb": {"enabled": True}}, world_size=1)
    with pytest.raises(schemas.ConfigError) as err:
        build_monitors(cfg, rank=0)
    assert str(err.value) == ("wandb.enabled: true needs the `wandb` package, which is not installed: "
                              "pip install 'dstrain[wandb]' (or set wandb.enabled to false)")
    assert build_monitors(cfg, rank=1).enabled is False  # other ranks build nothing, so need nothing


def _resumed_training(out: str):
    """8 steps, a checkpoint, a load whose tail takes 0.8 s, then 4 steps of 0.2 s each: the log line and monitors."""
    import contextlib
    import io
    import time

    import engine
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 4, "optimizer": {"type": "SGD", "params": {"lr": LR}},
           "mfu": {"peak_tflops": PEAK_TFLOPS},
           "csv_monitor": {"enabled": True, "output_path": str(Path(out) / "csv"), "job_name": "job"}}
    eng, *_ = engine.initialize(model=OddMLP(), config={**cfg, "csv_monitor": {"enabled": False}})
    for x, y in make_batches(8, 2):
        eng.backward(eng(x, y))
        eng.step()
    eng.save_checkpoint(str(Path(out) / "ck"))
    eng.destroy()
    eng, *_ = engine.initialize(model=OddMLP(), config=cfg)
    # A slow tail of the load (a loaded machine's RNG restore, say) is load time, not training time.
    from engine.checkpoint import restore
    restore_rng = restore._restore_rng
    restore._restore_rng = lambda *a: (time.sleep(0.8), restore_rng(*a))
    eng.load_checkpoint(str(Path(out) / "ck"))
    restore._restore_rng = restore_rng
    log = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(log):
        for x, y in make_batches(4, 2):
            time.sleep(0.2)
            eng.backward(eng(x, y))
            eng.step()
    measured = 4 * 2 / (time.perf_counter() - start)
    eng.destroy()
    return log.getvalue(), measured


def test_a_resumed_run_logs_the_rate_of_its_own_steps_and_counts_flops(tmp_path):
    log, measured = run_distributed(_resumed_training, 1, args=(str(tmp_path),), timeout=120)[0]
    line = next(line for line in log.splitlines() if "step 12 " in line)
    logged = float(line.split(" samples/s")[0].split("| ")[-1])
    assert logged == pytest.approx(measured, rel=0.25)  # all 12 steps over this run's time: 3x
    assert "TFLOPS" in line and "MFU" in line
    _, tflops = _csv(tmp_path / "csv" / "job" / "Train_Samples_TFLOPS.csv")
    assert [s for s, _ in tflops] == [2 * step for step in range(9, 13)]


class _StepFailsOnce(torch.optim.SGD):
    """A client optimizer whose second step raises (a user check, a failed swap: the caller trains on)."""

    def __init__(self, params):
        super().__init__(params, lr=LR)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("step refused")
        return super().step(closure)


def test_a_step_that_raised_leaves_its_losses_out_of_the_next_steps_train_loss(tmp_path):
    import engine
    torch.manual_seed(0)
    model = OddMLP()
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
           "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}}
    eng, *_ = engine.initialize(model=model, optimizer=_StepFailsOnce(model.parameters()), config=cfg)
    windows = make_batches(3, 2 * MICRO)
    reported, means = [], []
    for x, y in windows:
        losses = []
        try:
            for xm, ym in micro_batches(x, y, 0, 1, 2):
                losses.append(float(eng.backward(eng(xm, ym)).detach()))
                eng.step()
        except RuntimeError as err:
            assert "step refused" in str(err)
            continue
        reported.append(eng.metrics.train_loss)
        means.append(sum(losses) / len(losses))
    eng.destroy()
    # the failed window is dropped whole: its gradients, and the next micro-step starts a window (engine.py)
    torch.manual_seed(0)
    reference = OddMLP()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for x, y in (windows[0], windows[2]):
        for xm, ym in micro_batches(x, y, 0, 1, 2):
            (reference(xm, ym) / 2).backward()
        opt.step()
        opt.zero_grad()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], p, rtol=1e-6, atol=1e-7, msg=name)
    assert len(reported) == 2, reported
    assert reported == pytest.approx(means, rel=1e-6), (reported, means)  # the failed window's losses dropped
