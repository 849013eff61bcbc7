"""The GPT example's settings (examples/configs/gpt.yaml, examples/gpt/config.py).

Checks:
- the shipped YAML file loads, and its sdp4bit block (nulls = "as the preset has it") gives the
  paper's defaults;
- command-line overrides reach every section, including sdp4bit fields and presets, and a preset
  combines with a field override;
- every kind of mistake raises a ConfigError whose message starts with the offending key: unknown
  keys and sections, bad types, a key missing from a user's YAML file, a malformed override,
  out-of-range values, n_embd not divisible by n_head, bad sdp4bit fields or values, a node size
  that does not divide the number of processes, a YAML file that does not parse.
"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from gpt.config import ConfigError, check_world, load_config, sdp4bit_config, to_yaml  # noqa: E402

from lightning_sdp4bit import SDP4BitConfig  # noqa: E402


def test_default_yaml_loads_with_paper_defaults():
    s = load_config()
    assert s.model.vocab_size is None and s.data.path is None
    assert s.model.n_embd % s.model.n_head == 0
    assert sdp4bit_config(s) == SDP4BitConfig()  # preset sdp4bit = the defaults
    assert "max_steps" in to_yaml(s)


def test_overrides_reach_every_section(tmp_path):
    s = load_config(
        [
            f"data.path={tmp_path / 'my.txt'}",
            "trainer.max_steps=200",
            "trainer.devices=4",
            "trainer.accelerator=cpu",
            "model.n_layer=6",
            "optim.lr=3e-4",
            "sdp4bit.weight_bits=8",
            "sdp4bit.ranks_per_node=2",
        ]
    )
    assert s.data.path == str(tmp_path / "my.txt")
    assert (s.trainer.max_steps, s.trainer.devices, s.trainer.accelerator) == (200, 4, "cpu")
    assert s.model.n_layer == 6 and s.optim.lr == pytest.approx(3e-4)
    assert sdp4bit_config(s) == SDP4BitConfig(weight_bits=8, ranks_per_node=2)


def test_preset_override_and_a_field_on_top():
    assert sdp4bit_config(load_config(["sdp4bit.preset=qw"])) == SDP4BitConfig.preset("qw")
    combined = sdp4bit_config(load_config(["sdp4bit.preset=qw", "sdp4bit.weight_bits=8"]))
    assert combined == SDP4BitConfig.preset("qw", weight_bits=8)
    assert combined.weight_quant.value == "direct" and combined.grad_quant.value == "none"


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.n_lyer=2", r"^model\.n_lyer: unknown key; model\.\* takes n_layer, n_head"),
        ("optimizer.lr=1", r"^optimizer: unknown key; the sections are model, data, optim"),
        ("trainer.max_steps=ten", r"^trainer\.max_steps: .*could not be converted"),
        ("trainer.max_steps", r"^trainer\.max_steps: expected key=value"),
        ("model.n_head=3", r"^model\.n_embd: 128 must be divisible by model\.n_head \(3\)"),
        ("data.val_fraction=1.5", r"^data\.val_fraction: must be between 0 and 1"),
        ("optim.min_lr=1", r"^optim\.min_lr: must be in \[0, optim\.lr"),
        ("trainer.devices=0", r"^trainer\.devices: must be a positive number"),
        ("trainer.precision=fp8", r"^trainer\.precision: must be one of"),
        ("sdp4bit.weight_bit=8", r"^sdp4bit\.weight_bit: unknown key; sdp4bit\.\* takes preset, weight_quant"),
        ("sdp4bit.weight_bits=3", r"^sdp4bit\.weight_bits: must be one of 2, 4, 8, got 3"),
        ("sdp4bit.preset=fast", r"^sdp4bit\.preset: must be one of 'baseline'"),
        ("sdp4bit.rounding=up", r"^sdp4bit\.rounding: must be one of 'stochastic', 'nearest'"),
    ],
)
def test_mistakes_name_their_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config([override])


def test_missing_key_in_a_user_yaml(tmp_path):
    text = (ROOT / "examples" / "configs" / "gpt.yaml").read_text().replace("  n_layer: 4\n", "")
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"^model\.n_layer: missing"):
        load_config([], path)
    assert load_config(["model.n_layer=2"], path).model.n_layer == 2
    with pytest.raises(ConfigError, match=r"^--config: .*is not a file"):
        load_config([], tmp_path / "nope.yaml")


def test_node_size_must_divide_the_processes():
    check_world(load_config(["sdp4bit.ranks_per_node=2"]), world_size=4)
    with pytest.raises(ConfigError, match=r"^sdp4bit\.ranks_per_node: .*must divide the world size 4"):
        check_world(load_config(["sdp4bit.ranks_per_node=3"]), world_size=4)


def test_a_simulated_job_runs_on_one_device_in_the_shape_it_names():
    check_world(load_config(["sdp4bit.simulate=2x4", "sdp4bit.ranks_per_node=4"]), world_size=1)
    with pytest.raises(ConfigError, match=r"^trainer\.devices: is 2, but a simulated job .* on one device"):
        check_world(load_config(["sdp4bit.simulate=2x4"]), world_size=2)
    with pytest.raises(ConfigError, match=r"^sdp4bit\.ranks_per_node: ranks_per_node=2 contradicts simulate=2x4"):
        check_world(load_config(["sdp4bit.simulate=2x4", "sdp4bit.ranks_per_node=2"]), world_size=1)
    # YAML reads 0x4 as the number 4: named as what it is, not as simulate='4'.
    with pytest.raises(ConfigError, match=r"^sdp4bit\.simulate: expected 'MxL' .* got the number 4 \(YAML reads"):
        check_world(load_config(["sdp4bit.simulate=0x4"]), world_size=1)


def test_invalid_yaml_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  n_layer: [1, 2\n")
    with pytest.raises(ConfigError, match=r"^--config: .*broken\.yaml:3:1: invalid YAML: did not find expected"):
        load_config([], path)
