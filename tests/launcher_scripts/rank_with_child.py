"""A rank that starts a child in its process group, as a data-loader worker would, then waits.

Usage: python rank_with_child.py OUT_DIR [--child_ignores_sigterm] [--child_new_session] [--rank_exits]
       [--rank_ignores_sigterm]

--child_new_session starts the child in a session of its own (out of the rank's group, as a daemon
would); --rank_exits ends the rank with status 0 once the child is up, leaving the child behind;
--rank_ignores_sigterm makes the rank itself outlive SIGTERM (only the agent's SIGKILL ends it).

The child writes OUT_DIR/pids_rank<R> ("<rank pid> <child pid>") once its signal handling is set.
Its command line carries OUT_DIR, so a test finds (and cleans up) every process of the job by that
marker. No torch import: the job is up in a fraction of a second.
"""
import os
import signal
import subprocess
import sys
import time

CHILD = """import os, signal, sys, time
out, rank, rank_pid, ignore = sys.argv[1:5]
if ignore == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finishes its work first, like a loader worker
path = os.path.join(out, "pids_rank" + rank)
with open(path + ".tmp", "w") as handle:
    handle.write(rank_pid + " " + str(os.getpid()))
os.replace(path + ".tmp", path)
time.sleep(120)
"""


def main():
    out = sys.argv[1]
    ignore = "ignore" if "--child_ignores_sigterm" in sys.argv[2:] else "default"
    flags = sys.argv[2:]
    if "--rank_ignores_sigterm" in flags:  # before the child is up: the test waits for the child
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen([sys.executable, "-c", CHILD, out, os.environ["RANK"], str(os.getpid()), ignore],
                     start_new_session="--child_new_session" in flags)
    if "--rank_exits" in flags:
        path = os.path.join(out, "pids_rank" + os.environ["RANK"])
        while not os.path.exists(path):
            time.sleep(0.01)
        return
    time.sleep(120)


if __name__ == "__main__":
    main()
