"""Peak RSS of one measurement when several run in one process (the suite's batches): Linux restarts
its peak mark (VmHWM) when "5" is written to /proc/self/clear_refs. The mark restarts at the current
RSS, so a figure includes the interpreter, torch and what earlier measurements left on the heap.
Imports nothing but the standard library (DeepSpeed's venv imports it too)."""
from __future__ import annotations

import gc
import os
import resource


def restart_peak() -> bool:
    gc.collect()  # the previous measurement's engine and model go before the mark restarts
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_mb() -> float:
    """The peak since `restart_peak()` (or since the process started, where the mark cannot restart)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_mb() -> float:
    """The resident set now (/proc/self/statm), the base a step's peak is measured above."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
