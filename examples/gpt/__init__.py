"""The GPT example's parts, used by examples/train_gpt.py and benchmarks/accuracy_study.py.

- config.py: the YAML settings, command-line overrides and their checks;
- data.py: byte or .bin tokens and the training/validation windows;
- model.py: the GPT in plain PyTorch;
- module.py: the LightningModule (loss, metrics, AdamW groups, schedule);
- summary.py: the end-of-run summary (throughput, losses, bytes on the wire) and a sample.
"""
