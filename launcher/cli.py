"""dslaunch: start a training script on one machine or many, and keep the job from getting stuck.

Usage::

    dslaunch [options] script.py [script args...]
    dslaunch [options] -m package.module [module args...]

Examples::

    dslaunch --nproc_per_node 4 train.py --config ds.json        # 4 processes on this machine
    dslaunch --hostfile hosts train.py                           # every slot of every host
    dslaunch --hostfile hosts -i worker-1:0,1@worker-2 train.py  # some slots of some hosts
    dslaunch --hostfile hosts --launcher ssh --max_restarts 2 --hang_timeout 300 train.py
    dslaunch --hostfile hosts --dry_run train.py                 # show commands and rank map only

Hosts and slots
    --hostfile FILE        MPI-style lines `worker-1 slots=4` (`#` comments, blank lines). Without
                           it: this machine only, with --nproc_per_node processes, else one per
                           visible GPU (CUDA_VISIBLE_DEVICES honoured), else one.
    -i/--include SPEC      `host1:0,1@host2`: only these hosts (and slots). -e/--exclude SPEC: all
                           but these. Neither combines with --num_nodes/--num_gpus.
    --num_nodes N          the first N hosts.  --num_gpus/--nproc_per_node N: the first N slots of
                           each host (a slot is a GPU, or just a process on a CPU-only machine).
    A malformed hostfile or filter is one line naming the file and line (or flag), exit status 2.
    A host (hostfile, -i/-e, --master_addr, --control_addr) is a DNS name or an IP address: letters,
    digits, '-', '_' and '.', not starting with '-'; anything else is such an error.

Runners (--launcher)
    local    this machine (the default when only this machine is used)
    pdsh     `pdsh -S -R ssh` to every host (the default for several hosts when pdsh is installed)
    ssh      one ssh per host (the default for several hosts otherwise)
    slurm    `srun` inside an allocation;  openmpi: `mpirun` (one agent per node)
    --launcher_args "..." go to ssh/pdsh/srun/mpirun; --ssh_port N; --no_ssh_check skips the
    passwordless-ssh check of every host that ssh and pdsh runs begin with.
    Remote nodes run the same Python interpreter path in the same working directory (a shared
    file system, as DeepSpeed assumes).

What every rank gets
    RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR (--master_addr, default
    127.0.0.1 on one machine, else the first host), MASTER_PORT (--master_port, default 29500),
    CUDA_VISIBLE_DEVICES (the node's chosen slots), DSTRAIN_RESTART_COUNT (0, 1, ... per restart),
    and with --hang_timeout DSTRAIN_HEARTBEAT_ADDR. Ranks are numbered host by host in hostfile
    order. Remote nodes also get the variables named NCCL_*, GLOO_*, PYTHON*, UCX_*, TORCH_*,
    DSTRAIN_*, OMP_*, ... and the KEY=VALUE lines of `.dsenv` in ~ and in the working directory
    (DSTRAIN_ENV_FILE names another file; refused when another user owns it or everyone may
    write it); PYTHONPATH gets the working directory in front. Those
    values and the control token reach the agents in a 0600 launch file (launcher/handoff.py), not
    on any command line. Script arguments are shell-quoted: they arrive literally.

Output
    Each line is prefixed `[rankN]:` (`[rankN@host]:` with several hosts), coloured per rank when
    dslaunch writes to a terminal. --enable_each_rank_log DIR writes each rank's output to
    DIR/<time>_rank<N>.log instead (appended across restarts). --save_pid writes dslaunch's pid to
    /tmp/<pid>.dslaunch while it runs (created exclusively: a file or link already there is an error).

Failures, restarts and hangs
    When a rank exits non-zero, every rank on every node is stopped (SIGTERM, then SIGKILL after
    --term_grace seconds, default 5; 0 kills at once), and dslaunch prints which rank failed first,
    on which host, with its exit code or signal.
    --max_restarts N then restarts the whole job up to N times (ranks see DSTRAIN_RESTART_COUNT;
    resuming from the latest checkpoint is the training script's or the engine's job).
    --hang_timeout S: ranks report progress with `engine.heartbeat.beat(step)` (the engine calls it
    every step); when no rank of a node progressed for S seconds (counted from the node's first
    heartbeat, so slow start-up and checkpoint loading are not timed), each rank's Python stack is
    dumped into its output (faulthandler, SIGUSR1) and the job is stopped, then restarted or failed
    like any other failure.
    SIGINT/SIGTERM/SIGHUP to dslaunch stops every rank on every node; a second signal (Ctrl-C
    twice) skips the grace period: every rank's process group is SIGKILLed at once.
    If dslaunch itself is killed, the agents notice the lost connection and stop their ranks. If an
    agent is killed outright (SIGKILL, the OOM killer), its ranks die with it and a small watcher it
    started (launcher/deadman.py) kills each rank's process group: nothing the ranks started
    (data-loader workers, subprocesses) outlives the job.

Exit status
    0 on success; the first failing rank's exit code (128+N when killed by signal N); 124 after a
    hang; 128+N when dslaunch was stopped by signal N; 2 for a bad command line, hostfile or .dsenv.

The engine also runs unchanged under `torchrun` or `srun` directly: it only reads the variables
above. See docs/launcher.md for the design (per-node agents, control connection, heartbeats).
"""
from __future__ import annotations

