"""A multi-host cluster on one Linux machine: hosts are network namespaces, joined by a switch.

    with Cluster(hosts=2, rate="100mbit") as cluster:
        run = cluster.torchrun("tests/support/cluster_worker.py", ["--steps", "4"], nproc_per_node=2)
        run.wait(timeout=120)
        results = run.results()          # {global rank: whatever that rank passed to save_result}

Topology (one run; every name carries the run's id, so parallel or crashed runs never collide):

    host namespace <id>h0          switch namespace <id>sw         host namespace <id>h1
    eth0 10.231.0.1/24  <-veth->  p0 --+-- br0 --+-- p1  <-veth->  eth0 10.231.0.2/24
                                        \\      (p2 <-veth-> eth0 10.231.0.3 of h2, ...)

Every link lives inside namespaces this module made (the switch too), so nothing is added to the
machine's own network and no traffic leaves the namespaces. `rate` shapes both directions of every
host's link with a token bucket (`tc ... tbf`): the host's eth0 (what it sends) and its switch
port (what it receives). This kernel has no netem qdisc (`tc` answers "Specified qdisc kind is
unknown"), so there is no added delay; tbf's own queueing is the only latency.

On each host, one torchrun agent starts `nproc_per_node` workers; the agents rendezvous over TCP
(c10d backend, store on host 0) and gloo runs over eth0 (GLOO_SOCKET_IFNAME). Everything inside a
run's namespaces was started by this module, so cleanup kills exactly the PIDs that `ip netns pids`
lists there (torchrun starts its workers in their own sessions, so killing the agent's process
group would not reach them), then deletes the namespaces, which removes their links.

Cleanup runs on every exit of the `with` block: on exceptions, on Ctrl-C, and on SIGTERM (turned
into SystemExit while the block runs). Namespaces left by a run whose creator process is dead
(e.g. after SIGKILL) are deleted by the next run (their names carry the creator's PID).

`unavailable_reason()` says why a cluster cannot be made here (not root, no `ip`/`tc`), so tests
can skip with that reason.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

PREFIX = "sdp4c"
"""Start of every namespace name this module makes: <PREFIX><creator pid>x<random hex><role>."""
SUBNET = "10.231.0"
"""The hosts' /24 (host i is .i+1). It exists only inside one run's namespaces."""
RDZV_PORT = 29400
DEVICE = "eth0"
"""Each host's interface; the switch end of host i's link is p<i>, on bridge br0."""
RESULT_ENV = "CLUSTER_RESULT_DIR"
"""Directory (shared: the namespaces share the file system) where workers save their results."""


def unavailable_reason() -> str | None:
    """None if this process can build a cluster, else why not (for pytest.skip)."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return f"network namespaces need root (ip netns add), this process runs as uid {os.geteuid()}"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found on PATH (install iproute2)"
    return None


