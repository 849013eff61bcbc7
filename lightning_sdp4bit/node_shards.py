"""Weights sharded inside the node (`weight_sharding="node"`): each rank holds 1/L of them.

With L ranks per node and M nodes (rank = node * L + local), a bucket of N = W * S elements is
cut into W shards of S; rank r owns shard r's fp32 master. In the replicated mode every rank
also holds all N weights in the module's dtype. Here rank (m, l) holds only the **node slice**
[M, S]: the shards of the ranks at its local index l, one per node (row m' is rank m' * L + l's
shard; row m is its own, `Bucket.weight_shard`). Those are exactly the rows the weight exchange
brings across nodes at local index l (stage 1 of the replicated mode's two-level all-gather), so
the exchange writes them in place and stops there: no node-internal exchange after the step.

The node's L slices together are the whole bucket. Before a module's forward (and again before
its backward) the buckets of its parameters are **gathered** inside the node, losslessly, in the
module's dtype: an all-gather of the L slices, [L, M, S] (local-major), then a transposed copy
into rank order [M, L, S] = [N], which the parameters become views of again. After the forward
(and after the bucket's gradients arrive in backward) the bucket is **released**: this rank's
rows of it are copied back into its node slice (so a write made meanwhile, a hook's clamp, is
kept, as it would be in the replicated mode's weights) and the parameters point at a NaN
placeholder of their shape: any read that escapes the engine shows up as NaN, not as stale values.

When is a bucket gathered, and when released:
- a module's forward pre-hook gathers the buckets of its own parameters; its forward hook
  releases each once every module owning parameters in it has run forward (not inside backward,
  where activation checkpointing recomputes forwards whose backward follows at once), and, with
  gradients enabled, registers a hook on the outputs that gathers them again before that part
  of backward runs, and, for a bucket holding a tied parameter or an embedding's, one on the
  inputs that says when that part is done. `nn.Embedding` gets neither: its backward scatters
  the output's gradient by the indices and reads no weight;
- any other torch operation on a released parameter (a weight read outside its module's
  forward: a functional tied head, a penalty over the parameters, a callback) gathers its
  bucket first (`ReleasedReadGuard`). Read so in a forward with gradients enabled, the bucket
  stays until that backward is done (autograd saved the parameter itself); so does a bucket of
  shared weights (below) read, gathered, outside its own modules' forwards, since no module's
  backward says when autograd reads it there;
- in backward, a bucket is released once every parameter in it has its gradient, which comes
  right after its modules' backward, unless the bucket holds a parameter of two modules (a head
  tied to the token embedding) or of an nn.Embedding: the tied parameter's gradient completes
  only at the embedding's backward, the last. Such a bucket is released as soon as no forward
  call of its modules is inside its backward (FSDP2's reshard after backward): the tied head's
  goes after the head's backward. A call whose backward is still to come gathers it again (the
  hook on its outputs; a recomputed forward's pre-hook): a GPT's first LayerNorm shares the
  embedding's bucket, and needs it only at the end. A call whose inputs need no gradient (the
  first module of a model fed data) has no moment that says its backward is done: once it has
  begun, its buckets wait for their gradients. After backward, and before the optimizer step,
  the rest are released.

Gathers start ahead of the module that waits for them (`node_gather_prefetch`), in the order the
last pass of the same kind needed buckets (`gather_order`).

What this costs: an intra-node all-gather of (L - 1)/L x N x 2 bytes (bf16) per bucket before
each forward and each backward, on NVLink; its gain: (L - 1)/L of the weights' bytes held.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from lightning_sdp4bit import comm
from lightning_sdp4bit.buffers import Bucket, as_words
from lightning_sdp4bit.gather_order import GatherOrder
from lightning_sdp4bit.stats import WireMeter
from lightning_sdp4bit.topology import ProcessGroups, Topology
from lightning_sdp4bit.weight_access import StackedMode, params_touched, unseen

__all__ = ["NodeShards", "ReleasedReadGuard", "node_rows"]

# What a torch function mode sees of a parameter that reads no values: metadata, its gradient,
# its version counter, hook registration. None of these gathers a released bucket.
_NO_VALUES = frozenset(
    [
        *(
            getattr(torch._C.TensorBase, name).__get__
            for name in ("shape", "dtype", "device", "ndim", "requires_grad", "grad", "_version", "is_leaf", "layout")
        ),
        *(getattr(torch._C.TensorBase, name).__set__ for name in ("requires_grad", "grad")),
        *(
            getattr(torch.Tensor, name)
            for name in ("size", "dim", "numel", "nelement", "element_size", "is_floating_point", "register_hook")
        ),
        torch.Tensor.register_post_accumulate_grad_hook,
    ]
)


def node_rows(bucket: Bucket, topology: Topology) -> torch.Tensor:
    """This rank's rows of a gathered bucket's weights: [M, S], rows m * L + local."""
    return bucket.weights.view(topology.nodes, topology.ranks_per_node, -1)[:, topology.local_index]


class ReleasedReadGuard(StackedMode):
    """Hands every trained parameter that a torch operation reads the values of (`_NO_VALUES`
    says what does not) to `read` before the operation runs: it gathers a released bucket, and
    keeps for the backward one read outside its modules' forwards. Pushed for the engine's life;
    the engine's own swaps of the parameters' storage run with torch function modes off
    (`weight_access.unseen`)."""

    def __init__(self, read: Callable[[int], None], watched: dict[int, int]):
        super().__init__()
        self._read = read
        self.watched = watched  # id(parameter) -> its bucket, for every trained parameter

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.active and func not in _NO_VALUES:
            for param_id in params_touched(self.watched, args, kwargs):
                self._read(param_id)
        return func(*args, **kwargs)


class NodeShards:
    """One rank's node slices and the gathered state of its buckets (see the module docstring).

    `wait_exchange(indices)`: completes those buckets' weight exchanges (which write the node
    slices) before a gather reads them. `gathers_ahead`: the buckets whose gathers start ahead of
    the one a module waits for."""

    def __init__(
        self,
        buckets: Sequence[Bucket],
        topology: Topology,
        groups: ProcessGroups,
        timeouts: comm.Timeouts,
        meter: WireMeter,
        wait_exchange: Callable[[list[int]], None],
        gathers_ahead: int,
    ):
        if not topology.has_intra_stage:  # SDP4BitConfig.resolve_ranks_per_node refuses it first
            raise ValueError('weight_sharding="node" needs at least 2 ranks per node')
        self.buckets, self.topology, self.groups = buckets, topology, groups
        self.timeouts, self.meter, self._wait_exchange = timeouts, meter, wait_exchange
        self.gathers_ahead = gathers_ahead  # SDP4BitConfig.node_gather_prefetch
        self.gathered = [True] * len(buckets)  # as allocated: full weights
        self.closed = False  # after the engine's close: gathered for good
        self.sticky: set[int] = set()  # read for autograd where no module's backward says when: kept to its end
        self._waiting_users: list[set[int]] = [set() for _ in buckets]  # modules yet to run forward, per bucket
        self._users: list[set[int]] = [set() for _ in buckets]  # modules owning parameters in each bucket
        self._owners: dict[int, set[int]] = {}  # id(parameter) -> the modules owning it (two when tied)
        self._running: list[int] = []  # the hooked modules whose forward is running, innermost last
        # Buckets whose gradients can all be in well after the last backward that reads them: they
        # hold a parameter of two modules (a tied head's) or of an nn.Embedding (which reads none).
        # Their modules' calls say when their backward is done; every other bucket is released at
        # its gradients, which come right after its modules' backward anyway.
        self.early = [False] * len(buckets)
        # Per early bucket: this forward's module calls whose backward has not been seen to end,
        # and those of them whose backward has begun (regathered) and not been seen to end.
        self._backward_due: list[int] = [0] * len(buckets)
        self._in_backward: list[int] = [0] * len(buckets)
        self._arrived: list[int] = [0] * len(buckets)  # gradients in by this backward, per bucket
        self._landing: dict[int, tuple[Any, torch.Tensor]] = {}  # bucket -> its gather in flight, [L, M * S]
        self.order = GatherOrder()  # what to prefetch: the order the last pass needed buckets in
        watched = {id(param): index for index, bucket in enumerate(buckets) for param in bucket.params}
        self.guard = ReleasedReadGuard(self._read, watched)
        for index, bucket in enumerate(buckets):
            if bucket.node_slice is None:
                bucket.hold_node_slice(topology.nodes, topology.ranks_per_node)
            else:  # built as node slices (`materialize`): nothing is gathered yet
                self.gathered[index] = False

    # ----------------------------------------------------------------------------------------
    # Gathering and releasing

    @unseen
    def gather(self, indices: Iterable[int]) -> None:
        """Make these buckets' full weights the parameters' storage again, then start the gathers
        of the next `gathers_ahead` buckets the pass will need (`gather_order`), so that they
        cross NVLink while this module computes. Collective inside the node: every rank of it
        gathers the same buckets in the same order (the same module forwards, the same reads)."""
        indices = list(indices)
        for index in indices:
            if not self.gathered[index]:
                self._land(index)
        if indices:
            backward = _in_backward()
            self.order.needed(indices, backward)
            planned = self.order.after(indices, backward, self.gathers_ahead)
            for index in self._by_index(indices, backward) if planned is None else planned:
                if not self.gathered[index] and index not in self._landing:
                    self._start(index)

    def _by_index(self, indices: list[int], backward: bool) -> list[int]:
        """The next buckets guessed by index, where the pass has no plan: forward, the first layers
        are in the last bucket; backward, the reverse, of the buckets a backward still reads."""
        step = 1 if backward else -1
        ahead = max(indices) if backward else min(indices)
        nearby = [
            i for i in range(ahead + step, ahead + step * (self.gathers_ahead + 1), step) if 0 <= i < len(self.buckets)
        ]
        return [i for i in nearby if not backward or not self.early[i] or self._backward_due[i]]

    def _start(self, index: int) -> None:
        """Launch bucket `index`'s intra-node all-gather: its node slices [L, M, S] land local-major."""
        self._wait_exchange([index])
        bucket, local_ranks = self.buckets[index], self.topology.ranks_per_node
        slice_ = _node_slice(bucket).view(-1)
        landed = slice_.new_empty((local_ranks, slice_.numel()))
        with self.timeouts.named("intra-node weight gather", index):
            work = comm.all_gather(landed.view(-1), slice_, group=self.groups.intra, async_op=True)
        self.meter.record("weight_gather", slice_.nbytes, slice_.numel(), slice_.nbytes)
        self._landing[index] = (work, landed)

    def _land(self, index: int) -> None:
        """Wait for bucket `index`'s gather (launched now if it was not) and put the blocks in rank
        order, [L, M, S] -> [M, L, S] = [N]: the parameters' storage again."""
        if index not in self._landing:
            self._start(index)
        work, landed = self._landing.pop(index)
        bucket, nodes, local_ranks = self.buckets[index], self.topology.nodes, self.topology.ranks_per_node
        with torch.no_grad(), self.timeouts.named("intra-node weight gather", index):
            work.wait()
            if nodes == 1:  # local-major is rank order
                full = landed.view(-1)
            else:
                full = torch.empty(bucket.layout.numel, dtype=bucket.dtype, device=bucket.device)
                rows, blocks = as_words(full.view(nodes, local_ranks, -1), landed.view(local_ranks, nodes, -1))
                rows.copy_(blocks.transpose(0, 1))
            bucket.attach_weights(full)
        self.gathered[index] = True
        self._waiting_users[index] = set(self._users[index])

    @unseen
    def release(self, indices: Iterable[int], keep: bool = True) -> None:
        """Keep this rank's rows of these buckets in their node slices (unless not `keep`: the
        node slices are about to be overwritten) and let the full weights go."""
        for index in indices:
            self.sticky.discard(index)
            if index in self._landing:  # prefetched and not used: its gather completes all the same
                self._land(index)
            if not self.gathered[index]:
                continue
            bucket = self.buckets[index]
            with torch.no_grad():
                if keep:
                    _node_slice(bucket).copy_(node_rows(bucket, self.topology))
                if self.closed:  # no guard gathers any more: the module keeps its weights
                    continue
                bucket.detach_weights()
            self.gathered[index] = False

    def release_all(self) -> None:
        self.release(range(len(self.buckets)))

    def _read(self, param_id: int) -> None:
        """A torch operation reads this parameter (`ReleasedReadGuard`). Keep the bucket for the
        backward where autograd may save the parameter, and gather it if it is released; a
        gathered bucket need not be kept when it is released at its gradients (which come after
        every saved use) or when this is its module's forward (whose backward's end
        `after_module_backward` sees)."""
        index = self.guard.watched[param_id]
        gathered = self.gathered[index]
        if gathered and (
            not self.early[index] or (self._running and self._running[-1] in self._owners.get(param_id, ()))
        ):
            return
        if torch.is_grad_enabled() and not _in_backward():
            self.sticky.add(index)
        if not gathered:
            self.gather([index])

    # ----------------------------------------------------------------------------------------
    # The module hooks' and the step's moments

    def add_user(self, module: nn.Module, indices: list[int]) -> None:
        for index in indices:
            self._users[index].add(id(module))
        for param in module.parameters(recurse=False):
            owners = self._owners.setdefault(id(param), set())
            owners.add(id(module))
            if id(param) in self.guard.watched and (len(owners) > 1 or type(module) is nn.Embedding):
                self.early[self.guard.watched[id(param)]] = True

    def before_module_forward(self, module: nn.Module, indices: list[int]) -> None:
        self._running.append(id(module))
        self.gather(indices)

    @unseen
    def after_module_forward(self, module: nn.Module, indices: list[int], inputs: Any, output: Any) -> None:
        """Release the buckets every user of which has run forward; with gradients enabled, gather
        them again before the backward through this output, and for buckets of shared weights
        (`early`) count the backward through its `inputs` (its one tensor argument, or its
        positional and keyword arguments) as due."""
        if self._running and self._running[-1] == id(module):
            self._running.pop()
        if _in_backward():
            return  # a recomputed forward (activation checkpointing): its backward follows
        outputs = _needing_grad(output)
        if outputs and type(module) is not nn.Embedding:  # an Embedding's backward reads no weight
            _on_grads(outputs, _RegatherHook(self, indices), mode="any")  # before any of it runs
            early = [index for index in indices if self.early[index]]
            for index in early:
                self._backward_due[index] += 1
            inputs_ = _needing_grad(inputs) if early else []
            if inputs_:  # else its backward's end is never seen: begun, it keeps `early` to the gradients
                _on_grads(inputs_, _BackwardDoneHook(self, early), mode="all")  # once all of it ran
        for index in indices:
            waiting = self._waiting_users[index]
            waiting.discard(id(module))
            if not waiting and index not in self.sticky:
                self.release([index])

    def before_forward(self) -> None:
        """Release what a read gathered since the last step (a callback's) and no backward needs:
        the forward gathers what it uses."""
        self.release([i for i, gathered in enumerate(self.gathered) if gathered and i not in self.sticky])
        self._running.clear()  # a forward that raised left its modules here
        self.order.forward_starts()
        self._backward_due = [0] * len(self.buckets)
        self._in_backward = [0] * len(self.buckets)

    def before_module_backward(self, indices: list[int]) -> None:
        """One module call's backward is about to run (its output's gradient is computed): gather
        its buckets, and count it inside the backward of those of shared weights."""
        for index in indices:
            if self.early[index]:
                self._in_backward[index] += 1
        self.gather(indices)

    def after_module_backward(self, indices: list[int]) -> None:
        """One module call's backward is done (its inputs' gradients are computed): release the
        buckets no call is inside the backward of. A call whose backward is still to come gathers
        them again; embeddings' calls read none."""
        for index in indices:
            self._backward_due[index] -= 1
            self._in_backward[index] = max(0, self._in_backward[index] - 1)  # 0: its outputs got no gradient
            if not self._in_backward[index] and index not in self.sticky:
                self.release([index])

    def before_backward(self) -> None:
        self._arrived = [0] * len(self.buckets)
        self.order.forward_done()

    def grad_arrived(self, index: int) -> None:
        """One parameter of bucket `index` has its gradient of this backward; once all have, the
        bucket's weights are not needed again before the next forward."""
        self._arrived[index] += 1
        if self._arrived[index] == len(self.buckets[index].params):
            self.release([index])

    def close(self) -> None:
        """Stop guarding, and gather every bucket for good where the whole model fits on the device
        (the module whole again, as in the replicated mode); where it does not, its parameters stay
        NaN placeholders, with a warning that says where the trained weights are. A checkpoint
        saved after fit still reads the node slices."""
        if _fits(self.buckets, [i for i, gathered in enumerate(self.gathered) if not gathered]):
            self.gather(range(len(self.buckets)))
        else:
            warnings.warn(
                "sdp4bit: after fit, the whole model does not fit on this device, so the module's parameters are "
                "left empty (NaN placeholders of their shapes): read the trained weights from a checkpoint "
                "(lightning_sdp4bit.consolidate_checkpoint, or LightningModule.load_from_checkpoint)",
                stacklevel=3,
            )
        self.closed = True
        self.guard.close()


