r"""Train a small GPT with SDP4Bit: sharded data parallelism that communicates in about 4 bits.

    python examples/train_gpt.py                         # embedded corpus; all GPUs, or 2 CPU processes
    python examples/train_gpt.py data.path=my.txt trainer.max_steps=200 trainer.devices=2 \
        trainer.accelerator=cpu sdp4bit.weight_bits=8    # your text, 8-bit weight differences
    python examples/train_gpt.py sdp4bit.preset=qw       # an ablation: baseline qw qwd ulq tlq tlq_hs sdp4bit
    python examples/train_gpt.py sdp4bit.ranks_per_node=1   # 2 processes as 2 virtual nodes (int4 stage)
    python examples/train_gpt.py sdp4bit.simulate=16x4   # as a job of 16 nodes x 4 ranks would, on one device
    python examples/train_gpt.py --config my.yaml model.n_layer=6
    python examples/train_gpt.py --help                  # this text and every setting

Every setting lives in examples/configs/gpt.yaml; `key=value` arguments override it. The model
is a byte-level GPT (examples/gpt/): the default corpus is the documentation text that ships with
CPython, data.path takes a text file, a directory of text files or a uint16 .bin of token ids.
Logs go to trainer.out_dir/version_N (metrics.csv, TensorBoard when installed, summary.json), and
the run ends with a summary: tokens/s, final losses, bytes on the wire saved by compression.
"""

import importlib.util
import sys
from pathlib import Path

import lightning as L
import torch
from gpt.config import (
    DEFAULT_CONFIG,
    ConfigError,
    Settings,
    check_world,
    load_config,
    sdp4bit_config,
    simulated_world,
)
from gpt.data import TokenDataModule, load_tokens, vocab_size_of
from gpt.module import GPTModule
from gpt.summary import RunSummary
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

import lightning_sdp4bit  # noqa: F401  (registers the "sdp4bit" strategy name)
from lightning_sdp4bit import SDP4BitSimulationStrategy, SDP4BitStrategy


def parse_args(argv: list[str]) -> tuple[Path, list[str]]:
    """`[--config FILE] [key=value ...]` -> (config file, overrides)."""
    config, overrides = DEFAULT_CONFIG, []
    args = iter(argv)
    for arg in args:
        if arg in ("-h", "--help"):
            print(__doc__ + "\nSettings (" + str(DEFAULT_CONFIG) + "):\n\n" + DEFAULT_CONFIG.read_text())
            sys.exit(0)
        elif arg == "--config":
            config = Path(next(args, ""))
        elif arg.startswith("--config="):
            config = Path(arg.split("=", 1)[1])
        elif arg.startswith("-"):
            raise ConfigError(arg, "unknown option; use --config FILE and key=value overrides")
        else:
            overrides.append(arg)
    return config, overrides


def hardware(s: Settings) -> tuple[str, int, str]:
    """(accelerator, processes, precision), with "auto" resolved for this machine."""
    t, cuda = s.trainer, torch.cuda.is_available()
    accelerator = t.accelerator if t.accelerator != "auto" else "gpu" if cuda else "cpu"
    on_gpu = accelerator in ("gpu", "cuda")
    if on_gpu and not cuda:
        raise ConfigError("trainer.accelerator", f"is {t.accelerator!r}, but this machine has no CUDA device")
    devices = t.devices if t.devices != "auto" else torch.cuda.device_count() if on_gpu else 2
    if on_gpu and devices > torch.cuda.device_count():
        raise ConfigError("trainer.devices", f"{devices} GPUs asked, {torch.cuda.device_count()} available")
    precision = t.precision if t.precision != "auto" else "bf16-true" if on_gpu else "32-true"
    return accelerator, devices, precision


def main(argv: list[str]) -> None:
    # 1. Settings and data, checked in full before any process is started.
    config_path, overrides = parse_args(argv)
    s = load_config(overrides, config_path)
    accelerator, devices, precision = hardware(s)
    simulated = simulated_world(s)
    if simulated is not None and s.trainer.devices == "auto":
        devices = 1  # one device runs every simulated rank
    check_world(s, devices)
    tokens = load_tokens(s.data.path)
    vocab_size = vocab_size_of(tokens, s.model.vocab_size)
    data = TokenDataModule(tokens, s.model.block_size, s.data.batch_size, s.data.val_fraction)
    ranks = devices if simulated is None else simulated[0] * simulated[1]
    if len(data.train_set) < ranks * s.data.batch_size:
        raise ConfigError(
            "data.batch_size",
            f"{s.data.batch_size} sequences x {ranks} ranks is more than the "
            f"{len(data.train_set)} training windows of the corpus",
        )

    # 2. The model and the strategy. Everything from here on runs in every process.
    L.seed_everything(s.trainer.seed, workers=True, verbose=False)
    model_settings = {**vars(s.model), "vocab_size": vocab_size}
    module = GPTModule(model=model_settings, optim=vars(s.optim))
    if simulated is None:
        strategy = SDP4BitStrategy(config=sdp4bit_config(s), start_method=s.trainer.start_method)
    else:
        strategy = SDP4BitSimulationStrategy(simulated, config=sdp4bit_config(s))
    csv = CSVLogger(s.trainer.out_dir, name="")
    loggers = [csv]
    if importlib.util.find_spec("tensorboard") is not None:
        loggers.append(TensorBoardLogger(s.trainer.out_dir, name="", version=csv.version, sub_dir="tensorboard"))
    accumulate = s.trainer.accumulate_grad_batches
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_steps=s.trainer.max_steps,
        val_check_interval=s.trainer.val_every * accumulate,  # counted in batches, not steps
        check_val_every_n_epoch=None,  # so validation follows steps across epochs
        limit_val_batches=s.data.val_batches,
        num_sanity_val_steps=0,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=s.optim.grad_clip or None,  # clips the global norm over all shards
        log_every_n_steps=s.trainer.log_every,
        logger=loggers,
        callbacks=[
            LearningRateMonitor(logging_interval="step"),
            RunSummary(s.trainer.sample_bytes, byte_tokens=tokens.dtype == "uint8"),
        ],
        enable_checkpointing=False,
        enable_progress_bar=s.trainer.progress_bar,
        enable_model_summary=True,
    )
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as err:
        sys.exit(f"error: {err}")
