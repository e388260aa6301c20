"""How the per-node agents get started: one command line per runner.

| runner  | what runs on this machine                        | how an agent learns its node rank    |
|---------|--------------------------------------------------|--------------------------------------|
| local   | `python -m launcher.agent` directly              | `--node_rank 0`                      |
| ssh     | one `ssh -- HOST 'cd CWD && exec env PYTHONPATH=... python -m launcher.agent ...'` per node | `--node_rank N` |
| pdsh    | one `pdsh -S -N -R ssh -w h1,h2 '<same>'`        | `--node_host %h` (pdsh fills in)     |
| slurm   | one `srun --ntasks-per-node=1 --nodelist=... env PYTHONPATH=... python -m launcher.agent ...` | `$SLURMD_NODENAME` |
| openmpi | one `mpirun -n NNODES --map-by ppr:1:node --host h1:1,h2:1 env PYTHONPATH=... python ...` | `$OMPI_COMM_WORLD_RANK` |

No secret is on these command lines: the control token and the forwarded environment reach the
agents in the launch file (`--launch_file`, launcher/handoff.py); only PYTHONPATH, which the agent
needs to start at all, is an `env` word. Hosts are checked names (launcher/hostfile.py) and come
after `--` (ssh) or as the value of a host-list option. Remote shells get one string built with
`shlex.quote` for every word, so script arguments reach the ranks literally (no injection). pdsh also expands `%` sequences, so
`%` is doubled in everything except the node placeholder. The remote side uses the same Python
interpreter path and working directory as `dslaunch` (a shared file system, as DeepSpeed assumes).
"""
from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field

from launcher.hostfile import host_problem
from launcher.ranks import TERM_GRACE_S
from launcher.world import WorldInfo

RUNNERS = ("local", "ssh", "pdsh", "slurm", "openmpi")
_HOST_PLACEHOLDER = "@@DSLAUNCH_NODE_HOST@@"


@dataclass(frozen=True)
class AgentOptions:
    """Everything on an agent's command line except which node it is."""

    world: WorldInfo
    master_addr: str
    master_port: int
    control: str
    launch_file: str  # the token and environment (launcher/handoff.py)
    user_script: str
    user_args: tuple[str, ...] = ()
    attempt: int = 0
    hang_timeout: float = 0.0
    term_grace: float = TERM_GRACE_S  # dslaunch's --term_grace
    log_dir: str = ""
    log_tag: str = "dslaunch"
    color: bool = False
    bind_cores_to_rank: bool = False
    module: bool = False
    no_python: bool = False
    python: str = field(default_factory=lambda: sys.executable)


@dataclass(frozen=True)
class RunnerProcess:
    """One process `dslaunch` starts here: an agent, or a tool that starts agents elsewhere."""

    label: str
    argv: list[str]
    node_ranks: tuple[int, ...]
    env: dict[str, str] | None = None  # None: dslaunch's own environment


def agent_argv(opts: AgentOptions, node_flag: list[str]) -> list[str]:
    argv = [opts.python, "-u", "-m", "launcher.agent", "--world_info", opts.world.encode(), *node_flag,
            "--master_addr", opts.master_addr, "--master_port", str(opts.master_port),
            "--control", opts.control, "--launch_file", opts.launch_file, "--attempt", str(opts.attempt),
            "--log_tag", opts.log_tag, "--term_grace", str(opts.term_grace)]
    if opts.hang_timeout > 0:
        argv += ["--hang_timeout", str(opts.hang_timeout)]
    if opts.log_dir:
        argv += ["--log_dir", os.path.abspath(opts.log_dir)]
    for enabled, flag in ((opts.color, "--color"), (opts.bind_cores_to_rank, "--bind_cores_to_rank"),
                          (opts.module, "--module"), (opts.no_python, "--no_python")):
        if enabled:
            argv.append(flag)
    return argv + ["--", opts.user_script, *opts.user_args]


def env_words(env: dict[str, str]) -> list[str]:
    return ["env", *(f"{key}={value}" for key, value in env.items())]


def command_line_env(env: dict[str, str]) -> dict[str, str]:
    """What of the agents' environment may be a command-line word: PYTHONPATH only (module doc)."""
    return {"PYTHONPATH": env["PYTHONPATH"]} if "PYTHONPATH" in env else {}


def remote_shell_command(cwd: str, env: dict[str, str], argv: list[str], for_pdsh: bool = False) -> str:
    command = f"cd {shlex.quote(cwd)} && exec {shlex.join(env_words(env) + argv)}"
    if for_pdsh:
        command = command.replace("%", "%%").replace(_HOST_PLACEHOLDER, "%h")
    return command


