"""Compression inside training, on 4 CPU processes as 2 virtual nodes x 2:
- qWD keeps every rank's weights bit-identical over many steps, the fp32 master shard is never
  touched by the weight path, and the replicas' error against the masters does not drift;
- the bytes put into each collective, counted through a patched `comm` module, equal the exact
  figures below, and `strategy.comm_stats` reports the same, also through the Trainer's logger;
- stochastic rounding is seeded per rank and step: a run is reproducible;
- `min_compress_numel` leaves small buckets uncompressed, and says so in the log.

Exact wire figures at the defaults (bf16-true, 4 ranks, 2 per node): a bucket of N padded
elements (N a multiple of 4 x 2048) has shards of S = N/4. Per step and rank:
- weight all-gather: S/2 code bytes + 4 S/2048 scale bytes = 4 + 32/2048 = 4.015625 bits/element;
- intra-node all-to-all: N bytes of int8 codes + 4 N/128 scale bytes = 8.25 bits/element;
- inter-node all-to-all: 2 S elements at 4 bits + 4 (2 S)/128 = 4.25 bits/element;
against 16 bits/element (bf16 all-gather) and 32 (fp32 reduce-scatter) uncompressed.
"""

import logging

import torch
from distributed import run_workers
from lightning_runs import make_trainer, sdp4bit
from models import TinyLMModule


def _qwd_replicas(rank, world, steps):
    from lightning.pytorch.callbacks import Callback

    class Watch(Callback):
        def __init__(self):
            self.digests, self.errors = [], []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            engine = trainer.strategy.engine
            engine.wait_weights()
            self.digests.append([b.weights.view(torch.int16).long().sum().item() for b in engine.buckets])
            self.errors.append(max((b.weight_shard.float() - b.master).abs().max().item() for b in engine.buckets))

    watch = Watch()
    module = TinyLMModule(lr=3e-3)
    trainer = make_trainer(world, sdp4bit(ranks_per_node=2), max_steps=steps, precision="bf16-true", callbacks=[watch])
    trainer.fit(module)
    return watch.digests, watch.errors


def test_qwd_keeps_replicas_identical_and_does_not_drift():
    results = run_workers(_qwd_replicas, 4, 16)
    digests = [r[0] for r in results]
    assert all(d == digests[0] for d in digests) and len(digests[0]) == 16
    for _, errors in results:
        # Implicit error feedback: each step's error is the quantization error of one
        # difference, which includes the previous error, so it stays bounded instead of growing.
        assert max(errors[8:]) <= 2 * max(errors[:8])
        assert max(errors) < 0.05


def _wire(rank, world, directory):
    from lightning.pytorch.loggers import CSVLogger

    import lightning_sdp4bit.comm as comm

    counted = {"all_gather": 0, "all_to_all": 0, "reduce_scatter": 0}
    for name in counted:
        original = getattr(comm, name)

        def counting(output, input, *args, _name=name, _original=original, **kwargs):
            counted[_name] += input.numel() * input.element_size()
            return _original(output, input, *args, **kwargs)

        setattr(comm, name, counting)

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("lightning_sdp4bit").addHandler(handler)
    logging.getLogger("lightning_sdp4bit").setLevel(logging.INFO)

    out = {}
    one_bucket = {"ranks_per_node": 2, "bucket_numel": 10**8}
    for name, config in (("default", one_bucket), ("small", {**one_bucket, "min_compress_numel": 10**8})):
        module = TinyLMModule()
        logger = CSVLogger(directory, name=name)
        trainer = make_trainer(
            world, sdp4bit(**config), max_steps=2, precision="bf16-true", logger=logger, log_every_n_steps=1
        )
        trainer.fit(module)  # setup's digest all-gather is counted too; subtract it below
        out[name] = {
            "counted": dict(counted),
            "stats": dict(trainer.strategy.comm_stats),
            "buckets": [b.layout.numel for b in trainer.strategy.engine.buckets],
            "log_dir": logger.log_dir,
        }
        for key in counted:
            counted[key] = 0
    out["messages"] = messages
    return out


