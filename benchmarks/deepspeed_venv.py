"""DeepSpeed's own virtual environment for the benchmarks' peers (suite.py, bench_training.py, ...).

    python -m benchmarks.deepspeed_venv [PATH]     # make it (or say it is there); prints its python

DeepSpeed never goes into dstrain's environment (it pins and patches torch's modules at import), so
its peers run with the python of a separate venv. `ensure(path)` makes one when `path` has none:

- the compatibility target `deepspeed>=0.19,<0.20` (DESIGN: DeepSpeed 0.19.x's config and behaviour);
- the same torch as ours, exactly (`torch==<torch.__version__>`, the local tag included, so a CPU
  build gets a CPU build): from pip's configured indexes first, else from PyTorch's index for that
  tag (download.pytorch.org/whl/cpu for `+cpu`), which PyPI does not carry;
- ninja, so DeepSpeed's ops build just in time (`DS_BUILD_OPS=0`: no op is compiled by pip), and its
  CPU Adam op built once right away (the offload peers need it; torch's extension cache,
  TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions, keeps it for every later run), and its async_io
  op where libaio's headers are installed (the NVMe peers; without them those rows report the error);
- numpy, and transformers at our version when we have it (bench_tensor_parallel.py's HF Llama peer).

A `.ready` file marks a finished venv (`.creating` one being made: an interrupted one is an error); the default path is under the user's cache directory
(`$XDG_CACHE_HOME` or ~/.cache), `dstrain/deepspeed-<pin>-torch<version>`, so a different torch gets
a venv of its own. A venv made by hand (deepspeed importable, no `.ready`) is used as it is.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

DEEPSPEED_PIN = "deepspeed>=0.19,<0.20"
TORCH_INDEX = "https://download.pytorch.org/whl/{tag}"
READY, CREATING = ".ready", ".creating"
OPS = {"cpu_adam": "CPUAdamBuilder", "async_io": "AsyncIOBuilder"}  # op -> DeepSpeed's builder class


class VenvError(RuntimeError):
    """The venv could not be made or used; the message names the path and the step."""


def default_path() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "dstrain" / f"deepspeed-0.19-torch{torch.__version__}"


def ensure(venv: Path, log=print) -> Path:
    """`venv`'s python, making the venv first when it has none (module docstring)."""
    venv = Path(venv).expanduser()
    python = venv / "bin" / "python"
    if (venv / READY).exists():
        return python
    if (venv / CREATING).exists():
        raise VenvError(f"{venv}: an earlier creation did not finish (no {READY}); remove the folder and run again")
    if python.exists():
        if _run([str(python), "-c", "import deepspeed"]).returncode == 0:
            return python  # made by hand
        raise VenvError(f"{venv}: a venv without deepspeed and without {READY} (an interrupted install?); "
                        "remove it or give another path")
    if venv.exists() and any(venv.iterdir()):
        raise VenvError(f"{venv}: exists and is not a venv; give an empty or new path")
    started = time.monotonic()
    log(f"[deepspeed venv] creating {venv} ({DEEPSPEED_PIN}, torch=={torch.__version__}); this downloads")
    _step(venv, "create the venv", [sys.executable, "-m", "venv", str(venv)])
    (venv / CREATING).write_text("")  # until .ready: a half-made venv is never taken for a hand-made one
    pip = [str(python), "-m", "pip", "install", "-q"]
    _install_torch(venv, pip)
    extras = ["numpy", "ninja"] + _our_version("transformers")
    _step(venv, f"install {DEEPSPEED_PIN}", pip + [DEEPSPEED_PIN, *extras], env={**os.environ, "DS_BUILD_OPS": "0"})
    for op, builder in OPS.items():
        done = _run([str(python), "-c", f"from deepspeed.ops.op_builder import {builder}; {builder}().load()"])
        if done.returncode and op == "cpu_adam":
            raise VenvError(f"{venv}: building DeepSpeed's {op} op failed: {_tail(done)}")
        log(f"[deepspeed venv] {op} op: {'built' if done.returncode == 0 else 'not built: ' + _tail(done)}")
    (venv / READY).write_text(f"{DEEPSPEED_PIN}, torch=={torch.__version__}\n")
    (venv / CREATING).unlink()
    log(f"[deepspeed venv] ready in {time.monotonic() - started:.0f} s")
    return python


def _install_torch(venv: Path, pip: list[str]) -> None:
    spec = f"torch=={torch.__version__}"
    first = _run(pip + [spec])
    if first.returncode == 0:
        return
    tag = torch.__version__.partition("+")[2]
    if not tag:
        raise VenvError(f"{venv}: pip install {spec} failed: {_tail(first)}")
    # PyPI has no local-tagged builds (+cpu, +cu128): PyTorch's own index for the tag has them
    _step(venv, f"install {spec} from {TORCH_INDEX.format(tag=tag)}",
          pip + ["--extra-index-url", TORCH_INDEX.format(tag=tag), spec])


def _our_version(name: str) -> list[str]:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return [f"{name}=={version(name)}"]
    except PackageNotFoundError:
        return []


def _step(venv: Path, what: str, cmd: list[str], env: dict | None = None) -> None:
    done = _run(cmd, env=env)
    if done.returncode:
        raise VenvError(f"{venv}: {what} failed: {_tail(done)}")


def _run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def _tail(done: subprocess.CompletedProcess) -> str:
    lines = [ln.strip() for ln in (done.stderr or done.stdout or "").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else f"exit {done.returncode}"


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", nargs="?", type=Path, default=None, help=f"the venv (default: {default_path()})")
    args = p.parse_args(argv)
    try:
        print(ensure(args.path or default_path()))
    except VenvError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