def local_processes(opts: AgentOptions, env: dict[str, str]) -> list[RunnerProcess]:
    return [RunnerProcess("localhost", agent_argv(opts, ["--node_rank", "0"]), (0,), env)]


def ssh_argv(host: str, ssh_port: int | None, ssh_args: list[str], remote: str) -> list[str]:
    """`ssh ... -- HOST REMOTE`: after `--`, ssh reads no more options, whatever the host looks like."""
    port = ["-p", str(ssh_port)] if ssh_port else []
    return ["ssh", "-o", "BatchMode=yes", *port, *ssh_args, "--", host, remote]


def ssh_processes(opts: AgentOptions, env: dict[str, str], cwd: str, ssh_port: int | None,
                  launcher_args: list[str]) -> list[RunnerProcess]:
    processes = []
    for node_rank, host in enumerate(opts.world.hosts):
        remote = remote_shell_command(cwd, command_line_env(env), agent_argv(opts, ["--node_rank", str(node_rank)]))
        processes.append(RunnerProcess(f"ssh {host}", ssh_argv(host, ssh_port, launcher_args, remote), (node_rank,)))
    return processes


def pdsh_processes(opts: AgentOptions, env: dict[str, str], cwd: str, ssh_port: int | None,
                   launcher_args: list[str]) -> list[RunnerProcess]:
    remote = remote_shell_command(cwd, command_line_env(env), agent_argv(opts, ["--node_host", _HOST_PLACEHOLDER]),
                                  for_pdsh=True)
    argv = ["pdsh", "-S", "-N", "-f", "1024", "-R", "ssh", *launcher_args, "-w", ",".join(opts.world.hosts),
            remote]
    pdsh_env = dict(os.environ)
    if ssh_port:
        pdsh_env["PDSH_SSH_ARGS_APPEND"] = f"{pdsh_env.get('PDSH_SSH_ARGS_APPEND', '')} -p {ssh_port}".strip()
    return [RunnerProcess("pdsh", argv, tuple(range(opts.world.nnodes)), pdsh_env)]


def slurm_processes(opts: AgentOptions, env: dict[str, str], launcher_args: list[str]) -> list[RunnerProcess]:
    nnodes = opts.world.nnodes
    argv = ["srun", f"--nodes={nnodes}", f"--ntasks={nnodes}", "--ntasks-per-node=1",
            f"--nodelist={','.join(opts.world.hosts)}", "--kill-on-bad-exit=1", *launcher_args,
            *env_words(command_line_env(env)), *agent_argv(opts, ["--node_host_env", "SLURMD_NODENAME"])]
    return [RunnerProcess("srun", argv, tuple(range(nnodes)))]


def openmpi_processes(opts: AgentOptions, env: dict[str, str], launcher_args: list[str]) -> list[RunnerProcess]:
    nnodes = opts.world.nnodes
    as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    argv = ["mpirun", "-n", str(nnodes), "--map-by", "ppr:1:node",
            "--host", ",".join(f"{host}:1" for host in opts.world.hosts), *as_root, *launcher_args,
            *env_words(command_line_env(env)), *agent_argv(opts, ["--node_rank_env", "OMPI_COMM_WORLD_RANK"])]
    return [RunnerProcess("mpirun", argv, tuple(range(nnodes)))]


def runner_processes(runner: str, opts: AgentOptions, env: dict[str, str], cwd: str,
                     ssh_port: int | None = None, launcher_args: str = "") -> list[RunnerProcess]:
    """The processes to start for `runner`; `env` is what the agents must see (the local agent's
    process environment; for remote agents, the launch file carries it)."""
    for host in opts.world.hosts:  # dslaunch checked them already; a caller of this module may not have
        problem = host_problem(host)
        if problem:
            raise ValueError(f"refusing to start agents: host {problem}")
    extra = shlex.split(launcher_args)
    if runner == "local":
        return local_processes(opts, env)
    if runner == "ssh":
        return ssh_processes(opts, env, cwd, ssh_port, extra)
    if runner == "pdsh":
        return pdsh_processes(opts, env, cwd, ssh_port, extra)
    if runner == "slurm":
        return slurm_processes(opts, env, extra)
    if runner == "openmpi":
        return openmpi_processes(opts, env, extra)
    raise ValueError(f"unknown runner {runner!r}; expected one of {', '.join(RUNNERS)}")
