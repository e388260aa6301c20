"""dslaunch's hostfile, --include/--exclude, .dsenv parsing, rank map and command construction."""
import os
import shlex
import subprocess

import pytest

from launcher.cli import agent_options, main as cli_main, make_plan, parse_command_line, processes_for
from launcher.environment import forwarded_environment, read_env_file
from launcher.errors import LaunchError
from launcher.hostfile import parse_hostfile, resolve_slots, select_slots
from launcher.runners import AgentOptions, remote_shell_command, runner_processes
from launcher.world import WorldInfo
from launcher_scripts.harness import REPO, launch_env, run_dslaunch


def write(tmp_path, text, name="hostfile"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_hostfile_comments_blank_lines_and_order(tmp_path):
    path = write(tmp_path, "# cluster\n\nworker-2 slots=2  # fast\nworker-1 slots=1\n")
    assert select_slots(parse_hostfile(path), path) == {"worker-2": ("0", "1"), "worker-1": ("0",)}


@pytest.mark.parametrize("text, message", [
    ("w1 slots=2\nw1 slots=4\n", ":2: host 'w1' is listed twice (first on line 1)"),
    ("w1 slots=2\nw2 gpus=4\n", ":2: cannot parse 'w2 gpus=4'"),
    ("w1\n", ":1: cannot parse 'w1'"),
    ("w1 slots=0\n", ":1: slots must be a whole number >= 1"),
    ("w1 slots=x\n", ":1: slots must be a whole number >= 1, got 'x'"),
    ("# only a comment\n", ": no hosts listed"),
])
def test_bad_hostfiles_name_file_and_line(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(LaunchError) as err:
        parse_hostfile(path)
    assert str(err.value).startswith(path) and message in str(err.value)


HOSTS = "w1 slots=4\nw2 slots=4\nw3 slots=2\n"


@pytest.mark.parametrize("kwargs, expected", [
    ({"include": "w1:0,2@w3"}, {"w1": ("0", "2"), "w3": ("0", "1")}),
    ({"exclude": "w2@w1:0"}, {"w1": ("1", "2", "3"), "w3": ("0", "1")}),
    ({"num_nodes": 2}, {"w1": ("0", "1", "2", "3"), "w2": ("0", "1", "2", "3")}),
    ({"num_gpus": 2}, {"w1": ("0", "1"), "w2": ("0", "1"), "w3": ("0", "1")}),
])
def test_filters_select_hosts_and_slots(tmp_path, kwargs, expected):
    path = write(tmp_path, HOSTS)
    assert resolve_slots(path, {}, **kwargs) == expected


@pytest.mark.parametrize("kwargs, message", [
    ({"include": "w9"}, "--include 'w9': host 'w9' is not in hostfile"),
    ({"include": "w1:7"}, "host 'w1' has no slot '7' ("),
    ({"exclude": "w1:a,"}, "empty slot"),
    ({"include": "@w1"}, "empty host name"),
    ({"include": "w1", "exclude": "w2"}, "cannot be used together"),
    ({"include": "w1", "num_gpus": 1}, "cannot be combined"),
    ({"num_nodes": 5}, "--num_nodes 5 but"),
    ({"num_gpus": 3}, ":3: host 'w3' has 2 slot(s) but --num_gpus 3 was requested"),
    ({"exclude": "w1@w2@w3"}, "no slots left"),
])
def test_bad_filters_are_clear_errors(tmp_path, kwargs, message):
    path = write(tmp_path, HOSTS)
    with pytest.raises(LaunchError) as err:
        resolve_slots(path, {}, **kwargs)
    assert message in str(err.value)


def test_local_machine_honours_cuda_visible_devices():
    assert resolve_slots(None, {"CUDA_VISIBLE_DEVICES": "2,3"}) == {"localhost": ("2", "3")}
    assert resolve_slots(None, {"CUDA_VISIBLE_DEVICES": ""}, num_gpus=4) == {"localhost": ("0", "1", "2", "3")}
    assert resolve_slots(None, {"CUDA_VISIBLE_DEVICES": ""}, include="localhost:1,3") == {"localhost": ("1", "3")}


@pytest.mark.parametrize("visible", ["3", "0,2", " 5 , "])
def test_more_processes_than_cuda_visible_devices_lists_is_an_error(visible):
    """The user hid the other devices: ranks must never get them (they used to get 0..N-1)."""
    with pytest.raises(LaunchError) as err:
        resolve_slots(None, {"CUDA_VISIBLE_DEVICES": visible}, num_gpus=3)
    message = str(err.value)
    assert "--num_gpus 3" in message and f"CUDA_VISIBLE_DEVICES={visible}" in message and "\n" not in message
    assert resolve_slots(None, {"CUDA_VISIBLE_DEVICES": "3,1,2"}, num_gpus=3) == {"localhost": ("3", "1", "2")}


def test_cuda_visible_devices_error_is_one_line_from_dslaunch(tmp_path):
    result = run_dslaunch("--num_gpus", "2", "print_argv.py", env=launch_env(CUDA_VISIBLE_DEVICES="3"), timeout=30,
                          cwd=str(tmp_path))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("dslaunch: error: --num_gpus 2") and result.stderr.count("\n") == 1


def test_rank_map_is_host_by_host_and_round_trips():
    world = WorldInfo.from_slots({"a": ("0", "1"), "b": ("0", "1", "2")})
    assert WorldInfo.decode(world.encode()) == world
    assert [(p.rank, p.node_rank, p.local_rank) for p in world.placements(1)] == [(2, 1, 0), (3, 1, 1), (4, 1, 2)]
    assert world.world_size == 5 and world.node_rank_of("b") == 1


def test_env_file_and_forwarded_prefixes(tmp_path):
    (tmp_path / ".dsenv").write_text("# comment\nexport A_VALUE='x y'\nNCCL_DEBUG=INFO\n")
    env = forwarded_environment({"GLOO_SOCKET_IFNAME": "eth9", "SECRET": "no", "HOME": str(tmp_path / "h")},
                                str(tmp_path))
    assert env["A_VALUE"] == "x y" and env["NCCL_DEBUG"] == "INFO" and env["GLOO_SOCKET_IFNAME"] == "eth9"
    assert "SECRET" not in env and env["PYTHONPATH"].split(os.pathsep)[:2] == [REPO, str(tmp_path)]
    bad = write(tmp_path, "OK=1\nnot an assignment\n", ".bad")
    with pytest.raises(LaunchError, match=r"\.bad:2: expected KEY=VALUE"):
        read_env_file(bad)


def test_remote_command_quotes_every_word(tmp_path):
    nasty = ["; touch /tmp/pwned #", "$(id)", "a'b\"c", "50%"]
    command = remote_shell_command("/work dir", {"V": "$(touch /tmp/pwned2)"}, ["python", *nasty])
    words = shlex.split(command)
    assert words[:5] == ["cd", "/work dir", "&&", "exec", "env"]
    assert words[5] == "V=$(touch /tmp/pwned2)" and words[-4:] == nasty
    output = subprocess.run(["sh", "-c", command.replace("exec env", "exec printf '%s\\n'")
                             .replace("cd '/work dir'", "cd /")], capture_output=True, text=True).stdout
    assert output.splitlines()[-4:] == nasty


def options(world):
    return AgentOptions(world=world, master_addr="w1", master_port=29500, control="10.0.0.9:4000",
                        launch_file="/f", user_script="train.py", user_args=("--lr", "0.1"))


def test_runner_commands_for_every_launcher():
    world = WorldInfo.from_slots({"w1": ("0", "1"), "w2": ("0", "1")})
    env = {"PYTHONPATH": "/repo"}
    ssh = runner_processes("ssh", options(world), env, "/repo", ssh_port=2222, launcher_args="-F cfg")
    assert [p.argv[:6] for p in ssh] == [["ssh", "-o", "BatchMode=yes", "-p", "2222", "-F"]] * 2
    assert "--node_rank 1" in ssh[1].argv[-1]
    (pdsh,) = runner_processes("pdsh", options(world), env, "/repo")
    assert pdsh.argv[:3] == ["pdsh", "-S", "-N"] and "--node_host %h" in pdsh.argv[-1]
    (srun,) = runner_processes("slurm", options(world), env, "/repo", launcher_args="--partition=cpu")
    assert srun.argv[:6] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=w1,w2",
                             "--kill-on-bad-exit=1"]
    assert "--partition=cpu" in srun.argv and "SLURMD_NODENAME" in srun.argv
    (mpi,) = runner_processes("openmpi", options(world), env, "/repo")
    assert mpi.argv[:7] == ["mpirun", "-n", "2", "--map-by", "ppr:1:node", "--host", "w1:1,w2:1"]


def test_cli_errors_are_one_line_exit_2_no_traceback(tmp_path):
    path = write(tmp_path, "w1 slots=2\nw1 slots=2\n")
    for args, expected in [(["--hostfile", path], f"{path}:2: host 'w1' is listed twice"),
                           (["--hostfile", str(tmp_path / "missing")], "does not exist"),
                           (["--include", "nothere:0"], "host 'nothere' is not in this machine")]:
        result = run_dslaunch(*args, "train.py", timeout=30)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [f"dslaunch: error: {result.stderr.split('error: ', 1)[1].strip()}"]
        assert expected in result.stderr and "Traceback" not in result.stderr


def test_dry_run_prints_rank_map_and_slurm_command(tmp_path):
    path = write(tmp_path, "w1 slots=2\nw2 slots=2\n")
    result = run_dslaunch("--hostfile", path, "--launcher", "slurm", "--dry_run", "train.py", "--x", "a b",
                          timeout=30)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "4 rank(s) on 2 node(s), runner slurm" in lines[0]
    assert [line.split() for line in lines[2:6]] == [
        ["0", "0", "0", "0", "w1"], ["1", "0", "1", "1", "w1"], ["2", "1", "0", "0", "w2"], ["3", "1", "1", "1", "w2"]]
    srun = shlex.split(lines[-1])
    assert srun[0] == "srun" and srun[-3:] == ["train.py", "--x", "a b"]
    assert {"--master_addr", "w1", "--master_port", "29500"} <= set(srun)


def test_dsenv_error_is_reported_with_file_and_line(tmp_path):
    (tmp_path / ".dsenv").write_text("GOOD=1\nBAD LINE\n")
    result = run_dslaunch("--dry_run", "train.py", cwd=str(tmp_path), env=launch_env(HOME=str(tmp_path)),
                          timeout=30)
    assert result.returncode == 2 and f"{tmp_path}/.dsenv:2: expected KEY=VALUE" in result.stderr


def test_rank_prefix_is_coloured_only_when_asked():
    from launcher.output import rank_prefix
    assert rank_prefix(3, None, color=False) == b"[rank3]: "
    assert rank_prefix(3, "w2", color=False) == b"[rank3@w2]: "
    coloured = rank_prefix(1, None, color=True)
    assert coloured.startswith(b"\x1b[") and b"[rank1]:" in coloured and coloured != rank_prefix(2, None, True)


def test_an_empty_cuda_visible_devices_stays_empty_for_the_ranks():
    """CUDA_VISIBLE_DEVICES="" hides every GPU (a CPU run on a GPU machine): the N processes it allows
    (above) get it empty, not the slot labels 0..N-1 as device ids; a set list is handed on as chosen."""
    from launcher.ranks import rank_environment
    from launcher.world import RankPlacement, WorldInfo
    world = WorldInfo.from_slots(resolve_slots(None, {"CUDA_VISIBLE_DEVICES": ""}, num_gpus=2))
    place = RankPlacement(rank=1, node_rank=0, local_rank=1, host="localhost", slot="1")
    assert rank_environment({"CUDA_VISIBLE_DEVICES": ""}, place, world, "127.0.0.1", 1, {})["CUDA_VISIBLE_DEVICES"] == ""
    chosen = WorldInfo.from_slots(resolve_slots(None, {"CUDA_VISIBLE_DEVICES": "5,7"}, num_gpus=2))
    got = rank_environment({"CUDA_VISIBLE_DEVICES": "5,7"}, place, chosen, "127.0.0.1", 1, {})
    assert got["CUDA_VISIBLE_DEVICES"] == "5,7"


@pytest.mark.parametrize("runner", ["local", "ssh", "pdsh", "slurm", "openmpi"])
def test_term_grace_reaches_every_agent(tmp_path, runner):
    hosts = "localhost slots=2\n" if runner == "local" else "w1 slots=2\nw2 slots=2\n"
    args = parse_command_line(["--hostfile", write(tmp_path, hosts), "--launcher", runner, "--term_grace", "0.25",
                               "train.py"])
    plan = make_plan(args, {"PYTHONPATH": REPO}, REPO)
    processes = processes_for(plan, agent_options(plan, 0, "127.0.0.1:4000", "/f"))
    commands = [shlex.join(process.argv) for process in processes]  # ssh's remote command is one word
    assert len(commands) == (2 if runner == "ssh" else 1)
    assert all("launcher.agent" in command and "--term_grace 0.25" in command for command in commands), commands
    assert plan.term_grace == 0.25


@pytest.mark.parametrize("value", ["-1", "abc", "inf", "nan", ""])
def test_a_bad_term_grace_is_a_one_line_error(value, capsys):
    assert cli_main(["--term_grace", value, "--dry_run", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"dslaunch: error: --term_grace {value!r}: expected a non-negative "
                                        "number of seconds (e.g. --term_grace 1.5; default 5)"]
