"""Process-group set-up (the parallel topology and its groups: topology.py).

`init_distributed()` reads the environment the way the launchers write it:
- dslaunch / torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT;
- SLURM (`srun python train.py`): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, first host of
  SLURM_JOB_NODELIST as the master;
- Open MPI (`mpirun`): OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK;
- nothing at all: a single process (world size 1, no network).
Backend: nccl when CUDA is present, gloo otherwise. Under NCCL each process binds its GPU
(`torch.cuda.set_device`), also when the caller created the process group itself: device LOCAL_RANK,
or device 0 when the process sees a single GPU (SLURM `--gpus-per-task=1` gives every task its own
CUDA_VISIBLE_DEVICES, while SLURM_LOCALID still counts the node's tasks). `DSTRAIN_DEVICE=cuda` puts a
gloo run's tensors on the GPU too (gloo's CUDA support: all-reduce, broadcast, all-gather). The timeout defaults to 300 s (env
DSTRAIN_TIMEOUT, seconds) rather than torch's 30 minutes, so a hung collective fails while someone
is still watching.
"""
from __future__ import annotations

import atexit
import os
import re
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300
DEFAULT_PORT = 29500


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist such as 'node[03-05,09],gpu1' → 'node03'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        return nodelist
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def discover_env() -> dict[str, str] | None:
    """RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* from whichever launcher started us, or None."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k in env}
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
                "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
                "MASTER_ADDR": env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
                "MASTER_PORT": env.get("MASTER_PORT", str(DEFAULT_PORT))}
    if "OMPI_COMM_WORLD_RANK" in env:
        return {"RANK": env["OMPI_COMM_WORLD_RANK"], "WORLD_SIZE": env["OMPI_COMM_WORLD_SIZE"],
                "LOCAL_RANK": env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
                "MASTER_ADDR": env.get("MASTER_ADDR", "127.0.0.1"),
                "MASTER_PORT": env.get("MASTER_PORT", str(DEFAULT_PORT))}
    return None


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


_AT_EXIT: list[bool] = []


def _release_threads_at_exit() -> None:
    """At interpreter exit, first let gloo's worker threads drop their last collectives (teardown.py's
    note: otherwise about 1 exit in 30 aborts). Registered once, whoever created the process group."""
    if not _AT_EXIT:
        from .teardown import release_collective_threads
        atexit.register(release_collective_threads)
        _AT_EXIT.append(True)


def init_distributed(dist_backend: str | None = None, timeout: timedelta | float | None = None,
                     init_method: str | None = None, rank: int = -1, world_size: int = -1,
                     verbose: bool = False) -> None:
    """Initialise the default process group once; later calls only bind the device (like DeepSpeed's)."""
    _release_threads_at_exit()
    if dist.is_initialized():
        bind_device()
        return
    if os.environ.get("DSTRAIN_HEARTBEAT_ADDR"):
        # Under dslaunch: let the agent ask for our Python stack even if rendezvous itself hangs.
        from .heartbeat import install_stack_dump
        install_stack_dump()
    if timeout is None:
        timeout = float(os.environ.get("DSTRAIN_TIMEOUT", DEFAULT_TIMEOUT_S))
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    backend = dist_backend or default_backend()
    found = discover_env()
    if rank >= 0 and world_size > 0:
        found = {**(found or {}), "RANK": str(rank), "WORLD_SIZE": str(world_size)}
    if found is None or int(found["WORLD_SIZE"]) == 1 and init_method is None and "MASTER_ADDR" not in found:
        # A lone process: an in-memory store, no port to pick or collide on.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            os.environ.setdefault(key, found.get(key, "127.0.0.1" if key == "MASTER_ADDR" else str(DEFAULT_PORT)))
        os.environ.setdefault("LOCAL_RANK", found.get("LOCAL_RANK", "0"))
        dist.init_process_group(backend, init_method=init_method or "env://", rank=int(found["RANK"]),
                                world_size=int(found["WORLD_SIZE"]), timeout=timeout)
        connected_everywhere()
    bind_device()
    if verbose and dist.get_rank() == 0:
        print(f"[dstrain] initialised {backend} with world size {dist.get_world_size()}")


def connected_everywhere(group=None) -> None:
    """Return once every rank of a just-created gloo group has finished connecting (note below).

    [Note: leaving a group while a peer connects] gloo connects every pair of ranks inside
    `init_process_group`, and a rank is done as soon as its own pairs are up, which can be before a
    slower peer has taken its side of them. If that rank then leaves (a bad config raising on every
    rank, a test's next world destroying this one) and closes its sockets, the slower peer fails in
    connectFullMesh with "Connection closed by peer" instead of reaching its own error: a CI run lost
    a 4-rank test module to it on a loaded machine, reproduced with one rank's store made slow
    (tests/test_dist_init.py). A barrier holds each rank until all are connected. NCCL connects
    lazily, at the first collective, so it needs none; a mixed "cpu:gloo,cuda:nccl" group has a gloo
    side, and its barrier runs there (torch picks the CPU device where a group has one). The topology's
    groups (`new_group`, engine/topology.py) pass the same barrier once all are made."""
    if "gloo" in str(dist.get_backend(group)) and dist.get_world_size(group) > 1:
        dist.barrier(group)


def global_rank() -> int:
    """This process's rank in the default group, 0 before one exists. The rank that prints and writes
    monitors: with pipeline or tensor parallelism several processes are data-parallel rank 0."""
    return dist.get_rank() if dist.is_initialized() else 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_device_index() -> int:
    """The CUDA device of this process (module docstring); a LOCAL_RANK no visible device matches is an error."""
    rank, count = local_rank(), torch.cuda.device_count()
    if rank < count:
        return rank
    if count == 1:
        return 0
    raise RuntimeError(f"LOCAL_RANK={rank}, but this process sees {count} CUDA devices (CUDA_VISIBLE_DEVICES="
                       f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): start at most {count} ranks per node, "
                       "or give each rank its own GPU (srun --gpus-per-task=1)")


def _uses_cuda() -> bool:
    if not torch.cuda.is_available() or not dist.is_initialized():
        return False
    return "nccl" in str(dist.get_backend()) or os.environ.get("DSTRAIN_DEVICE", "").startswith("cuda")


def bind_device() -> None:
    """`torch.cuda.set_device` for this process's GPU, when its collectives run on one."""
    if _uses_cuda():
        torch.cuda.set_device(local_device_index())


def device() -> torch.device:
    """Where this process's model, buffers and collectives live (DESIGN decision 9)."""
    if _uses_cuda():
        return torch.device("cuda", local_device_index())
    return torch.device("cpu")


# The grid and its process groups live in topology.py; the name stays importable from here.
from .topology import Topology  # noqa: E402,F401
