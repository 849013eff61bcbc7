"""Re-pointing a user's optimizer at the engine's fp32 master fragments.

The optimizer keeps its class, its options and its parameter groups; only the tensors in the
groups change, from the module's parameters to this rank's master fragments (see
`lightning_sdp4bit.engine.MasterFragment`). Two of its methods are overridden, in a subclass of
its own class that the optimizer is moved to (not on the instance: Fabric's optimizer wrapper
copies the class, not the instance's attributes, so `optimizer.zero_grad()` in a Fabric loop
would otherwise resolve to torch's and never reach the engine):
- `zero_grad` also tells the engine (`ShardedEngine.zero_grad`) that the window ended: the accumulated and reduced
  gradients are dropped (what zero_grad means for the module's parameters under DDP);
- `add_param_group` raises: the set of trained parameters is fixed when the engine is built, so
  a parameter added later (BaseFinetuning's unfreezing) would have no bucket and never train.

A simulated job's other ranks each get a replica: an optimizer of the user's class and options
over their own master fragments (`replica_optimizer`), stepped with rank 0's group options after
rank 0's (`step_replica`: an LR scheduler changes those).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lightning_sdp4bit.engine import ShardedEngine
    from lightning_sdp4bit.rank import ShardedRank

__all__ = ["replica_optimizer", "shard_optimizer", "step_replica"]

_FIXED_SET = (
    "under sdp4bit the set of trained parameters is fixed when fit starts: freeze parameters before fit "
    "(requires_grad=False, e.g. in BaseFinetuning.freeze_before_training) and keep them frozen, or "
    "train them from the start with a zero learning rate in their own parameter group and raise it later"
)


def shard_optimizer(engine: ShardedEngine, optimizer: torch.optim.Optimizer) -> None:
    """Re-point `optimizer`'s parameter groups at this rank's fp32 master fragments.

    Group options (lr, weight decay, ...) stay as they are, so LR schedulers keep working.
    Parameters the module does not train are dropped from the groups. The optimizer must be
    fresh: state created for the full parameters cannot be split.
    """
    if optimizer.state:
        raise ValueError(
            f"{type(optimizer).__name__} already holds state; configure_optimizers must return a fresh "
            "optimizer (the strategy re-points it at the sharded fp32 master weights)"
        )
    _refuse_closure_optimizers(optimizer)
    name_of = {id(p): slot.name for b in engine.buckets for slot, p in zip(b.layout.slots, b.params, strict=True)}
    seen: set[int] = set()
    group_names = []
    for group in optimizer.param_groups:
        new_params: list[torch.Tensor] = []
        names: list[str] = []
        for param in group["params"]:
            if id(param) in seen:
                raise ValueError("a parameter appears twice in the optimizer's param_groups")
            seen.add(id(param))
            if id(param) in name_of:
                names.append(name_of[id(param)])
                new_params.extend(record.master for record in engine.fragments_by_name.get(names[-1], []))
            elif param.requires_grad:
                raise ValueError(
                    f"the optimizer holds a tensor of shape {tuple(param.shape)} that is not a parameter "
                    "of the LightningModule; optimize the module's own parameters"
                )
        group["params"] = new_params
        group_names.append(names)
    engine.optimizer_param_names.append(group_names)
    engine.optimizers.append(optimizer)
    _wrap_methods(engine, optimizer)


def _wrap_methods(engine: ShardedEngine, optimizer: torch.optim.Optimizer) -> None:
    base = type(optimizer)

    def zero_grad(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        engine.zero_grad()
        base.zero_grad(self, *args, **kwargs)

    def add_param_group(self: torch.optim.Optimizer, param_group: dict[str, Any]) -> None:
        raise ValueError(f"{base.__name__}.add_param_group was called during fit: {_FIXED_SET}")

    # Same name, module and everything else as the user's class: isinstance checks, schedulers,
    # fused kernels' class attributes and messages see no difference.
    namespace = {"zero_grad": zero_grad, "add_param_group": add_param_group, "__module__": base.__module__}
    optimizer.__class__ = type(base.__name__, (base,), {**namespace, "__qualname__": base.__qualname__})


def _refuse_closure_optimizers(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer that re-evaluates the loss within one step (LBFGS's line search) would see
    the model's weights unchanged: they move only when the step's weight exchange runs, after it."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "LBFGS re-evaluates the loss inside optimizer.step(), at trial weights; under sdp4bit the model's "
            "weights change only after the step (the sharded fp32 masters step, then the weights are exchanged), so "
            "its line search would see the old weights. Use a first-order optimizer (AdamW, SGD, ...) with sdp4bit."
        )


def replica_optimizer(optimizer: torch.optim.Optimizer, rank: ShardedRank, group_names: list[list[str]]):
    """An optimizer of `optimizer`'s class and options over `rank`'s master fragments, its groups
    those of `optimizer` (`group_names`: the trained parameters' names in each)."""
    cls = type(optimizer).__mro__[1]  # the user's class (shard_optimizer moved the optimizer to a subclass)
    accepted = inspect.signature(cls).parameters  # `defaults` may hold more (AdamW's decoupled_weight_decay)
    options = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [record.master for name in names for record in rank.fragments_by_name.get(name, [])],
        }
        for group, names in zip(optimizer.param_groups, group_names, strict=True)
    ]
    try:
        return cls(groups, **options)
    except TypeError as err:
        raise TypeError(
            f"simulation: cannot build {cls.__name__} for the other ranks as {cls.__name__}(param_groups, "
            f"**defaults) ({err}); the simulation supports optimizers whose constructor takes their "
            "defaults as keyword arguments, as torch.optim's do"
        ) from err


def step_replica(optimizer: torch.optim.Optimizer, replica: torch.optim.Optimizer) -> None:
    """Step `replica` with `optimizer`'s group options (an LR scheduler changed those)."""
    for mine, theirs in zip(optimizer.param_groups, replica.param_groups, strict=True):
        theirs.update({k: v for k, v in mine.items() if k != "params"})
    replica.step()
