"""A rank whose short-lived background processes become orphans, as a daemonising helper's do.

Usage: python rank_with_orphans.py OUT_DIR [--kill_switch]

The rank runs a middle process that starts 3 processes in sessions of their own and exits at once, so
each is adopted by the agent (its subreaper, launcher/ranks.py's adopt_orphans). They wait for OUT_DIR/go
(at most a minute), so the rank sees whose children they are while they live; then it writes go, waits
up to 20 s for them to be gone (reaped: collected by the agent) and writes OUT_DIR/orphans_rank<R>:
"<adopted by the agent> <still zombies under it>" (counts). No fixed sleep decides anything: under load
they simply take longer. No torch import.
--kill_switch: first SIGKILLs the agent's dead man's switch (launcher/deadman.py), its oldest child, and
waits until the switch has exited (a zombie, or collected).
"""
import os
import subprocess
import sys
import time

import psutil

ORPHAN = """import os, sys, time
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.02)
"""
MIDDLE = """import subprocess, sys
for _ in range(3):
    print(subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)  # not the pipe read below
"""


def zombie_under(pid: int, parent: int) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.ppid() == parent and proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone(pid: int) -> bool:
    try:  # not pid_exists() first: the orphan can be reaped between the two looks (NoSuchProcess, seen)
        return psutil.Process(pid).status() == psutil.STATUS_DEAD
    except psutil.NoSuchProcess:
        return True


def kill_switch(agent: int) -> None:
    (switch,) = [p for p in psutil.Process(agent).children() if "launcher.deadman" in p.cmdline()]
    switch.kill()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (gone(switch.pid) or zombie_under(switch.pid, agent)):
        time.sleep(0.02)


def main():
    out, agent = sys.argv[1], os.getppid()
    if "--kill_switch" in sys.argv[2:]:
        kill_switch(agent)
    go = os.path.join(out, "go")
    pids = [int(p) for p in subprocess.run([sys.executable, "-c", MIDDLE, ORPHAN, go], check=True,
                                           capture_output=True, text=True).stdout.split()]
    adopted = sum(1 for pid in pids if psutil.Process(pid).ppid() == agent)  # alive until go
    open(go, "w").close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all(map(gone, pids)):
        time.sleep(0.05)
    path = os.path.join(out, "orphans_rank" + os.environ["RANK"])
    with open(path + ".tmp", "w") as handle:
        handle.write(f"{adopted} {sum(zombie_under(pid, agent) for pid in pids)}")
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
