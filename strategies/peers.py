"""Which ranks a broken connection led to, so that the error of a rank whose peer died names it.

gloo reports a dead peer by its address only (`Read error [10.231.0.3]:18582: Connection reset
by peer`), in whichever collective comes next: one of the engine's, a `sync_dist` log, a
barrier. The strategy gathers every rank's address once at setup (one all_gather_object), and
when fit fails with such an error, `lost_peer_note` names the global ranks at that address.
"""

from __future__ import annotations

import os
import re
import socket

import torch.distributed as dist

from lightning_sdp4bit import comm

__all__ = ["gather_addresses", "local_address", "lost_peer_note"]

_PEER = re.compile(r"\[([0-9A-Fa-f:.]+)\]:\d+")
"""A peer in gloo's connection errors: `[address]:port`."""


def local_address() -> str:
    """This process's address on the way to MASTER_ADDR, the one its peers see. Connecting a
    UDP socket only picks the route: nothing is sent."""
    master, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    try:
        family, _, _, _, address = socket.getaddrinfo(master, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError:
        return "unknown"


def gather_addresses(timeouts: comm.Timeouts) -> list[str]:
    """Every rank's `local_address()`, by global rank. Collective over the default group: a rank
    that never arrives ends in `comm.CollectiveTimeoutError` naming this gather."""
    addresses: list = [None] * dist.get_world_size()
    with timeouts.named("the all-gather of the ranks' addresses at setup"):
        dist.all_gather_object(addresses, local_address())
    return addresses


def lost_peer_note(exception: BaseException, addresses: list[str], rank: int) -> str | None:
    """A sentence naming the global ranks behind the first peer address in `exception`'s
    message (other than this rank), or None when it names no address of a known rank."""
    match = _PEER.search(str(exception)) if isinstance(exception, RuntimeError) else None
    if match is None:
        return None
    ranks = [r for r, address in enumerate(addresses) if address == match.group(1) and r != rank]
    if not ranks:
        return None
    who = f"global rank {ranks[0]}" if len(ranks) == 1 else f"one of global ranks {', '.join(map(str, ranks))}"
    return (
        f"sdp4bit (rank {rank}): the broken connection led to {match.group(1)}, the host of {who}; "
        "that process probably died or lost its network (its own log says why)."
    )
