"""Hostfiles and the `--include` / `--exclude` / `--num_nodes` / `--num_gpus` filters.

A hostfile is MPI style, as DeepSpeed reads it::

    # comments and blank lines are ignored
    worker-1 slots=4
    worker-2 slots=4   # a trailing comment is fine too

A slot is a GPU on a GPU node and simply one process on a CPU node. The result of resolving is an
ordered mapping host -> slot ids (strings, so that CUDA_VISIBLE_DEVICES entries such as GPU UUIDs
survive); node ranks and global ranks follow that order, host by host.
"""
from __future__ import annotations

import glob
import ipaddress
import os
import re
from dataclasses import dataclass

from launcher.errors import LaunchError

LOCAL_HOST = "localhost"
_HOST_LINE = re.compile(r"^(?P<host>\S+)\s+slots\s*=\s*(?P<slots>\S+)$")
# [Note: host names] A host reaches ssh, pdsh's `-w`, srun's `--nodelist=` and mpirun's `--host` as
# one word. A leading '-' would make it an option (`-oProxyCommand=...` runs a command), ',' would add
# nodes to a list, and '=', '@', '%', brackets, spaces and shell metacharacters mean something to one
# of those tools. So a host is a DNS name (labels of letters, digits, '-' and '_', joined by '.',
# never starting with '-') or an IPv4/IPv6 address, and nothing else.
_HOST_NAME = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62})(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62}))*\.?$")


