"""Checkpoint streaming of a `SwappedPartition` (swapped_partition.py): its committed master and optimizer
state read out one sub-group at a time, and loaded back from chunks cut at any boundaries (another
`sub_group_size`, another partitioning), so a checkpoint never holds the whole state in memory. A mixin:
it uses the partition's sub-groups, pool and transfers, and commits through its `commit`."""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch

from offload.aio import wait_all


class PartitionStream:
    """`state_chunks` / `load_chunks` / `load_master` of SwappedPartition."""

    def state_chunks(self) -> Iterator[dict]:
        """The state, one sub-group at a time: {"start", "end", "master", "state": {key: tensor},
        "scalars": {key: value}}; tensors are copies owned by the caller (one sub-group each)."""
        self._check_committed(dict.fromkeys(self._keys(self._has_state), self._slot))
        for k, (s, e) in enumerate(self.groups):
            keys = self._keys(self._has_state)
            buffers, handles = self._start_read(k, keys, dict.fromkeys(keys, self._slot))
            try:
                wait_all(handles)  # a failed read: its siblings land before the buffers go back
                n = e - s
                state = {key: buf[:n].clone() for key, buf in zip(self.state_keys, buffers[1:])} \
                    if self._has_state else {}
                chunk = {"start": s, "end": e, "master": buffers[0][:n].clone(), "state": state,
                         "scalars": {key: copy_value(v) for key, v in self._scalars[k].items()}}
            finally:
                self._release(buffers)
            yield chunk

    def load_chunks(self, chunks: Iterable[dict]) -> None:
        """Load state from chunks as `state_chunks` yields them, cut at any boundaries (another
        sub_group_size or partitioning), in ascending order and covering [0, numel) exactly once."""
        scalars = [dict() for _ in self.groups]
        with_state: Optional[bool] = None
        k, buffers, filled = 0, None, 0
        try:
            for chunk in chunks:
                has = bool(chunk["state"])
                with_state = has if with_state is None else with_state
                if has != with_state:
                    raise ValueError("load_chunks: some chunks carry optimizer state and some do not")
                pos = chunk["start"]
                while pos < chunk["end"]:
                    if k >= len(self.groups):
                        raise ValueError(f"load_chunks: chunk [{chunk['start']}, {chunk['end']}) runs past numel {self.numel}")
                    s, e = self.groups[k]
                    if pos != s + filled:
                        raise ValueError(f"load_chunks: expected element {s + filled} next, chunk gives {pos}")
                    if buffers is None:
                        buffers = self._acquire(self.per_group)
                        scalars[k] = {key: copy_value(v) for key, v in chunk["scalars"].items()}
                    take = min(chunk["end"], e) - pos
                    lo = pos - chunk["start"]
                    tensors = [chunk["master"]] + [chunk["state"][key] for key in self.state_keys] if has \
                        else [chunk["master"]]
                    for buf, src in zip(buffers, tensors):
                        buf[filled:filled + take].copy_(src[lo:lo + take])
                    filled, pos = filled + take, pos + take
                    if s + filled == e:
                        self._start_write(k, self._keys(True), buffers, self._keys(has))
                        k, buffers, filled = k + 1, None, 0
            if k != len(self.groups):
                raise ValueError(f"load_chunks: chunks end at element {self.groups[k][0] + filled}, numel is {self.numel}")
            self._finish_writes()
        except BaseException:
            if buffers is not None:
                self._release(buffers)
            self._abandon({})
            raise
        self.commit(scalars, has_state=bool(with_state))

    def load_master(self, chunks: Iterable[dict]) -> None:
        """Replace the committed master from chunks as `load_chunks` takes them (ascending, covering
        [0, numel) once) that carry no optimizer state, keeping the state and its scalars: a load of the
        weights alone, which without offload leaves the optimizer's state as it was. In place in the
        committed slot, as `write_master`."""
        pos = 0
        for chunk in chunks:
            if chunk["state"]:
                raise ValueError("load_master: a chunk carries optimizer state; load it with load_chunks")
            if chunk["start"] != pos:
                raise ValueError(f"load_master: expected element {pos} next, chunk gives {chunk['start']}")
            self.write_master(pos, chunk["master"][:chunk["end"] - pos])
            pos = chunk["end"]
        if pos != self.numel:
            raise ValueError(f"load_master: chunks end at element {pos}, numel is {self.numel}")


def copy_value(value):
    """A per-step scalar as the caller may keep it: tensors cloned, plain values as they are."""
    return value.clone() if torch.is_tensor(value) else value
