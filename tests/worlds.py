"""Successive worlds in one spawn: a test's later layouts run in the processes `run_distributed`
already started, each as a new default process group.

A spawn costs a torch import per process, most of a checkpoint test's time, and a checkpoint test
needs several world sizes one after the other (save at 4, load at 1 and 2). `new_world` leaves the
current default group and joins a new one: `store=None` a world of 1 (an in-memory store), else a
`FileStore` at that path shared by the `world` processes that join it (a process that arrives early
waits in the rendezvous until the others come). Real gloo process groups throughout, as separate
jobs would have; the harness's final `destroy_process_group` finds the last world.
"""
from __future__ import annotations


def new_world(store: str | None, rank: int, world: int) -> None:
    import torch.distributed as dist

    from engine.dist import connected_everywhere
    dist.destroy_process_group()
    backing = dist.HashStore() if store is None else dist.FileStore(store, world)
    dist.init_process_group("gloo", store=backing, rank=rank, world_size=world)
    connected_everywhere()  # nobody leaves this world while a peer still connects (engine/dist.py's note)
