"""A clean end of a training process: nothing of torch.distributed's still running when Python exits.

[Note: the exit abort] About 1 run in 30 of a multi-process test (gloo, 2 ranks, under CPU load)
ended with "terminate called without an active exception" (SIGABRT) after the rank's function had
returned. The native stack (taken with a SIGABRT handler preloaded into the ranks) was a gloo worker
thread, `ProcessGroupGloo::runLoop`, dropping its reference to a finished collective: the last
reference to one of its tensors, whose Python object torch keeps alive while C++ still holds the
tensor, so dropping it calls `TensorImpl::decref_pyobject` and takes the GIL; the interpreter was
already finalizing, so `PyEval_AcquireThread` ended the thread with `pthread_exit`, whose unwinding
through a noexcept frame calls `std::terminate`. The worker releases a collective only after
`wait()` returned on the training thread, so a process that exits right after its last collective
races it. `destroy_process_group()` does not close the window: the gloo group (and its worker
threads) outlives it once `torch._dynamo` was imported, which the first `torch.optim` optimizer
does — measured: its `pt_gloo_runloop` threads are still there after destroy and `gc.collect()`.

So before the interpreter finalizes, `release_collective_threads()` waits (releasing the GIL) until
every gloo worker thread is idle: blocked in its untimed wait for the next collective. A worker that
still has a tensor to drop is running or in the GIL's timed wait instead. It runs from an `atexit`
handler that `init_distributed` registers, and from `Engine.destroy()`.
"""
from __future__ import annotations

import os
import platform
import time

_GLOO_WORKER = "pt_gloo_runloop"
_FUTEX = {"x86_64": "202", "aarch64": "98"}.get(platform.machine())


def _gloo_workers() -> list[str]:
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    workers = []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == _GLOO_WORKER:
                    workers.append(tid)
        except OSError:
            continue  # the thread ended meanwhile
    return workers


def _idle(tid: str) -> bool:
    """Blocked in a futex wait without a timeout (a condition variable's plain wait)."""
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            fields = f.read().split()
    except OSError:
        return True  # ended
    return len(fields) > 4 and fields[0] == _FUTEX and fields[4] == "0x0"


def release_collective_threads(timeout: float = 2.0) -> bool:
    """Wait until every gloo worker thread is idle (module note); True if they all are.

    Two observations 1 ms apart must agree, so a worker passing through a lock is not taken for idle.
    Where /proc cannot tell (not Linux, an unknown architecture), it gives the workers 50 ms instead."""
    if _FUTEX is None or not os.path.isdir("/proc/self/task"):
        time.sleep(0.05)
        return False
    deadline, calm = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        if all(_idle(tid) for tid in _gloo_workers()):
            calm += 1
            if calm >= 2:
                return True
        else:
            calm = 0
        time.sleep(0.001)  # lets a worker take the GIL and finish
    return False