import argparse
import math
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from launcher.control import ControlServer
from launcher.environment import forwarded_environment, local_environment
from launcher.errors import LaunchError
from launcher.handoff import remove_launch_file, write_launch_file
from launcher.hostfile import check_host, resolve_slots
from launcher.ranks import TERM_GRACE_S, literal_script_args
from launcher.runners import RUNNERS, AgentOptions, runner_processes, ssh_argv
from launcher.supervisor import AttemptResult, JobSupervisor
from launcher.world import WorldInfo

CONNECT_TIMEOUT_S = 60.0
_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dslaunch", formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Start a training script on one machine or many.",
                                     epilog="Full manual: python -c 'import launcher.cli; help(launcher.cli)'")
    add = parser.add_argument
    add("-H", "--hostfile", default=None, help="MPI-style hostfile ('host slots=N'); default: this machine")
    add("-i", "--include", default="", help="hosts/slots to use, e.g. 'host1:0,1@host2'")
    add("-e", "--exclude", default="", help="hosts/slots to leave out, same syntax")
    add("--num_nodes", type=int, default=-1, help="use the first N hosts")
    add("--num_gpus", "--num_accelerators", "--nproc_per_node", dest="num_gpus", type=int, default=-1,
        help="processes (slots) per node")
    add("--master_addr", default="", help="rendezvous address (default: 127.0.0.1 or the first host)")
    add("--master_port", type=int, default=29500)
    add("--launcher", choices=RUNNERS, default=None, help="how agents are started on the nodes")
    add("--launcher_args", default="", help="extra arguments for ssh/pdsh/srun/mpirun")
    add("--ssh_port", type=int, default=None)
    add("--no_ssh_check", action="store_true", help="skip the passwordless-ssh check")
    add("--enable_each_rank_log", default=None, metavar="DIR", help="per-rank log files in DIR")
    add("--save_pid", action="store_true", help="write dslaunch's pid to /tmp/<pid>.dslaunch")
    add("--bind_cores_to_rank", action="store_true", help="pin each rank to its share of the cores")
    add("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    add("--no_python", action="store_true", help="run the script as an executable, not with python")
    add("--no_local_rank", action="store_true", help="accepted for DeepSpeed compatibility; dslaunch "
        "never appends --local_rank (ranks read LOCAL_RANK)")
    add("--max_restarts", type=int, default=0, help="restart the whole job up to N times on failure")
    add("--hang_timeout", type=float, default=0.0, metavar="SECONDS",
        help="stop (and dump stacks) when no rank progresses for this long; 0: off")
    add("--term_grace", default=str(TERM_GRACE_S), metavar="SECONDS",
        help=f"from SIGTERM to SIGKILL when ranks are stopped (default {TERM_GRACE_S:g}); 0: SIGKILL at once")
    add("--control_addr", default="", help="address the agents use to reach dslaunch (auto)")
    add("--dry_run", action="store_true", help="print the rank map and per-node commands; start nothing")
    add("user_script", help="the training script (or module with -m)")
    add("user_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


@dataclass
class LaunchPlan:
    args: argparse.Namespace
    world: WorldInfo
    runner: str
    master_addr: str
    agent_env: dict[str, str]
    control_host: str
    log_tag: str
    term_grace: float  # seconds from SIGTERM to SIGKILL, on every node


def is_local_host(host: str) -> bool:
    return host in _LOCAL_NAMES or host.startswith("127.")


def route_source_address(host: str) -> str:
    """The address of this machine that `host` would see us coming from (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()


def choose_runner(args, world: WorldInfo) -> str:
    if args.launcher:
        if args.launcher == "local" and world.nnodes > 1:
            raise LaunchError(f"--launcher local runs on this machine only, but {world.nnodes} hosts "
                              f"were selected ({', '.join(world.hosts)})")
        return args.launcher
    if world.nnodes == 1 and is_local_host(world.hosts[0]):
        return "local"
    return "pdsh" if shutil.which("pdsh") else "ssh"


def term_grace_seconds(text: str) -> float:
    """`--term_grace`: a finite, non-negative number of seconds (inf would never SIGKILL a rank)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise LaunchError(f"--term_grace {text!r}: expected a non-negative number of seconds "
                          f"(e.g. --term_grace 1.5; default {TERM_GRACE_S:g})")
    return value


def make_plan(args, environ: dict[str, str], cwd: str) -> LaunchPlan:
    if args.max_restarts < 0 or args.hang_timeout < 0:
        raise LaunchError("--max_restarts and --hang_timeout must not be negative")
    term_grace = term_grace_seconds(args.term_grace)
    for flag in ("master_addr", "control_addr"):
        if getattr(args, flag):
            check_host(getattr(args, flag), f"--{flag}")
    slots = resolve_slots(args.hostfile, environ, args.include, args.exclude, args.num_nodes, args.num_gpus)
    world = WorldInfo.from_slots(slots)
    runner = choose_runner(args, world)
    if runner == "local":
        master_addr, agent_env, control = args.master_addr or "127.0.0.1", local_environment(environ, cwd), "127.0.0.1"
    else:
        master_addr, agent_env = args.master_addr or world.hosts[0], forwarded_environment(environ, cwd)
        remote = [h for h in world.hosts if not is_local_host(h)] or world.hosts
        control = "127.0.0.1" if all(is_local_host(h) for h in world.hosts) else route_source_address(remote[0])
    return LaunchPlan(args, world, runner, master_addr, agent_env, args.control_addr or control,
                      time.strftime("%Y%m%d%H%M%S"), term_grace)


def agent_options(plan: LaunchPlan, attempt: int, control: str, launch_file: str) -> AgentOptions:
    args = plan.args
    return AgentOptions(world=plan.world, master_addr=plan.master_addr, master_port=args.master_port,
                        control=control, launch_file=launch_file, user_script=args.user_script,
                        user_args=tuple(args.user_args), attempt=attempt, hang_timeout=args.hang_timeout,
                        term_grace=plan.term_grace,
                        log_dir=args.enable_each_rank_log or "", log_tag=plan.log_tag,
                        color=sys.stdout.isatty() and "NO_COLOR" not in os.environ,
                        bind_cores_to_rank=args.bind_cores_to_rank, module=args.module,
                        no_python=args.no_python)


def processes_for(plan: LaunchPlan, opts: AgentOptions):
    return runner_processes(plan.runner, opts, plan.agent_env, os.getcwd(), plan.args.ssh_port,
                            plan.args.launcher_args)


def check_ssh(plan: LaunchPlan):
    """Every host must accept a non-interactive ssh login before anything starts."""
    args = plan.args
    extra = shlex.split(args.launcher_args) if plan.runner == "ssh" else shlex.split(
        os.environ.get("PDSH_SSH_ARGS_APPEND", ""))
    probes = {host: subprocess.Popen(ssh_argv(host, args.ssh_port, ["-o", "ConnectTimeout=10", *extra], "true"),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True) for host in plan.world.hosts}
    for host, probe in probes.items():
        _, err = probe.communicate(timeout=30)
        if probe.returncode != 0:
            reason = (err.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
            where = f"hostfile {args.hostfile}" if args.hostfile else "the command line"
            raise LaunchError(f"host {host!r} (from {where}) is not reachable with passwordless ssh: "
                              f"{reason}; set up keys, or pass --no_ssh_check")


def print_dry_run(plan: LaunchPlan):
    print(f"dslaunch dry run: {plan.world.world_size} rank(s) on {plan.world.nnodes} node(s), "
          f"runner {plan.runner}, MASTER_ADDR={plan.master_addr} MASTER_PORT={plan.args.master_port}")
    print(f"{'rank':>5} {'node':>5} {'local':>6}  slot  host")
    for p in plan.world.placements():
        print(f"{p.rank:>5} {p.node_rank:>5} {p.local_rank:>6}  {p.slot:>4}  {p.host}")
    opts = agent_options(plan, 0, control_address(plan.control_host, "<port>"), "<launch file>")
    for process in processes_for(plan, opts):
        print(f"# {process.label} (node {', '.join(map(str, process.node_ranks))})")
        print(shlex.join(process.argv))


def describe_failure(failure: dict, world: WorldInfo) -> str:
    node = failure.get("node_rank")
    host = failure.get("host") or (world.hosts[node] if node is not None else "?")
    if failure.get("kind") == "exit":
        return (f"rank {failure['rank']} on host {host} (node {node}, local rank "
                f"{failure.get('local_rank')}) {failure['detail']}")
    if failure.get("kind") == "hang":
        return f"hang detected on host {host} (node {node}): {failure['detail']}"
    return f"node {node} ({host}): {failure['detail']}"


def report_attempt(result: AttemptResult, plan: LaunchPlan, attempt: int):
    stopped = f"; all ranks stopped in {result.stopped_in_s:.2f} s" if result.stopped_in_s is not None else ""
    if result.interrupted_by:
        what = f"stopped by {signal.Signals(result.interrupted_by).name}"
    else:
        what = f"job failed: {describe_failure(result.failure, plan.world)}"
    tries = f" (attempt {attempt + 1} of {plan.args.max_restarts + 1})" if plan.args.max_restarts else ""
    print(f"dslaunch: {what}{stopped}; exit status {result.exit_status}{tries}", file=sys.stderr, flush=True)
    failure = result.failure or {}
    if failure.get("log"):
        print(f"dslaunch: last lines of {failure['log']}:", file=sys.stderr)
        for line in failure.get("tail", []):
            print(f"    {line}", file=sys.stderr)
    sys.stderr.flush()


def control_address(host: str, port) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_for_agents(plan: LaunchPlan, token: str) -> ControlServer:
    """The control port, on the one address the agents are told to use (never every interface)."""
    try:
        return ControlServer(plan.control_host, token)
    except OSError as err:
        raise LaunchError(f"cannot listen for the agents on {plan.control_host!r}: {err.strerror or err}; "
                          "pass --control_addr with an address of this machine that every node reaches") from None


def run_attempt(plan: LaunchPlan, attempt: int, signals: list[int]) -> AttemptResult:
    token = secrets.token_hex(16)
    server = listen_for_agents(plan, token)
    local = plan.runner == "local"  # the local agent inherits its environment from dslaunch directly
    launch_file = write_launch_file(tempfile.gettempdir() if local else os.getcwd(), token,
                                    {} if local else plan.agent_env)
    try:
        opts = agent_options(plan, attempt, control_address(plan.control_host, server.port), launch_file)
        supervisor = JobSupervisor(server, plan.world.nnodes, plan.term_grace, CONNECT_TIMEOUT_S,
                                   on_all_connected=lambda: remove_launch_file(launch_file))
        supervisor.signals = signals  # shared: a Ctrl-C between attempts must end the job too
        return supervisor.run(processes_for(plan, opts))
    finally:
        remove_launch_file(launch_file)
        server.close()


def run_job(plan: LaunchPlan) -> int:
    """Runs the attempts: the first, then up to --max_restarts whole-job restarts."""
    signals: list[int] = []

    def on_signal(signum, _frame):
        signals.append(signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    for attempt in range(plan.args.max_restarts + 1):
        result = run_attempt(plan, attempt, signals)
        if result.ok:
            return 0
        report_attempt(result, plan, attempt)
        if result.interrupted_by or signals:
            return 128 + (result.interrupted_by or signals[0])
        if attempt < plan.args.max_restarts:
            print(f"dslaunch: restarting the whole job (restart {attempt + 1} of {plan.args.max_restarts})",
                  file=sys.stderr, flush=True)
    return result.exit_status


def write_pid_file(path: str) -> None:
    """`--save_pid`: the name in /tmp is predictable, so another user may have put a file or a link
    there first; it is created exclusively and never through a link, or not at all."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        raise LaunchError(f"--save_pid: {path} already exists (a stale pid file, or a file or link someone "
                          "else put there); remove it, or run without --save_pid") from None
    except OSError as err:
        raise LaunchError(f"--save_pid: cannot create {path}: {err.strerror}") from None
    with os.fdopen(fd, "w") as handle:
        handle.write(f"{os.getpid()}\n")


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.user_args = literal_script_args(argv, args.user_script, args.user_args)  # "arrive literally"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_command_line(sys.argv[1:] if argv is None else argv)
    pid_file = None  # set once this process created it: only then is it ours to remove
    try:
        plan = make_plan(args, dict(os.environ), os.getcwd())
        if args.dry_run:
            print_dry_run(plan)
            return 0
        if plan.runner in ("ssh", "pdsh") and not args.no_ssh_check:
            check_ssh(plan)
        if args.save_pid:
            write_pid_file(f"/tmp/{os.getpid()}.dslaunch")
            pid_file = f"/tmp/{os.getpid()}.dslaunch"
        return run_job(plan)
    except LaunchError as err:
        print(f"dslaunch: error: {err}", file=sys.stderr)
        return LaunchError.exit_code
    finally:
        if pid_file:
            os.remove(pid_file)


if __name__ == "__main__":
    sys.exit(main())
