"""benchmarks/link_bytes.py on the CPU: the bytes per element it reports are the engine's.

- the uncompressed baseline puts on each GPU's NIC what its two-level exchanges move: the fp32
  gradients' inter-node reduce-scatter of the node's 1/L, (M-1)/M x 4/L bytes per parameter, and
  the bf16 weights' inter-node all-gather, (M-1)/M x 2/L: (M-1)/M x 6/L in all;
- sdp4bit puts on the NIC its two 4-bit exchanges across nodes, each (M-1)/M x 1/L of the
  elements at half a byte plus one fp32 scale per group (2048 weights, 128 gradients), and
  each bucket pays the latency of its two exchanges across nodes, 2 (M - 1) messages;
- a malformed --topologies is refused by name.
"""

import sys
from argparse import Namespace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from link_bytes import bytes_per_element, main  # noqa: E402

from lightning_sdp4bit.topology import Topology  # noqa: E402

ARGS = Namespace(layers=1, width=128, warmup=1)


@pytest.mark.parametrize("nodes, local", [(2, 4), (4, 2)])
def test_the_baseline_puts_its_two_level_bytes_on_the_nic(nodes, local):
    nvlink, nic, _, _ = bytes_per_element("baseline", Topology(0, nodes * local, local), ARGS)
    assert nic == pytest.approx((nodes - 1) / nodes * 6 / local, rel=0.02)
    assert nvlink > nic  # the intra-node stages carry the rest
    _, compressed, per_bucket, per_step = bytes_per_element("sdp4bit", Topology(0, nodes * local, local), ARGS)
    weights, grads = 0.5 + 4 / 2048, 0.5 + 4 / 128  # bytes per element: codes and scales
    assert compressed == pytest.approx((nodes - 1) / nodes * (weights + grads) / local, rel=0.01)
    # Per bucket: the gradients' all-to-all across nodes (M - 1 messages) and the weights' ring
    # all-gather across nodes (M - 1 steps), at 10 us each. Per step: the world's all-reduces.
    assert per_bucket == pytest.approx(2 * (nodes - 1) * 10)
    assert per_step > 0


def test_a_malformed_topology_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--topologies", "16by4"])
    assert "--topologies: '16by4' is not NODESxGPUS" in capsys.readouterr().err
