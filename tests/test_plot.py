"""`dstrain plot RUN_DIR` draws a small run's csv monitor files as curves in a PNG."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.cli import main
from tests.harness import run_distributed
from tests.models import OddMLP


def _small_run(out: str) -> None:
    import engine
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "mfu": {"peak_tflops": 1.0},
           "csv_monitor": {"enabled": True, "output_path": str(Path(out) / "csv"), "job_name": "demo"}}
    (Path(out) / "cfg.json").write_text(json.dumps(cfg))
    eng, _, _, _ = engine.initialize(model=OddMLP(), config=str(Path(out) / "cfg.json"))
    for _ in range(5):
        eng.backward(eng(torch.randn(4, 13), torch.randn(4, 5)))
        eng.step()
    eng.destroy()


def test_plot_makes_a_png_with_the_curves(tmp_path, capsys):
    from matplotlib.image import imread
    run_distributed(_small_run, 1, args=(str(tmp_path),), timeout=90)
    assert main(["plot", str(tmp_path / "csv")]) == 0  # a folder above <output_path>/<job_name> works too
    png = tmp_path / "csv" / "demo" / "dstrain_plot.png"
    assert capsys.readouterr().out.strip() == f"wrote {png}"
    image = imread(png)
    assert image.shape[:2] == (700, 1100)
    # Curves are drawn in matplotlib's first colour (#1f77b4); axes and text are black and grey.
    blue = (abs(image[..., 0] - 0x1F / 255) < 0.02) & (abs(image[..., 1] - 0x77 / 255) < 0.02) \
        & (abs(image[..., 2] - 0xB4 / 255) < 0.02)
    assert blue.sum() > 500


def test_plot_without_csv_files_is_one_line_naming_the_folder(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {tmp_path}: no Train_Samples_*.csv files below it; enable csv_monitor in the config "
                   "and give its <output_path>/<job_name>")


def test_a_malformed_csv_names_file_and_line(tmp_path, capsys):
    (tmp_path / "Train_Samples_lr.csv").write_text("step,lr\n6,0.1\n12,oops\n")
    assert main(["plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'Train_Samples_lr.csv'}:3: not a number: 12,oops"
