"""The profile as text: a summary, the top modules at each depth, and the per-module tree (DeepSpeed's
three parts; the wording and layout are ours)."""
from __future__ import annotations

from .module_profile import ModuleProfile, ModuleStats

_UNITS = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def si(value: float, unit: str = "", precision: int = 2) -> str:
    """12_340_000 -> '12.34 M' (DeepSpeed's number_to_string style)."""
    for scale, prefix in _UNITS:
        if abs(value) >= scale:
            return f"{value / scale:.{precision}f} {prefix}{unit}"
    text = f"{value:.0f}" if float(value).is_integer() else f"{value:.{precision}f}"
    return f"{text} {unit}".rstrip()


def duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.2f} us"


def summary_lines(fields: list[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in fields) + 2
    return [f"{k + ':':<{width}}{v}" for k, v in fields]


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "0.00%"


def aggregated_lines(profile: ModuleProfile, top_modules: int, module_depth: int) -> list[str]:
    """The `top_modules` largest modules by params, FLOPs and latency at each depth (types merged)."""
    by_depth: dict[int, dict[str, list[float]]] = {}
    for s in profile.stats.values():
        if module_depth >= 0 and s.depth > module_depth:
            continue
        row = by_depth.setdefault(s.depth, {}).setdefault(s.type, [0, 0, 0.0])
        row[0] += s.params
        row[1] += s.flops
        row[2] += s.latency_s
    lines = ["Top modules by parameters, FLOPs and forward latency at each depth:"]
    for depth in sorted(by_depth):
        rows = by_depth[depth]
        lines.append(f"depth {depth}:")
        for label, i, fmt in (("params", 0, si), ("FLOPs", 1, si), ("fwd latency", 2, duration)):
            top = sorted(rows.items(), key=lambda kv: -kv[1][i])[:top_modules]
            lines.append(f"    {label:<12}- " + ", ".join(f"{t}: {fmt(v[i])}" for t, v in top))
    return lines


def detailed_lines(profile: ModuleProfile, module_depth: int) -> list[str]:
    """One line per module, indented by depth: params (share), FLOPs (share), latency (share), FLOPS."""
    root = profile.stats[""]
    lines = ["Per module: params (share), forward FLOPs (share), forward latency (share), achieved FLOPS"]

    def visit(s: ModuleStats) -> None:
        if module_depth >= 0 and s.depth > module_depth:
            return
        label = s.name or s.type
        flops_per_s = s.flops / s.latency_s if s.latency_s > 0 else 0.0
        lines.append(f"{'  ' * s.depth}{label} ({s.type}): {si(s.params)} ({_pct(s.params, root.params)}), "
                     f"{si(s.flops, 'FLOPs')} ({_pct(s.flops, root.flops)}), {duration(s.latency_s)} "
                     f"({_pct(s.latency_s, root.latency_s)}), {si(flops_per_s, 'FLOPS')}")
        for child in s.children:
            visit(profile.stats[child])
    visit(root)
    return lines


def profile_text(profile: ModuleProfile, summary: list[tuple[str, str]], module_depth: int, top_modules: int,
                 detailed: bool) -> str:
    rule = "-" * 30
    parts = [f"{rule} dstrain FLOPs profiler {rule}", *summary_lines(summary), "",
             *aggregated_lines(profile, top_modules, module_depth)]
    if detailed:
        parts += ["", *detailed_lines(profile, module_depth)]
    parts.append("-" * (len(rule) * 2 + 24))
    return "\n".join(parts)
