"""Logs the strategy's communication figures through the Trainer's loggers.

On each step the Trainer writes its logs (every `log_every_n_steps`, as Lightning's own
LearningRateMonitor and ThroughputMonitor log), it logs under "comm/": the bits per element of
the weight all-gather (of its two stages where there are several nodes of several ranks) and of
the two gradient stages, the compression ratio against the uncompressed path, the number of
steps skipped for non-finite gradients (`nonfinite="skip"`), and the bytes this rank put on the
wire since fit started, next to what the uncompressed path would have put (torchmetrics
SumMetrics, local to the rank, updated every optimizer step: every rank sends the same amount).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torchmetrics.aggregation import SumMetric

__all__ = ["CommStatsLogger"]

_PER_STEP = (
    "weight_bits_per_element",
    "weight_intra_bits_per_element",
    "grad_intra_bits_per_element",
    "grad_inter_bits_per_element",
    "grad_reduce_scatter_bits_per_element",
    "compression_ratio",
    "step_bytes",
    "nonfinite_steps",
)


class CommStatsLogger(Callback):
    """Added by SDP4BitStrategy when `log_comm_stats` is on."""

    def __init__(self) -> None:
        self._logged: dict | None = None  # the strategy's comm_stats dict last logged
        self.bytes_on_wire = SumMetric(sync_on_compute=False)
        self.uncompressed_bytes = SumMetric(sync_on_compute=False)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = getattr(trainer.strategy, "comm_stats", None)
        if not stats or stats is self._logged:
            return  # no optimizer step since the last log (e.g. gradient accumulation)
        self._logged = stats
        self.bytes_on_wire.update(float(stats["step_bytes"]))
        self.uncompressed_bytes.update(float(stats["step_uncompressed_bytes"]))
        if not trainer._logger_connector.should_update_logs:
            # Lightning passes logged values to the loggers on these steps only; each self.log costs
            # the host about 0.2 ms (2.3 ms a step for these ten on a 2-core CPU), and on a GPU the
            # host's time between optimizer step and forward is time the GPU may wait.
            return
        values = {f"comm/{key}": stats[key] for key in _PER_STEP}
        values["comm/bytes_on_wire"] = self.bytes_on_wire.compute()
        values["comm/uncompressed_bytes"] = self.uncompressed_bytes.compute()
        # CPU tensors: Lightning makes a Python number a tensor on the module's device, and each
        # such copy from host memory synchronises the stream (nine per step: 36 ms of host time
        # a step, and the GPU idle behind it, in a 1.3B GPT's trace; see
        # benchmarks/results/emulated_network_h200_*.md).
        cpu = {key: torch.tensor(float(value), dtype=torch.float64) for key, value in values.items()}
        pl_module.log_dict(cpu, on_step=True, on_epoch=False, rank_zero_only=True)
