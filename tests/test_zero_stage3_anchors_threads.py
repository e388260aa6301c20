"""The reentrant-region wrapper (engine/zero/anchors.py) installed and removed by passes on several
threads at once (two models' forwards in two threads; a thread calling torch's reentrant checkpoint
outside any pass meanwhile). Before, `open` / `close` changed the pass list and torch's
`CheckpointFunction.apply` unguarded: two threads' close and open interleaved to raise KeyError('own')
out of `close` (a forward's end) and to leave the wrapper installed with nothing behind it, so every
later reentrant checkpoint in the process raised KeyError('apply'); a checkpoint call that had entered
the wrapper as the last pass closed raised KeyError('apply') too (the second test: a call that looked up
`CheckpointFunction.apply` before another thread's close removed the wrapper). Each in a process of its
own, a rank of tests/harness.py (a fork of its forkserver, which imported torch and the engine and changed
neither): the switch interval and torch's class are process-wide."""
from tests.harness import run_distributed


def _threads_open_and_close() -> dict:
    import sys
    import threading

    import torch
    import torch.utils.checkpoint as tc

    from engine.zero.anchors import BackwardAnchors
    sys.setswitchinterval(1e-6)
    errors = []

    def passes():
        anchors = BackwardAnchors()
        try:
            for _ in range(20000):
                anchors.open()
                anchors.close()
        except Exception as e:  # noqa: BLE001 - the test reports every error a pass raised
            errors.append(repr(e))

    for _ in range(3):  # the old code failed in each of 3 rounds of 3
        threads = [threading.Thread(target=passes) for _ in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    try:
        tc.checkpoint(torch.sin, torch.ones(2, requires_grad=True), use_reentrant=True).sum().backward()
        after = "ok"
    except Exception as e:  # noqa: BLE001
        after = repr(e)
    return {"errors": sorted(set(errors)), "wrapped": "apply" in tc.CheckpointFunction.__dict__, "after": after}


def test_passes_on_several_threads_install_and_remove_the_wrapper_cleanly():
    got = run_distributed(_threads_open_and_close, 1, timeout=120)[0]
    assert got == {"errors": [], "wrapped": False, "after": "ok"}, got


def _entered_as_removed() -> list:
    import torch
    import torch.utils.checkpoint as tc

    from engine.zero.anchors import BackwardAnchors
    anchors = BackwardAnchors()
    anchors.open()
    apply = tc.CheckpointFunction.apply  # another thread's region looks the wrapper up ...
    anchors.close()                      # ... and this thread's pass, the last, removes it before the call
    x = torch.ones(2, requires_grad=True)
    apply(torch.sin, True, x).sum().backward()  # the old code: KeyError: 'apply'
    return [x.grad.tolist() == torch.cos(torch.ones(2)).tolist(), anchors.edges == []]


def test_a_region_that_entered_the_wrapper_as_it_was_removed_runs_torchs_own():
    assert run_distributed(_entered_as_removed, 1, timeout=120)[0] == [True, True]
