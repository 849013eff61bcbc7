"""SDP4BitStrategy on a real multi-host cluster: hosts in network namespaces, torchrun per host,
gloo over TCP between them (tests/support/namespace_cluster.py builds it;
tests/support/cluster_worker.py trains).

Checked:
- 2 hosts x 2 processes, default config, ranks_per_node unset: both stages of the two-level
  exchange run (8.25 and 4.25 bits per element), the replicas are bit-identical, and the final
  weights equal a single-host run of 4 processes with ranks_per_node=2 bit for bit;
- 3 hosts x 1 process (an odd node count: the inter-node stage only) trains, identical replicas;
- losing a host (SIGKILL of its agent and workers) makes every rank left, on each other host,
  exit non-zero, well inside the timeout, with an error that names the broken connection and
  the global rank at its far end;
- a sharded checkpoint saved on 2 hosts x 2 resumes on 1 host x 2 with the same masters and weights.

Skipped, with the reason, where namespaces cannot be made (not root, no `ip`/`tc`).

Most of the cost is starting processes (importing Lightning takes about 7 s of CPU each, on 2
cores), so the runs are shared: one 2 x 2 run serves the parity and the checkpoint tests, and
the single-host run it is compared with starts beside it; one 3 x 1 run trains, saves every
rank's result after step 2, and then loses its third host.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from distributed import run_workers
from lightning_runs import make_trainer, sdp4bit, weights
from models import TinyLMModule
from namespace_cluster import SUBNET, Cluster, unavailable_reason

pytestmark = pytest.mark.skipif(bool(unavailable_reason()), reason=f"no cluster: {unavailable_reason()}")

WORKER = str(Path(__file__).resolve().parents[1] / "support" / "cluster_worker.py")
RUN_TIMEOUT_S = 240
"""Wall-clock bound of one cluster run (start-up of 2-4 Lightning processes on 2 cores included)."""
COLLECTIVE_TIMEOUT_S = 15
"""The strategy's `timeout=` in the host-loss test: how long a rank may wait on a dead peer."""


def _train(tmp_path: Path, hosts: int, nproc: int, options: dict) -> dict[int, dict]:
    with Cluster(hosts=hosts) as cluster:
        run = cluster.torchrun(WORKER, [json.dumps(options)], nproc_per_node=nproc, result_dir=str(tmp_path))
        run.check(RUN_TIMEOUT_S)
        results = run.results()
    assert sorted(results) == list(range(hosts * nproc))
    return results


def _assert_replicas_identical(results: dict[int, dict]) -> None:
    first = results[0]["weights"]
    for rank, result in results.items():
        for name, value in result["weights"].items():
            assert torch.equal(value, first[name]), (rank, name)


# The 2 x 2 run is shared by two tests: it costs most of this file's time (4 Lightning processes
# and 2 agents starting on 2 cores). One window repeated keeps the checkpoint test's resume exact
# (see tests/integration/test_strategy_checkpoint.py: Lightning does not replay a resumed epoch's
# data order).
MODULE = {"dataset_size": 1, "repeat": 32}
STEPS = 3


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory) -> tuple[dict[int, dict], str, dict]:
    """The 2 x 2 run's results, its checkpoint, and rank 0's weights from the single-host
    `devices=4, ranks_per_node=2` run, which trains in a thread meanwhile."""
    directory = tmp_path_factory.mktemp("two_by_two")
    path = str(directory / "cluster.ckpt")
    single_host: list = []
    thread = threading.Thread(target=lambda: single_host.append(run_workers(_single_host_virtual_nodes, 4)[0]))
    thread.start()
    try:
        results = _train(directory, hosts=2, nproc=2, options={"steps": STEPS, "save": path, "module": MODULE})
    finally:
        thread.join()
    assert single_host, "the single-host run failed (its error is printed above)"
    return results, path, single_host[0]


def _single_host_virtual_nodes(rank: int, world: int) -> dict:
    module = TinyLMModule(**MODULE)
    make_trainer(world, sdp4bit(ranks_per_node=2), max_steps=STEPS).fit(module)
    return weights(module)


def test_two_hosts_of_two_run_both_stages_and_equal_the_single_host_run(two_by_two):
    results, _, single_host = two_by_two
    for result in results.values():
        assert result["local_world"] == 2 and result["world"] == 4
        stats = result["comm_stats"]
        assert stats["grad_intra_bits_per_element"] == 8.25
        assert stats["grad_inter_bits_per_element"] == 4.25
        assert stats["weight_bits_per_element"] == 4 + 32 / 2048
    _assert_replicas_identical(results)
    for name, expected in single_host.items():
        assert torch.equal(results[0]["weights"][name], expected), name


