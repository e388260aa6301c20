"""The benchmark suite's PNG plots (benchmarks/suite.py): matplotlib is an optional extra (`plot`)."""
from __future__ import annotations

from pathlib import Path


def draw(out_base: Path, results: dict, scaling: dict) -> list[str]:
    """`<out_base>-step_time.png` (every system's median step) and `<out_base>-scaling.png` (step time and
    peak RSS against model and world size); returns the file names made, or one line saying why none were."""
    try:
        import matplotlib
    except ImportError:
        return ["plots not made: matplotlib is not installed (pip install 'dstrain[plot]')"]
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    made = []
    names = [n for n, r in results.items() if r.step_ms() is not None]
    # One bar per system, each label legible (a fixed 4-inch figure overlapped 38 labels), top to bottom
    # in the report's order, coloured by whose system it is.
    fig, ax = plt.subplots(figsize=(10, max(4.0, 0.26 * len(names) + 1.0)))
    colors = ["C1" if n.startswith("deepspeed") else "C0" if n.startswith("dstrain") else "C2" for n in names]
    ax.barh(names, [results[n].step_ms() for n in names], color=colors)
    ax.invert_yaxis()
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in ("C0", "C1", "C2")],
              labels=["dstrain", "DeepSpeed, same config", "torch / bound"], loc="lower center",
              bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    ax.set_xlabel("step ms (median over rounds)")
    fig.tight_layout()
    fig.savefig(f"{out_base}-step_time.png", dpi=100)
    made.append(f"{out_base.name}-step_time.png")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (key, xlabel) in zip(axes, (("size", "parameters (M)"), ("world", "world size"))):
        points = [(x, r) for x, r in scaling[key] if r.error is None]
        ax.plot([x for x, _ in points], [r.step_ms for _, r in points], "o-", label="step ms")
        ax2 = ax.twinx()
        ax2.plot([x for x, _ in points], [r.rss_mb for _, r in points], "s--", color="C1", label="peak RSS/rank MB")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("step ms")
        ax2.set_ylabel("peak RSS/rank MB")
        ax.legend(handles=ax.get_lines() + ax2.get_lines(), loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2,
                  frameon=False)  # above the axes: both y-axes' points fill the inside
    fig.tight_layout()
    fig.savefig(f"{out_base}-scaling.png", dpi=100)
    plt.close("all")
    made.append(f"{out_base.name}-scaling.png")
    return made
