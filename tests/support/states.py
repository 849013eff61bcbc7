"""Comparing two runs' end states, as the bit-exact tests record them: a dict of "losses" (list),
"weights" (name -> tensor), "masters" (list of tensors) and "optimizer" (a state_dict)."""

from __future__ import annotations

import torch


def assert_same_state(a: dict, b: dict, where: str) -> None:
    """Every loss, weight, master shard and optimizer state tensor of `a` equals `b`'s bit for bit."""
    assert a["losses"] == b["losses"], where
    for name, weight in b["weights"].items():
        assert torch.equal(a["weights"][name], weight), f"{where}: weight {name}"
    for index, (x, y) in enumerate(zip(a["masters"], b["masters"], strict=True)):
        assert torch.equal(x, y), f"{where}: master shard of bucket {index}"
    a_state, b_state = a["optimizer"]["state"], b["optimizer"]["state"]
    assert a_state.keys() == b_state.keys(), where
    for key in b_state:
        for field, value in b_state[key].items():
            assert torch.equal(a_state[key][field], value), f"{where}: optimizer state {key}.{field}"
