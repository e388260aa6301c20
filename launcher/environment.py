"""Which environment variables reach the ranks on every node.

Remote nodes do not inherit the launching shell, so `dslaunch` forwards:

* variables whose names start with one of `FORWARDED_PREFIXES` (NCCL_*, GLOO_*, PYTHON*, ...);
* every KEY=VALUE line of a `.dsenv` file in the home directory and then in the working directory
  (the later wins; `DSTRAIN_ENV_FILE` names another file), DeepSpeed's `.deepspeed_env` idea;
* PYTHONPATH with the working directory and the directory holding the `launcher` package in front,
  so the agent and the user's modules import without installation.

Values are passed as separate words (`env KEY=VALUE ...` after shell quoting), never spliced into a
shell string unquoted.
"""
from __future__ import annotations

import os
import re

from launcher.errors import LaunchError

FORWARDED_PREFIXES = ("NCCL_", "GLOO_", "PYTHON", "UCX_", "MV2_", "MLFLOW_", "TORCH_", "DSTRAIN_",
                      "OMP_", "MKL_", "CUDA_LAUNCH_BLOCKING", "HF_")
ENV_FILE_NAME = ".dsenv"
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def launcher_root() -> str:
    """The directory that contains the `launcher` package (the source tree when not installed)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check_env_file_owner(path: str, handle) -> None:
    """A `.dsenv` sets every rank's environment (LD_PRELOAD, PYTHONPATH: code), and the working
    directory may be shared: one that another user wrote, or may write, is refused."""
    info = os.fstat(handle.fileno())
    if info.st_uid not in (os.getuid(), 0) or info.st_mode & 0o002:
        raise LaunchError(f"{path}: owned by uid {info.st_uid} with mode {info.st_mode & 0o777:o}; another user "
                          f"could set every rank's environment through it; chmod o-w / chown it, or remove it")


def read_env_file(path: str) -> dict[str, str]:
    """KEY=VALUE lines; blank lines and `#` comments ignored; `export KEY=VALUE` accepted."""
    values: dict[str, str] = {}
    with open(path, encoding="utf-8") as handle:
        _check_env_file_owner(path, handle)
        for number, raw in enumerate(handle.read().splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("export "):
                line = line[len("export "):].lstrip()
            key, sep, value = line.partition("=")
            if not sep or not _KEY.match(key.strip()):
                raise LaunchError(f"{path}:{number}: expected KEY=VALUE, got {line!r}")
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            values[key.strip()] = value
    return values


def env_file_values(environ: dict[str, str], cwd: str) -> dict[str, str]:
    name = environ.get("DSTRAIN_ENV_FILE", ENV_FILE_NAME)
    values: dict[str, str] = {}
    candidates = [name] if os.path.isabs(name) else [
        os.path.join(os.path.expanduser("~"), name), os.path.join(cwd, name)]
    for path in dict.fromkeys(candidates):
        if os.path.isfile(path):
            values.update(read_env_file(path))
    return values


def python_path(environ: dict[str, str], cwd: str) -> str:
    parts = [launcher_root(), cwd] + [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(parts))


def forwarded_environment(environ: dict[str, str], cwd: str) -> dict[str, str]:
    """The variables a remote node needs: matching prefixes, the .dsenv file, PYTHONPATH."""
    forwarded = {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES)}
    forwarded.update(env_file_values(environ, cwd))
    forwarded["PYTHONPATH"] = python_path(forwarded, cwd)
    return dict(sorted(forwarded.items()))


def local_environment(environ: dict[str, str], cwd: str) -> dict[str, str]:
    """On this machine the agent inherits everything, plus the .dsenv file and PYTHONPATH."""
    merged = dict(environ)
    merged.update(env_file_values(environ, cwd))
    merged["PYTHONPATH"] = python_path(merged, cwd)
    return merged
