"""A rank whose short-lived background processes become orphans, as a daemonising helper's do.

Usage: python rank_with_orphans.py OUT_DIR

The rank runs a middle process that starts 3 processes in sessions of their own and exits at once, so
each is adopted by the agent (its subreaper, launcher/ranks.py's adopt_orphans). While they live the rank
records whose children they are; they exit after a second, and two seconds later the rank writes
OUT_DIR/orphans_rank<R>: "<adopted by the agent> <still zombies under it>" (counts). No torch import.
"""
import os
import subprocess
import sys
import time

import psutil

MIDDLE = """import subprocess, sys
for _ in range(3):
    print(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"], start_new_session=True).pid)
"""


def main():
    out, agent = sys.argv[1], os.getppid()
    pids = [int(p) for p in subprocess.run([sys.executable, "-c", MIDDLE], check=True, capture_output=True,
                                           text=True).stdout.split()]
    adopted = sum(1 for pid in pids if psutil.Process(pid).ppid() == agent)
    time.sleep(3)

    def zombie(pid):
        try:
            proc = psutil.Process(pid)
            return proc.ppid() == agent and proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    path = os.path.join(out, "orphans_rank" + os.environ["RANK"])
    with open(path + ".tmp", "w") as handle:
        handle.write(f"{adopted} {sum(map(zombie, pids))}")
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
