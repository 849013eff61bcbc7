"""The namespace cluster (tests/support/namespace_cluster.py) itself, without torchrun: the hosts
reach each other over their addresses, and the cluster leaves nothing behind — after an exception
(its namespaces and the processes inside them are gone), after SIGTERM of the process that made
it, and after a creator that died without cleaning up (the next cluster deletes those stale
namespaces). Skipped, with the reason, where namespaces cannot be made."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from namespace_cluster import PREFIX, Cluster, unavailable_reason

pytestmark = pytest.mark.skipif(bool(unavailable_reason()), reason=f"no cluster: {unavailable_reason()}")


def _namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.strip()}


def test_three_hosts_talk_over_the_switch_and_nothing_survives_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with Cluster(hosts=3, rate="100mbit") as cluster:
            names = {cluster.switch, *cluster.namespaces}
            assert names <= _namespaces()
            # host 2 serves one TCP connection; host 0 connects to it through the bridge.
            server = subprocess.Popen(
                ["ip", "netns", "exec", cluster.namespaces[2], sys.executable, "-c",
                 "import socket; s = socket.create_server(('10.231.0.3', 5000)); c, _ = s.accept(); c.sendall(b'hi')"]
            )  # fmt: skip
            client = (
                "import socket, time\n"
                "for _ in range(50):\n"
                "    try:\n"
                "        print(socket.create_connection(('10.231.0.3', 5000)).recv(2).decode()); break\n"
                "    except ConnectionRefusedError: time.sleep(0.1)\n"
            )
            reply = cluster.exec(0, [sys.executable, "-c", client], capture_output=True, text=True, timeout=60)
            assert reply.stdout.strip() == "hi", reply.stderr
            server.wait(timeout=30)
            sent_before = cluster.tx_bytes(0)
            assert sent_before > 0
            sleeper = subprocess.Popen(["ip", "netns", "exec", cluster.namespaces[1], "sleep", "600"])
            raise RuntimeError("boom")
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    assert not names & _namespaces()


def test_sigterm_of_the_creator_removes_its_cluster(tmp_path):
    ready = tmp_path / "ready"
    script = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); from namespace_cluster import Cluster\n"
        "with Cluster(hosts=2) as c:\n"
        "    open(sys.argv[2], 'w').write(' '.join([c.switch, *c.namespaces])); time.sleep(600)\n"
    )
    support = Path(__file__).resolve().parents[1] / "support"  # where namespace_cluster.py is
    creator = subprocess.Popen([sys.executable, "-c", script, str(support), str(ready)])
    deadline = time.monotonic() + 60
    while not ready.exists() or not ready.read_text():
        assert time.monotonic() < deadline and creator.poll() is None
        time.sleep(0.1)
    names = set(ready.read_text().split())
    assert names <= _namespaces()
    creator.send_signal(signal.SIGTERM)
    assert creator.wait(timeout=30) == 128 + signal.SIGTERM
    assert not names & _namespaces()


def test_namespaces_of_a_dead_creator_are_cleaned_by_the_next_cluster():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{PREFIX}{dead.pid}x000000h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    mine = f"{PREFIX}{os.getpid()}x000000h0"  # a live creator's namespace stays
    subprocess.run(["ip", "netns", "add", mine], check=True)
    try:
        with Cluster(hosts=1):
            assert stale not in _namespaces()
            assert mine in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", mine], check=False)
