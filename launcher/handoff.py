"""The launch file: what an agent needs that must not be on any command line.

Every local user can read every process's command line (`ps`, /proc/PID/cmdline) for as long as the
process runs, and the ssh/pdsh/srun/mpirun processes that start the agents run for the whole job.
So the attempt's control token and the forwarded environment (HF_*, MLFLOW_*, `.dsenv` values: often
credentials) travel in a file instead: created with mode 0600 inside a fresh 0700 directory
(`mkdtemp`), opened with O_EXCL|O_NOFOLLOW, on the file system the agents share with dslaunch (the
working directory, which they `cd` into anyway; the system temp directory when every agent runs
here). The agents get only its path. dslaunch removes it as soon as every agent has said hello, and
in any case when the attempt ends.

The one variable that stays on remote command lines is PYTHONPATH: the agent needs it to import
this package before it can read the file, and it is a list of directories.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

from launcher.errors import LaunchError

FILE_NAME = "agent.json"


def write_launch_file(directory: str, token: str, env: dict[str, str]) -> str:
    """A new private file holding `token` and `env`; returns its absolute path."""
    try:
        private_dir = tempfile.mkdtemp(prefix=".dslaunch-", dir=directory)  # mode 0700
        path = os.path.join(private_dir, FILE_NAME)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump({"token": token, "env": env}, handle)
    except OSError as err:
        raise LaunchError(f"cannot write the agents' launch file in {directory}: {err.strerror}; run dslaunch "
                          "from a writable directory (on the file system the nodes share)") from None
    return os.path.abspath(path)


def read_launch_file(path: str) -> tuple[str, dict[str, str]]:
    """(token, environment) from a file `write_launch_file` made."""
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    return str(data["token"]), {str(k): str(v) for k, v in data["env"].items()}


def remove_launch_file(path: str | None) -> None:
    if path:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
