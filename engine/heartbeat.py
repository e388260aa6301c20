"""Progress heartbeats for `dslaunch --hang_timeout` (the engine-side half; see launcher/hang.py).

`beat(step)` is a no-op unless DSTRAIN_HEARTBEAT_ADDR (host:port of a TCPStore kept by the node's
`dslaunch` agent) is set. Then the first call connects once, registers the SIGUSR1 stack dump, and
every call sets `heartbeat/<RANK>` to a new value ("<step>:<count>", so repeated calls with the same
step still count as progress). A set is one local round trip (about 10 us), cheap enough for every
step. If the store cannot be reached, heartbeats are switched off with one warning: supervision
must never break training.

`install_stack_dump()` registers faulthandler on SIGUSR1 so that the agent can ask a hung rank for
every thread's Python stack (printed to stderr) without killing it. Calling it early (before
rendezvous) lets even a rank stuck there show its stack.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import warnings

_ADDR_VARIABLE = "DSTRAIN_HEARTBEAT_ADDR"
_state = {"store": None, "disabled": False, "count": 0, "key": None}


def install_stack_dump() -> bool:
    """Registers faulthandler on SIGUSR1 (all threads, to stderr); False where unsupported."""
    if not hasattr(signal, "SIGUSR1"):
        return False
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    return True


def _connect():
    address = os.environ.get(_ADDR_VARIABLE, "")
    if not address:
        _state["disabled"] = True
        return None
    from datetime import timedelta

    from torch.distributed import TCPStore

    host, _, port = address.rpartition(":")
    install_stack_dump()  # before the first beat: a key present means "safe to send SIGUSR1"
    try:
        store = TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=10))
    except (RuntimeError, ValueError) as err:
        warnings.warn(f"dstrain heartbeat: cannot reach the launcher's store at {address} ({err}); "
                      "hang detection is off for this rank", RuntimeWarning, stacklevel=3)
        _state["disabled"] = True
        return None
    _state["key"] = f"heartbeat/{os.environ.get('RANK', '0')}"
    _state["store"] = store
    return store


def beat(step: int) -> None:
    """Tells the agent this rank made progress (at optimizer step `step`)."""
    if _state["disabled"]:
        return
    store = _state["store"] or _connect()
    if store is None:
        return
    _state["count"] += 1
    try:
        store.set(_state["key"], f"{step}:{_state['count']}")
    except RuntimeError as err:  # the agent is gone: it is stopping this rank anyway
        warnings.warn(f"dstrain heartbeat: lost the launcher's store ({err}); heartbeats off",
                      RuntimeWarning, stacklevel=2)
        _state["disabled"] = True
        _state["store"] = None


def reset() -> None:
    """Forgets the connection (tests; a process that changed DSTRAIN_HEARTBEAT_ADDR)."""
    _state.update(store=None, disabled=False, count=0, key=None)
