"""Two simulated nodes for the multi-node launcher tests (root only).

Two network namespaces joined by a veth pair (each end named `dsnet0`, so one GLOO_SOCKET_IFNAME
fits both), one sshd per namespace on its own address, a throwaway key pair and an ssh client
config. The file system is shared, as on a cluster with a shared home. `dslaunch` itself runs in
the first namespace, like a user logged into the first node.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

PACKAGES = {"sshd": "openssh-server", "pdsh": "pdsh", "mpirun": "openmpi-bin"}
SUBNET = "10.77.0"
INTERFACE = "dsnet0"


def _run(*argv: str, timeout: float = 30):
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=timeout)


def missing_tools() -> list[str]:
    found = {tool: shutil.which(tool) or os.path.exists(f"/usr/sbin/{tool}") for tool in PACKAGES}
    return [tool for tool, ok in found.items() if not ok]


def install_missing_packages() -> str | None:
    """apt-get installs what is missing; returns a reason to skip, or None."""
    missing = missing_tools()
    if not missing:
        return None
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True, timeout=300, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", *[PACKAGES[t] for t in missing]], check=True,
                       capture_output=True, timeout=600, env=env)
    except (OSError, subprocess.SubprocessError) as err:
        return f"cannot install {', '.join(PACKAGES[t] for t in missing)} with apt-get: {err}"
    return None


class Cluster:
    def __init__(self):
        tag = f"{os.getpid() % 100000}"
        self.namespaces = [f"dsl{tag}a", f"dsl{tag}b"]
        self.hosts = [f"{SUBNET}.1", f"{SUBNET}.2"]
        self.dir = tempfile.mkdtemp(prefix="dslaunch-cluster-")
        self.ssh_config = os.path.join(self.dir, "ssh_config")
        self._sshd: list[subprocess.Popen] = []

    def create(self):
        veth = [f"dv{os.getpid() % 100000}a", f"dv{os.getpid() % 100000}b"]
        for ns in self.namespaces:
            _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for ns, end, host in zip(self.namespaces, veth, self.hosts):
            _run("ip", "link", "set", end, "netns", ns)
            _run("ip", "-n", ns, "link", "set", end, "name", INTERFACE)
            _run("ip", "-n", ns, "addr", "add", f"{host}/24", "dev", INTERFACE)
            _run("ip", "-n", ns, "link", "set", INTERFACE, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        self._start_sshd()

    def _start_sshd(self):
        key, host_key = os.path.join(self.dir, "id"), os.path.join(self.dir, "host_key")
        for path in (key, host_key):
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path)
        shutil.copy(key + ".pub", os.path.join(self.dir, "authorized_keys"))
        os.makedirs("/run/sshd", exist_ok=True)
        with open(self.ssh_config, "w") as handle:
            handle.write(f"Host *\n  IdentityFile {key}\n  IdentitiesOnly yes\n  StrictHostKeyChecking no\n"
                         "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n  User root\n")
        for index, (ns, host) in enumerate(zip(self.namespaces, self.hosts)):
            config = os.path.join(self.dir, f"sshd{index}.conf")
            with open(config, "w") as handle:
                handle.write(f"ListenAddress {host}\nHostKey {host_key}\nAuthorizedKeysFile {self.dir}/authorized_keys\n"
                             "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                             "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nLogLevel ERROR\n"
                             f"PidFile {self.dir}/sshd{index}.pid\n")
            self._sshd.append(subprocess.Popen(["ip", "netns", "exec", ns, shutil.which("sshd") or "/usr/sbin/sshd",
                                                "-D", "-e", "-f", config], stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL))
        for host in self.hosts:
            self._wait_for_ssh(host)

    def _wait_for_ssh(self, host: str):
        deadline = time.monotonic() + 15
        while True:
            probe = subprocess.run(self.in_first_node("ssh", "-F", self.ssh_config, host, "true"),
                                   capture_output=True, text=True, timeout=15)
            if probe.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {host} did not come up: {probe.stderr.strip()}")
            time.sleep(0.2)

    def in_first_node(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[0], *argv]

    def hostfile(self, slots: int = 2) -> str:
        path = os.path.join(self.dir, "hostfile")
        with open(path, "w") as handle:
            handle.write("".join(f"{host} slots={slots}\n" for host in self.hosts))
        return path

    def destroy(self):
        for sshd in self._sshd:
            sshd.kill()
            sshd.wait()
        for ns in self.namespaces:  # deleting a namespace also removes its veth end
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)
