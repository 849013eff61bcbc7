"""Run a function on several CPU processes joined by gloo, and bring their results back.

    results = run_workers(fn, world_size, *args)   # fn(rank, world_size, *args) -> picklable

`fn` must be a module-level function (workers start from a forkserver, which pickles it by
name). A worker's exception is re-raised in the test with its traceback.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import socket
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

WORKER_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Tensors cross the queue as bytes: a pickled tensor would point into this process's
        # shared memory, which is gone once the worker exits.
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context() -> Any:
    """A forkserver that has imported torch and Lightning once: each worker is forked from it
    (about 0.1 s for 4 workers) instead of starting a fresh interpreter that imports them again
    (about 10 s for 4 on 2 cores). The server never touches CUDA, so its children may."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "lightning.pytorch"])
    return context


def run_workers(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    context = _context()
    queue = context.Queue()
    port = _free_port()
    processes = [
        context.Process(target=_worker, args=(rank, world_size, port, fn, args, queue)) for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=WORKER_TIMEOUT_S)
            if not ok:
                raise RuntimeError(f"worker {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return [results[rank] for rank in range(world_size)]


@contextlib.contextmanager
def as_one_worker() -> Iterator[None]:
    """Within the block this process computes with one thread, as each worker does: a matmul's
    bits may depend on the thread count, so a simulation compared with the workers runs so too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