def host_problem(host: str) -> str | None:
    """None when `host` is a usable host name or address, else why not (a short phrase)."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if len(host) <= 253 and _HOST_NAME.match(host):
        return None
    return (f"{host!r} is not a host name or IP address (letters, digits, '-', '_' and '.' only, "
            "not starting with '-')")


def check_host(host: str, where: str) -> str:
    """`host` itself, or a LaunchError naming `where` (hostfile line or flag) and the fix."""
    problem = host_problem(host)
    if problem:
        raise LaunchError(f"{where}: {problem}; write the node's plain name or address")
    return host


@dataclass(frozen=True)
class HostEntry:
    """One host of the hostfile with its slot ids and where it was declared."""

    host: str
    slots: tuple[str, ...]
    line: int  # 1-based line in the hostfile; 0 for the implicit local host

    def where(self, path: str | None) -> str:
        return f"{path}:{self.line}" if path and self.line else "this machine"


def parse_hostfile(path: str) -> list[HostEntry]:
    """Reads `path`; every malformed line is a LaunchError naming `path:line`."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError as err:
        raise LaunchError(f"cannot read hostfile {path}: {err.strerror}") from None
    entries: dict[str, HostEntry] = {}
    for number, raw in enumerate(lines, start=1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        match = _HOST_LINE.match(text)
        if not match:
            raise LaunchError(f"{path}:{number}: cannot parse {text!r}; expected 'HOSTNAME slots=N'")
        host, slots_text = check_host(match["host"], f"{path}:{number}"), match["slots"]
        if not slots_text.isdigit() or int(slots_text) < 1:
            raise LaunchError(f"{path}:{number}: slots must be a whole number >= 1, got {slots_text!r}")
        if host in entries:
            raise LaunchError(
                f"{path}:{number}: host {host!r} is listed twice (first on line {entries[host].line})")
        entries[host] = HostEntry(host, tuple(str(i) for i in range(int(slots_text))), number)
    if not entries:
        raise LaunchError(f"{path}: no hosts listed; expected lines like 'worker-1 slots=4'")
    return list(entries.values())


def local_host_entry(environ: dict[str, str], nproc_per_node: int) -> HostEntry:
    """This machine alone: `nproc_per_node` processes, else the visible GPUs, else one process.

    CUDA_VISIBLE_DEVICES is honoured as DeepSpeed does: its entries become the slot ids, so the ranks
    get exactly those devices. Asking for more processes than it lists is an error: the ranks would
    get devices the user hid. (DeepSpeed prints that it ignores CUDA_VISIBLE_DEVICES when --num_gpus
    is given and hands out devices 0..N-1.) Without devices, N processes share the CPU: no GPU and
    no CUDA_VISIBLE_DEVICES, or an empty one (hiding every GPU, the usual way to train on CPU).
    """
    visible = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if 0 < len(visible) < nproc_per_node:
        raise LaunchError(f"--num_gpus {nproc_per_node} asks for {nproc_per_node} processes, but CUDA_VISIBLE_DEVICES="
                          f"{environ['CUDA_VISIBLE_DEVICES']} lists only {len(visible)} device(s); pass "
                          f"--num_gpus {len(visible)} or list more devices in CUDA_VISIBLE_DEVICES")
    if not visible and "CUDA_VISIBLE_DEVICES" not in environ:
        visible = [str(i) for i in range(len(glob.glob("/dev/nvidia[0-9]*")))]
    if nproc_per_node > 0:
        slots = tuple(visible[:nproc_per_node]) if len(visible) >= nproc_per_node else tuple(
            str(i) for i in range(nproc_per_node))
    else:
        slots = tuple(visible) or ("0",)
    return HostEntry(LOCAL_HOST, slots, 0)


def parse_node_specs(text: str, flag: str) -> list[tuple[str, tuple[str, ...] | None]]:
    """`host1:0,1@host2` -> [("host1", ("0", "1")), ("host2", None)]; None means every slot."""
    specs = []
    for part in text.split("@"):
        host, sep, slot_text = part.strip().partition(":")
        if not host:
            raise LaunchError(f"{flag} {text!r}: empty host name in {part!r}; expected HOST[:SLOT,...]@...")
        check_host(host, f"{flag} {text!r}")
        if not sep:
            specs.append((host, None))
            continue
        slots = tuple(s.strip() for s in slot_text.split(","))
        if not all(slots):
            raise LaunchError(f"{flag} {text!r}: empty slot in {part!r}; expected HOST:0,1")
        specs.append((host, slots))
    return specs


def _check_spec(entries: dict[str, HostEntry], host: str, slots, flag: str, text: str, path):
    source = f"hostfile {path}" if path else "this machine (no --hostfile)"
    if host not in entries:
        known = ", ".join(entries)
        raise LaunchError(f"{flag} {text!r}: host {host!r} is not in {source}; known hosts: {known}")
    entry = entries[host]
    for slot in slots or ():
        if slot not in entry.slots:
            raise LaunchError(
                f"{flag} {text!r}: host {host!r} has no slot {slot!r} ({entry.where(path)} "
                f"declares slots {', '.join(entry.slots)})")


def select_slots(entries: list[HostEntry], path: str | None, include: str = "", exclude: str = "",
                 num_nodes: int = -1, num_gpus: int = -1) -> dict[str, tuple[str, ...]]:
    """Applies the filters DeepSpeed's launcher accepts and returns host -> slot ids in order."""
    if include and exclude:
        raise LaunchError("--include and --exclude cannot be used together")
    if (include or exclude) and (num_nodes > 0 or num_gpus > 0):
        raise LaunchError("--include/--exclude cannot be combined with --num_nodes or --num_gpus")
    by_host = {entry.host: entry for entry in entries}
    chosen = {entry.host: entry.slots for entry in entries}
    if include:
        specs = parse_node_specs(include, "--include")
        for host, slots in specs:
            _check_spec(by_host, host, slots, "--include", include, path)
        wanted: dict[str, set[str]] = {}
        for host, slots in specs:
            wanted.setdefault(host, set()).update(slots or by_host[host].slots)
        chosen = {h: tuple(s for s in by_host[h].slots if s in wanted[h]) for h in chosen if h in wanted}
    if exclude:
        for host, slots in parse_node_specs(exclude, "--exclude"):
            _check_spec(by_host, host, slots, "--exclude", exclude, path)
            dropped = set(slots or by_host[host].slots)
            chosen[host] = tuple(s for s in chosen.get(host, ()) if s not in dropped)
        chosen = {h: s for h, s in chosen.items() if s}
    if num_nodes > 0:
        if num_nodes > len(chosen):
            raise LaunchError(f"--num_nodes {num_nodes} but {path or 'this machine'} lists only "
                              f"{len(chosen)} host(s)")
        chosen = dict(list(chosen.items())[:num_nodes])
    if num_gpus > 0:
        for host, slots in chosen.items():
            if num_gpus > len(slots):
                raise LaunchError(f"{by_host[host].where(path)}: host {host!r} has {len(slots)} slot(s) "
                                  f"but --num_gpus {num_gpus} was requested")
        chosen = {h: s[:num_gpus] for h, s in chosen.items()}
    if not chosen:
        raise LaunchError(f"no slots left to run on after --exclude {exclude!r}")
    return chosen


def resolve_slots(hostfile: str | None, environ: dict[str, str], include: str = "", exclude: str = "",
                  num_nodes: int = -1, num_gpus: int = -1) -> dict[str, tuple[str, ...]]:
    """The hosts and slots to run on: the hostfile if given, else this machine alone."""
    if hostfile:
        if not os.path.exists(hostfile):
            raise LaunchError(f"hostfile {hostfile} does not exist; omit --hostfile to run on this "
                              "machine only")
        return select_slots(parse_hostfile(hostfile), hostfile, include, exclude, num_nodes, num_gpus)
    local = local_host_entry(environ, num_gpus if not (include or exclude) else -1)
    if include:
        # Without a hostfile, DeepSpeed lets `--include localhost:1,3` pick any device id.
        specs = parse_node_specs(include, "--include")
        extra = [s for _, slots in specs for s in (slots or ()) if s not in local.slots]
        local = HostEntry(LOCAL_HOST, local.slots + tuple(dict.fromkeys(extra)), 0)
    return select_slots([local], None, include, exclude, num_nodes, -1)