@pytest.fixture(scope="module")
def three_by_one_losing_a_host(tmp_path_factory) -> dict:
    """3 hosts x 1 process: every rank saves its result after step 2 and trains on; once all
    have, host 2 (its agent and worker) is SIGKILLed. The results, and how hosts 0 and 1 ended."""
    directory = tmp_path_factory.mktemp("three_by_one")
    progress = directory / "progress"
    progress.mkdir()
    options = {"steps": 100_000, "timeout_s": COLLECTIVE_TIMEOUT_S, "progress": str(progress), "result_at_step": 2}
    with Cluster(hosts=3) as cluster:
        run = cluster.torchrun(WORKER, [json.dumps(options)], nproc_per_node=1, result_dir=str(directory))
        deadline = time.monotonic() + RUN_TIMEOUT_S
        # Rank r writes step_r after saving its result: wait until every rank is past step 2.
        while sorted(int(f.read_text() or 0) > 2 for f in progress.glob("step_*")) != [True] * 3:
            assert time.monotonic() < deadline, run.log_text()
            assert all(agent.poll() is None for agent in run.agents), run.log_text()
            time.sleep(0.2)
        killed = run.kill_host(2)
        lost_at = time.monotonic()
        codes, elapsed = [], []
        for agent in run.agents[:2]:
            codes.append(agent.wait(timeout=RUN_TIMEOUT_S))
            elapsed.append(time.monotonic() - lost_at)
        logs = [run.log(0), run.log(1)]
        results = run.results()
    return {"results": results, "killed": killed, "codes": codes, "elapsed": elapsed, "logs": logs}


def test_three_hosts_of_one_train_with_identical_replicas(three_by_one_losing_a_host):
    results = three_by_one_losing_a_host["results"]
    assert sorted(results) == [0, 1, 2]
    for result in results.values():
        assert result["world"] == 3 and result["local_world"] == 1
        stats = result["comm_stats"]
        assert stats["grad_intra_bytes"] == 0  # one rank per node: no intra-node stage
        assert stats["grad_inter_bits_per_element"] == 4.25
    _assert_replicas_identical(results)
    initial = weights(TinyLMModule())
    assert any(not torch.equal(results[0]["weights"][n], w) for n, w in initial.items())  # it trained


def test_losing_a_host_fails_every_other_rank_quickly(three_by_one_losing_a_host):
    run = three_by_one_losing_a_host
    assert len(run["killed"]) >= 2  # the agent and its worker
    for host, (code, elapsed, log) in enumerate(zip(run["codes"], run["elapsed"], run["logs"], strict=True)):
        assert code != 0, log
        assert elapsed < 4 * COLLECTIVE_TIMEOUT_S, (elapsed, log)
        # torchrun's summary lists the failed worker of this host with its global rank, unless the
        # agent lost the rendezvous store first (host 0's agent holds it and may exit before).
        assert f"rank      : {host} (local_rank: 0)" in log or "RendezvousConnectionError" in log, log
        assert any(s in log for s in ("Connection closed by peer", "Connection reset by peer", "10.231.0.3")), log
        # The strategy names the ranks at the broken connection's far end (usually host 2's rank
        # 2; a survivor that fails later may see the first survivor's connection break instead).
        note = rf"sdp4bit \(rank {host}\): the broken connection led to {SUBNET}\.\d, the host of global rank \d"
        assert re.search(note, log), log


def _resume_on_one_host(rank: int, world: int, path: str) -> dict:
    module = TinyLMModule(**MODULE)
    trainer = make_trainer(world, sdp4bit(), max_steps=STEPS + 1)
    loaded = {}

    def grab(*args):
        loaded["weights"] = weights(module)
        loaded["masters"] = {
            (record.fragment.name, record.fragment.param_start): record.master.clone()
            for records in trainer.strategy.engine.fragments_by_name.values()
            for record in records
        }

    module.on_train_start = grab
    trainer.fit(module, ckpt_path=path)
    return {**loaded, "global_step": trainer.global_step}


def _full(pieces_per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Reassemble {(name, start): slice} from every rank into {name: flat tensor}."""
    full: dict[str, dict[int, torch.Tensor]] = {}
    for pieces in pieces_per_rank:
        for (name, start), values in pieces.items():
            full.setdefault(name, {})[start] = values
    return {name: torch.cat([parts[s] for s in sorted(parts)]) for name, parts in full.items()}


def test_checkpoint_saved_on_two_hosts_resumes_on_one(two_by_two):
    saved, path, _ = two_by_two
    resumed = run_workers(_resume_on_one_host, 2, path)
    saved_masters = _full([r["masters"] for r in saved.values()])
    loaded_masters = _full([r["masters"] for r in resumed])
    assert saved_masters.keys() == loaded_masters.keys()
    for name, expected in saved_masters.items():
        assert torch.equal(loaded_masters[name], expected), name
    for result in resumed:
        assert result["global_step"] == STEPS + 1
        for name, expected in saved[0]["weights"].items():
            assert torch.equal(result["weights"][name], expected), name