class _BackwardDoneHook:
    """Fires once in a backward, when the gradients of a module call's inputs are computed:
    that call's backward has read its parameters for the last time."""

    def __init__(self, shards: NodeShards, indices: list[int]):
        self.shards, self.indices = shards, indices

    def __call__(self, grads: Any) -> None:
        self.shards.after_module_backward(self.indices)


class _RegatherHook:
    """Fires once in a backward, when the gradient of a module's output is computed: the
    module's buckets are gathered before its part of backward reads its parameters."""

    def __init__(self, shards: NodeShards, indices: list[int]):
        self.shards, self.indices = shards, indices

    def __call__(self, grad: torch.Tensor) -> None:
        self.shards.before_module_backward(self.indices)  # returns None: the gradient passes on unchanged


def _needing_grad(value: Any) -> list[torch.Tensor]:
    """The tensors in `value` (a tensor, or a tuple, list or dict of them) that require grad."""
    if isinstance(value, torch.Tensor):  # most modules: no tree walk, a few microseconds
        return [value] if value.requires_grad else []
    if not torch.is_grad_enabled():
        return []
    leaves = torch.utils._pytree.tree_leaves(value)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _on_grads(tensors: list[torch.Tensor], hook: Callable[[Any], None], mode: Literal["all", "any"]) -> None:
    """Call `hook` once a backward has computed the gradient of any ("any") or of all ("all") of
    `tensors` that it reaches."""
    if len(tensors) == 1:
        tensors[0].register_hook(hook)
    else:
        torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode=mode)


def _node_slice(bucket: Bucket) -> torch.Tensor:
    assert bucket.node_slice is not None  # NodeShards gives every bucket one
    return bucket.node_slice


def _fits(buckets: Sequence[Bucket], released: list[int]) -> bool:
    """Whether the released buckets' full weights fit in the device's free memory, with room to spare."""
    device = buckets[0].device
    if device.type != "cuda" or not released:
        return True
    needed = sum(buckets[i].layout.numel * buckets[i].dtype.itemsize for i in released)
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return needed * 1.1 < free


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1