def save_result(value: Any) -> None:
    """Called by a worker: store `value` as this rank's result (torch.save; RANK names the file)."""
    directory = os.environ[RESULT_ENV]
    torch.save(value, os.path.join(directory, f"rank_{int(os.environ['RANK']):05d}.pt"))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(namespace: str) -> list[int]:
    """SIGKILL every process inside `namespace` (all of them were started by this module)."""
    pids = [int(p) for p in _ip("netns", "pids", namespace, check=False).stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def _delete_namespaces(names: list[str]) -> None:
    for name in names:
        _kill_namespace_processes(name)
    for name in names:
        _ip("netns", "del", name, check=False)


def clean_stale() -> list[str]:
    """Delete namespaces (and their processes) of earlier runs whose creator process is dead."""
    stale = []
    for name in _namespaces():
        if not name.startswith(PREFIX):
            continue
        creator = name[len(PREFIX) :].split("x", 1)[0]
        if creator.isdigit() and not _pid_alive(int(creator)):
            stale.append(name)
    _delete_namespaces(stale)
    return stale


class Cluster:
    """H hosts in network namespaces behind one switch; see the module docstring."""

    def __init__(self, hosts: int = 2, rate: str | None = None, burst: str = "256kb"):
        if hosts < 1:
            raise ValueError(f"hosts must be at least 1, got {hosts}")
        if rate is not None and not rate[:1].isdigit():
            raise ValueError(f"rate must be a tc rate such as '100mbit' or '1gbit', got {rate!r}")
        self.hosts, self.rate, self.burst = hosts, rate, burst
        self.id = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        self.switch = f"{self.id}sw"
        self.namespaces = [f"{self.id}h{i}" for i in range(hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self._made: list[str] = []
        self._old_sigterm: Any = None
        self._runs: list[TorchRun] = []

    # -- lifetime ----------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"cannot build a cluster here: {reason}")
        clean_stale()
        if _in_main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process in this run's namespaces, delete them (their links go with them)."""
        _delete_namespaces(list(reversed(self._made)))
        self._made.clear()
        for run in self._runs:
            run.reap()
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def _build(self) -> None:
        for name in (self.switch, *self.namespaces):
            _ip("netns", "add", name)
            self._made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (host, address) in enumerate(zip(self.namespaces, self.addresses, strict=True)):
            port = f"p{i}"
            # Both ends are created inside their namespaces: no name ever exists on the machine itself.
            _ip("link", "add", DEVICE, "netns", host, "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", host, "addr", "add", f"{address}/24", "dev", DEVICE)
            _ip("-n", host, "link", "set", DEVICE, "up")
            if self.rate:
                self._shape(host, DEVICE)
                self._shape(self.switch, port)

    def _shape(self, namespace: str, device: str) -> None:
        command = ["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf"]
        command += ["rate", self.rate, "burst", self.burst, "latency", "50ms"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"`{' '.join(command)}` failed: {result.stderr.strip()}")

    # -- inspection --------------------------------------------------------------------------

    def tx_bytes(self, host: int) -> int:
        """Bytes host `host` has sent on its eth0 so far (the veth's own counter)."""
        out = _ip("-j", "-s", "-n", self.namespaces[host], "link", "show", "dev", DEVICE).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def exec(self, host: int, command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """Run a short command inside host `host`'s namespace and wait for it."""
        return subprocess.run(["ip", "netns", "exec", self.namespaces[host], *command], **kwargs)

    # -- torchrun ----------------------------------------------------------------------------

    def torchrun(
        self,
        script: str,
        args: list[str] | tuple[str, ...] = (),
        nproc_per_node: int = 1,
        env: dict[str, str] | None = None,
        *,
        result_dir: str,
    ) -> TorchRun:
        """Start one torchrun agent per host on `script args`; returns at once (see TorchRun).

        `result_dir` (an existing directory) receives each host's log and each rank's result."""
        run = TorchRun(self, script, list(args), nproc_per_node, env or {}, result_dir)
        self._runs.append(run)
        return run


class TorchRun:
    """One torchrun agent per host of a cluster, running the same script; logs and results."""

    def __init__(self, cluster: Cluster, script: str, args: list[str], nproc: int, env: dict, result_dir: str):
        self.cluster = cluster
        self.result_dir = result_dir
        self.logs = [Path(self.result_dir) / f"host_{i}.log" for i in range(cluster.hosts)]
        base = {**os.environ, "GLOO_SOCKET_IFNAME": DEVICE, RESULT_ENV: self.result_dir, "OMP_NUM_THREADS": "1"}
        base.update(env)
        self.agents: list[subprocess.Popen] = []
        for i, namespace in enumerate(cluster.namespaces):
            command = ["ip", "netns", "exec", namespace, sys.executable, "-m", "torch.distributed.run"]
            command += ["--nnodes", str(cluster.hosts), "--node-rank", str(i), "--nproc-per-node", str(nproc)]
            command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.addresses[0]}:{RDZV_PORT}"]
            # Without --local-addr the agents advertise the machine's hostname, which resolves to
            # the same loopback address in every namespace.
            command += ["--rdzv-id", cluster.id, "--local-addr", cluster.addresses[i], "--max-restarts", "0"]
            # Host 0 serves the rendezvous store: torchrun's own guess compares the endpoint with
            # the machine's hostname, which no namespace address matches.
            command += ["--rdzv-conf", f"is_host={int(i == 0)}"]
            command += [script, *args]
            with open(self.logs[i], "w") as log:
                # `ip netns exec` execs the command, so the Popen's PID is the agent's.
                self.agents.append(
                    subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=base, start_new_session=True)
                )

    def wait(self, timeout: float) -> list[int]:
        """Wait for every agent; their exit codes by host. Raises TimeoutError (logs attached)."""
        deadline = time.monotonic() + timeout
        codes = []
        for i, agent in enumerate(self.agents):
            try:
                codes.append(agent.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"host {i}'s torchrun still runs after {timeout} s\n{self.log_text()}") from None
        return codes

    def check(self, timeout: float) -> None:
        """wait(), and raise with every host's log if an agent failed."""
        codes = self.wait(timeout)
        if any(codes):
            raise RuntimeError(f"torchrun exit codes by host {codes}\n{self.log_text()}")

    def kill_host(self, host: int) -> list[int]:
        """SIGKILL host `host`'s agent and its workers (every process in its namespace): a lost host."""
        return _kill_namespace_processes(self.cluster.namespaces[host])

    def log(self, host: int) -> str:
        return self.logs[host].read_text(errors="replace")

    def log_text(self) -> str:
        return "\n".join(f"--- host {i} ---\n{self.log(i)[-6000:]}" for i in range(len(self.logs)))

    def results(self) -> dict[int, Any]:
        """{global rank: value} from every worker's save_result."""
        files = sorted(Path(self.result_dir).glob("rank_*.pt"))
        return {int(f.stem.split("_")[1]): torch.load(f, weights_only=False) for f in files}

    def reap(self) -> None:
        """Collect the agents' exit status (after their namespace's processes were killed)."""
        for agent in self.agents:
            agent.wait()


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
