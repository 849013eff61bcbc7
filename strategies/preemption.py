"""SIGTERM (a preemption by SLURM or Kubernetes) under the sdp4bit strategy: every rank stops
together at the next training batch, whichever rank got the signal and whatever it was doing.

Why not Lightning's own handling. Lightning 2.6's SIGTERM handler (`_SignalConnector.
_sigterm_notifier_fn`) forwards the signal to the launcher's children, sets `received_sigterm`,
and also calls `torch.distributed.broadcast` on the default group *from inside the handler*. A
signal handler runs wherever the main thread happens to be, so that broadcast is a collective
the other ranks never issue at that point:
- during a save, rank 0 blocks in it while rank 1 waits in the save's own agreement for rank 0:
  both hang until the process group's timeout (30 minutes by default), which is what preempted
  jobs saw;
- on a rank other than 0 it is a receive that pairs with whatever default-group collective rank
  0 issues next, or with nothing.
And the per-batch broadcast of the flag only carries rank 0's: a SIGTERM to rank 1 alone makes
rank 1 raise by itself at the end of its batch while rank 0 runs on into its next collective.

So the strategy puts its own notifier in place of Lightning's (before Lightning registers it):
the handler only logs, forwards the signal to the launcher's children (as Lightning does, so
that a SIGTERM to the popen launcher's rank 0 reaches every rank) and notes it. It issues no
collective, so a save or a step in progress completes on every rank. At the start of each
training batch the ranks agree (one all-reduce of a flag per batch, on a gloo group of its own:
host memory, no GPU synchronisation, nothing queued behind the exchanges in flight), in place of
the loop's own per-batch broadcast of rank 0's flag (`_broadcast_sigterm_tensor`); if any rank
was signalled, every rank sets `trainer.received_sigterm` and raises Lightning's
`SIGTERMException` at the same batch, so `on_exception` callbacks (OnExceptionCheckpoint) run
on every rank together and the processes exit (status 0, as Lightning's own SIGTERM exit).
Outside fit (validate, test, predict: no lock-step batches) the handler sets Lightning's flag
directly and Lightning's loops stop at their next batch. The same all-reduce carries each rank's
batches per epoch, so that ranks whose data end at different batches stop together with an error
that names them (`uneven_data`), instead of waiting for a rank that has finished.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from types import FrameType

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message

from lightning_sdp4bit import comm
from lightning_sdp4bit.strategies import uneven_data

__all__ = ["PreemptionSignal"]

# The logger of the handler this one replaces: "[rank: 1] Received SIGTERM: 15" reads and filters
# as it did (Lightning shows it at INFO level).
log = logging.getLogger("lightning.pytorch.trainer.connectors.signal_connector")


class PreemptionSignal:
    """Notes SIGTERM in its handler; `stop_if_signalled` makes every rank stop at the same batch.

    Collective at construction (it creates its gloo group): every rank builds it, in setup."""

    def __init__(self, trainer: pl.Trainer, timeout: timedelta | None = None):
        self.trainer = trainer
        self.signalled = False
        self._forwarded = False
        self._group = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        # A rank stalled in its data loader is noticed here first, at the next batch's agreement.
        self._timeouts = comm.Timeouts(trainer.global_rank, timeout)
        # Lightning registers `_sigterm_notifier_fn` as the SIGTERM handler after the strategy's
        # setup (Trainer._run); an instance attribute takes the place of its method.
        trainer._signal_connector._sigterm_notifier_fn = self._on_sigterm  # type: ignore[method-assign,assignment]
        # The training loop's per-batch check: this agreement in place of Lightning's broadcast of
        # rank 0's flag (a GPU tensor read back on the host every batch), not beside it, so a step
        # still costs one such collective, now on host memory.
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = self.stop_if_signalled  # type: ignore[method-assign]

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: no collective, no I/O but a log line (it may run in the middle of
        a save or a collective)."""
        trainer = self.trainer
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", trainer.local_rank))
        if not self._forwarded:
            self._forwarded = True
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # the popen launcher's rank 0 forwards it to the other ranks
        self.signalled = True
        if trainer.state.fn != TrainerFn.FITTING:
            trainer._signal_connector.received_sigterm = True

    def stop_if_signalled(self) -> None:
        """At the start of a training batch: if any rank got SIGTERM, raise SIGTERMException on
        every rank; if the ranks' data end at different batches, UnevenDataError at the shortest
        rank's last one. Collective (every rank calls it at every batch)."""
        signalled, reduced = self.signalled, None
        if self._group is not None:
            # [SIGTERM flag, batches per epoch, minus batches per epoch], maxima over the ranks.
            values = torch.tensor([int(signalled), *uneven_data.agreement_values(self.trainer)], dtype=torch.int64)
            with self._timeouts.named("the per-batch SIGTERM agreement's all-reduce"):
                dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._group)
            signalled, reduced = bool(values[0]), values[1:].tolist()
        if signalled:
            log.info(rank_prefixed_message("sdp4bit: stopping at this batch (SIGTERM)", self.trainer.local_rank))
            self.trainer._signal_connector.received_sigterm = True
            raise SIGTERMException()
        if reduced is not None:
            assert self._group is not None  # reduced is only read from the group's all-reduce
            uneven_data.stop_if_uneven(self.trainer, reduced, self._group, self._timeouts)

    def close(self) -> None:
        """After fit: Lightning's own handler and per-batch check again; drop the group."""
        self.trainer._signal_connector.__dict__.pop("_sigterm_notifier_fn", None)
        self.trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
