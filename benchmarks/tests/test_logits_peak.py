"""benchmarks/logits_peak.py, on the CPU, at width 128:
- each mode runs in a process of its own, and the node mode allocates more than the replicated
  one in the logits stretch (its gathered weights come on top of the same activations), by less
  than its whole model's weights;
- the table has a row per mode, with the node mode's excess at 6.7B; the head's backward comes
  out below the logits stretch."""


def test_the_node_mode_allocates_more_in_the_logits_stretch(benchmark_script, capsys):
    script = benchmark_script("logits_peak")
    script.main(["--width", "128", "--prefetch", "2"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [row[0] for row in rows] == ["| replicated", "| node"]
    replicated, node = (float(row[2]) for row in rows)
    assert all(float(row[3]) < float(row[2]) for row in rows)  # the head's backward, below the logits
    full_weights_mib = sum(p.numel() for p in script.node_gathers.FULL.build("meta").parameters()) * 2 / 2**20
    assert replicated < node < replicated + full_weights_mib / (4096 / 128) ** 2
    assert float(rows[1][-1].rstrip(" |")) > 0
