"""Helpers for the checkpoint tests: a sharded engine without a Trainer, training steps on it,
snapshots of its whole training state, and a fault injector around the file operations."""

from __future__ import annotations

import builtins
import copy
import io
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
from models import make_model

# The file operations a save may use; nested calls (shutil.rmtree's own unlinks) count as one.
FILE_OPERATIONS = [
    (os, "open"),
    (os, "link"),
    (os, "replace"),
    (os, "rename"),
    (os, "mkdir"),
    (os, "makedirs"),
    (os, "unlink"),
    (os, "remove"),
    (os, "rmdir"),
    (os, "fsync"),
    (shutil, "rmtree"),
    (torch, "save"),
    (builtins, "open"),
    (io, "open"),
]


class InjectedFault(OSError):
    """What a failed file operation raises (as a full disk or a lost mount would)."""


# os.open flags that make it a write (opening a directory to fsync it is not one).
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


def _reading(args: tuple, kwargs: dict) -> bool:
    """Whether open(file, mode) or os.open(path, flags) opens for reading only."""
    mode = args[1] if len(args) > 1 else kwargs.get("mode", kwargs.get("flags", "r"))
    return not set(mode) & set("wax+") if isinstance(mode, str) else not mode & _WRITE_FLAGS


class FileOps:
    """`with FileOps(fail_at=k):` counts every file operation in FILE_OPERATIONS (opening for
    reading is not one) and makes operation k (0-based) fail before it runs: it raises
    InjectedFault, or calls `action` (e.g. one that SIGKILLs the process). With `proceed=True`
    operation k runs after `action` returns (e.g. one that sends SIGTERM, which a handler only
    notes); with `after=True` operation k runs first and `action` follows it (e.g. a SIGKILL
    right after a file was created). `ops` lists them."""

    def __init__(
        self,
        fail_at: int | None = None,
        action: Callable[[], None] | None = None,
        proceed: bool = False,
        after: bool = False,
    ):
        self.fail_at, self.action, self.proceed, self.after = fail_at, action, proceed, after
        self.ops: list[tuple[str, str]] = []
        self.fired = False
        self._inside = False
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, name: str, function: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._inside or (name == "open" and _reading(args, kwargs)):
                return function(*args, **kwargs)
            target = args[1] if name == "save" else args[0]
            label = os.path.basename(target) if isinstance(target, (str, os.PathLike)) else type(target).__name__
            self.ops.append((name, label))
            chosen = len(self.ops) - 1 == self.fail_at
            if chosen:
                self.fired = True
                if self.action is not None and not self.after:
                    self.action()
                if not self.proceed and not self.after:
                    raise InjectedFault(f"injected fault at file operation {self.fail_at}: {name}{self.ops[-1][1:]}")
            self._inside = True
            try:
                return function(*args, **kwargs)
            finally:
                self._inside = False
                if chosen and self.after and self.action is not None:
                    self.action()

        return wrapper

    def __enter__(self) -> FileOps:
        for owner, name in FILE_OPERATIONS:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def make_engine(rank: int, world: int, width: int = 32, optimizer_class: type | None = None, **config: Any):
    """A 1-block TinyLM under a sharded engine (qWD + TLq-HS), and an AdamW (or an
    `optimizer_class` with lr=1e-2) re-pointed at it."""
    from lightning_sdp4bit import SDP4BitConfig
    from lightning_sdp4bit.engine import ShardedEngine
    from lightning_sdp4bit.topology import Topology, create_process_groups

    topology = Topology(rank, world, world)
    model = make_model(0, layers=1, width=width)
    config = SDP4BitConfig.preset("sdp4bit", **{"bucket_numel": 3000, **config})
    engine = ShardedEngine(model, config, topology, create_process_groups(topology))
    if optimizer_class is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        optimizer = optimizer_class(model.parameters(), lr=1e-2)
    engine.shard_optimizer(optimizer)
    return engine, optimizer


def train_step(engine, optimizer, seed: int) -> None:
    """One optimizer step on seeded gradients, then the (quantized) weight all-gather."""
    generator = torch.Generator().manual_seed(seed)
    for records in engine.fragments_by_name.values():
        for record in records:
            record.master.grad = torch.randn(record.master.shape, generator=generator)
    optimizer.step()
    engine.post_optimizer_step()
    engine.wait_weights()


def snapshot(engine, optimizer) -> dict[str, Any]:
    """Everything a resume restores: masters, the replicas' weights, optimizer state, step."""
    return {
        "masters": [b.master.clone() for b in engine.buckets],
        "weights": [b.weights.clone() for b in engine.buckets],
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "step": engine.step,
    }


def same(a: Any, b: Any) -> bool:
    """Bit-exact equality of nested dicts, lists and tensors."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b
