"""`dstrain plot RUN_DIR`: the csv monitor's files as curves in one PNG (loss, learning rate,
throughput, memory against global samples). RUN_DIR is `<output_path>/<job_name>` of `csv_monitor`,
or a folder above it (the first folder below it holding `Train_Samples_*.csv` is used). Needs
matplotlib (`pip install 'dstrain[plot]'`)."""
from __future__ import annotations

import csv
from pathlib import Path

# (panel title, y label, csv file stems to draw in it; the first that exists in a panel wins for tokens)
PANELS = (
    ("loss", "train loss", ("Train_Samples_train_loss",)),
    ("learning rate", "lr", ("Train_Samples_lr",)),
    ("throughput", "per second", ("Train_Samples_tokens_per_sec", "Train_Samples_samples_per_sec")),
    ("memory", "MB", ("Train_Samples_peak_memory_MB",)),
)


class PlotError(Exception):
    pass


def read_series(path: Path) -> tuple[str, list[float], list[float]]:
    """(value name, steps, values) of one csv monitor file; a resumed run's repeated header is skipped."""
    steps, values, name = [], [], path.stem
    with path.open(newline="") as f:
        for line_no, row in enumerate(csv.reader(f), start=1):
            if len(row) != 2:
                raise PlotError(f"{path}:{line_no}: expected 2 columns (step,value), got {len(row)}")
            if row[0] == "step":
                name = row[1]
                continue
            try:
                steps.append(float(row[0]))
                values.append(float(row[1]))
            except ValueError:
                raise PlotError(f"{path}:{line_no}: not a number: {','.join(row)}") from None
    return name, steps, values


def find_csv_dir(run_dir: Path) -> Path:
    if not run_dir.is_dir():
        raise PlotError(f"{run_dir}: no such directory (give csv_monitor's <output_path>/<job_name>)")
    for candidate in [run_dir, *sorted(p for p in run_dir.rglob("*") if p.is_dir())]:
        if any(candidate.glob("Train_Samples_*.csv")):
            return candidate
    raise PlotError(f"{run_dir}: no Train_Samples_*.csv files below it; enable csv_monitor in the config "
                    "and give its <output_path>/<job_name>")


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the run's curves; returns the PNG's path (default RUN_DIR/dstrain_plot.png)."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("dstrain plot needs matplotlib: pip install 'dstrain[plot]'") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    csv_dir = find_csv_dir(Path(run_dir))
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (title, ylabel, stems) in zip(axes.flat, PANELS):
        drawn = False
        for stem in stems:
            path = csv_dir / f"{stem}.csv"
            if path.exists():
                name, steps, values = read_series(path)
                ax.plot(steps, values, label=name)
                drawn = True
        ax.set_title(title)
        ax.set_xlabel("global samples")
        ax.set_ylabel(ylabel)
        if drawn:
            ax.legend(loc="best", fontsize="small")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(str(csv_dir))
    fig.tight_layout()
    target = Path(out) if out else csv_dir / "dstrain_plot.png"
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target