def test_bytes_on_the_wire_are_the_papers_figures(tmp_path):
    results = run_workers(_wire, 4, str(tmp_path))
    world, local = 4, 2
    for result in results:
        default = result["default"]
        (numel,) = default["buckets"]  # TinyLM fits one bucket: all of its parameters, 1-D ones included
        shard = numel // world
        assert numel % (world * 2048) == 0
        nodes = world // local
        weight_bytes = shard // 2 + 4 * shard // 2048  # this rank's row, across nodes
        weight_intra_bytes = nodes * weight_bytes  # then its node's rows from the other nodes, inside it
        intra_bytes = numel + 4 * numel // 128
        inter_bytes = (numel // local) // 2 + 4 * (numel // local) // 128
        digest_bytes = 8  # the setup check: one int64 per rank
        steps = 2
        assert default["counted"] == {
            "all_gather": steps * (weight_bytes + weight_intra_bytes) + digest_bytes,
            "all_to_all": steps * (intra_bytes + inter_bytes),
            "reduce_scatter": 0,  # nothing falls back to the fp32 reduce-scatter
        }
        stats = default["stats"]
        assert (
            stats["weight_bytes"],
            stats["weight_intra_bytes"],
            stats["grad_intra_bytes"],
            stats["grad_inter_bytes"],
        ) == (weight_bytes, weight_intra_bytes, intra_bytes, inter_bytes)
        assert stats["weight_bits_per_element"] == stats["weight_intra_bits_per_element"] == 4 + 32 / 2048
        assert stats["grad_intra_bits_per_element"] == 8.25
        assert stats["grad_inter_bits_per_element"] == 4.25
        # The uncompressed path goes in two levels too: all-gather 2 * shard, then 2 * nodes * shard;
        # reduce-scatter 4 * numel inside the node, then 4 * nodes * shard across nodes.
        uncompressed = 2 * shard * (1 + nodes) + 4 * numel + 4 * nodes * shard
        assert stats["step_uncompressed_bytes"] == uncompressed
        wire = weight_bytes + weight_intra_bytes + intra_bytes + inter_bytes
        assert stats["compression_ratio"] == uncompressed / wire
        assert stats["total_bytes"] == steps * stats["step_bytes"]

        small = result["small"]
        assert small["counted"]["all_to_all"] == 0
        small_numel = small["buckets"][0]  # fp32, in two levels: the bucket, then its [nodes, S]
        assert small["counted"]["reduce_scatter"] == steps * 4 * (small_numel + small_numel // local)
        assert small["stats"]["compression_ratio"] == 1.0
    assert any("travels uncompressed" in m for m in results[0]["messages"])
    metrics = (tmp_path / "default" / "version_0" / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    assert {"comm/weight_bits_per_element", "comm/grad_inter_bits_per_element", "comm/bytes_on_wire"} <= set(header)
    column = header.index("comm/grad_intra_bits_per_element")
    assert [float(row.split(",")[column]) for row in metrics[1:] if row.split(",")[column]] == [8.25, 8.25]


def _run_twice(rank, world):
    runs = []
    for _ in range(2):
        module = TinyLMModule()
        make_trainer(world, sdp4bit(ranks_per_node=1), max_steps=3).fit(module)
        runs.append([p.detach().clone() for p in module.parameters()])
    return runs


def test_stochastic_rounding_is_reproducible():
    for first, second in run_workers(_run_twice, 2):
        assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_comm_stats_are_logged_on_the_steps_the_trainer_writes_logs_and_counted_on_every_step():
    """Each self.log costs the host about 0.2 ms: the callback logs only on the steps Lightning
    passes logged values to the loggers (`should_update_logs`), but counts every step's bytes."""
    from types import SimpleNamespace

    from lightning_sdp4bit.strategies.comm_logging import _PER_STEP, CommStatsLogger

    logged = []
    module = SimpleNamespace(log_dict=lambda values, **kwargs: logged.append(values))
    connector = SimpleNamespace(should_update_logs=False)
    trainer = SimpleNamespace(strategy=SimpleNamespace(comm_stats=None), _logger_connector=connector)
    callback = CommStatsLogger()
    for step in range(4):
        trainer.strategy.comm_stats = {
            **dict.fromkeys(_PER_STEP, 1.0),
            "step_bytes": 10.0,
            "step_uncompressed_bytes": 40.0,
        }
        connector.should_update_logs = step % 2 == 1
        callback.on_train_batch_end(trainer, module, None, None, step)
        callback.on_train_batch_end(trainer, module, None, None, step)  # no new optimizer step: nothing again
    assert [values["comm/bytes_on_wire"].item() for values in logged] == [20.0, 40.0]
    assert [values["comm/uncompressed_bytes"].item() for values in logged] == [80.0, 160.0]
    assert all(values["comm/step_bytes"].device.type == "cpu" for values in logged)  # no copy to the GPU
