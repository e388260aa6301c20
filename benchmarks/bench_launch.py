"""Launch and teardown times of dslaunch vs torchrun, side by side in one run.

For 2 and 4 ranks on this machine, each launcher starts the same tiny gloo job
(tests/launcher_scripts/train_worker.py), in which rank 1 exits with code 3 at step 2. Measured:

* start-up: from starting the launcher to the last rank's first training step;
* teardown: from the failing rank's exit to the launcher's own exit (every rank stopped).

Each configuration runs `--repeats` times, launchers interleaved; the table shows medians and the
ratio dslaunch / torchrun (below 1 means dslaunch is faster).

    python benchmarks/bench_launch.py [--repeats 3] [--ranks 2 4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "launcher_scripts", "train_worker.py")
sys.path.insert(0, REPO)

# the tests' port chooser: a port bound with port 0 and closed could be taken before rank 0 binds it
from tests.launcher_scripts.harness import free_port  # noqa: E402


def launcher_argv(name: str, nproc: int) -> list[str]:
    if name == "dslaunch":
        return [sys.executable, "-m", "launcher.cli", "--nproc_per_node", str(nproc), "--master_port",
                str(free_port())]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]


def read_time(path: str) -> float:
    with open(path) as handle:
        return float(handle.read())


def one_run(name: str, nproc: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as out:
        argv = launcher_argv(name, nproc) + [WORKER, "--out", out, "--steps", "5", "--fail_rank", "1",
                                             "--fail_step", "2"]
        env = dict(os.environ, PYTHONPATH=REPO, NO_COLOR="1")
        started = time.time()
        result = subprocess.run(argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, timeout=300)
        ended = time.time()
        if result.returncode == 0:
            raise RuntimeError(f"{name}: the job should have failed:\n{result.stderr[-2000:]}")
        first_steps = [read_time(os.path.join(out, f"first_step_rank{r}")) for r in range(nproc)]
        return max(first_steps) - started, ended - read_time(os.path.join(out, "failed_at"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    launchers = ("dslaunch", "torchrun")
    results = {(name, n): [] for name in launchers for n in args.ranks}
    for _ in range(args.repeats):
        for nproc in args.ranks:
            for name in launchers:
                results[(name, nproc)].append(one_run(name, nproc))
    print(f"{os.cpu_count()} CPUs, median of {args.repeats} runs; times in seconds")
    print(f"{'ranks':>5} {'launcher':>9} {'start-up':>9} {'teardown':>9}")
    for nproc in args.ranks:
        medians = {}
        for name in launchers:
            startup = statistics.median(r[0] for r in results[(name, nproc)])
            teardown = statistics.median(r[1] for r in results[(name, nproc)])
            medians[name] = (startup, teardown)
            print(f"{nproc:>5} {name:>9} {startup:>9.2f} {teardown:>9.2f}")
        ratio = [medians["dslaunch"][i] / medians["torchrun"][i] for i in range(2)]
        print(f"{nproc:>5} {'ratio':>9} {ratio[0]:>9.2f} {ratio[1]:>9.2f}   (dslaunch / torchrun)")


if __name__ == "__main__":
    main()
