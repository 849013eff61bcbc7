"""SDP4BitConfig: the public defaults, the presets, every validation error, and each loader
(dict, DictConfig, YAML file, dotlist overrides) including the YAML round trip."""

import pytest
from omegaconf import OmegaConf

from lightning_sdp4bit import PRESETS, SDP4BitConfig
from lightning_sdp4bit.config import GradQuant, Rounding, WeightQuant

CONTRACT_DEFAULTS = {
    "weight_quant": "diff",
    "weight_bits": 4,
    "weight_group_size": 2048,
    "grad_quant": "two_level",
    "grad_intra_bits": 8,
    "grad_inter_bits": 4,
    "grad_group_size": 128,
    "hadamard_size": 32,
    "rounding": "stochastic",
    "ranks_per_node": None,
}


def test_defaults_are_the_public_contract():
    values = SDP4BitConfig().to_dict()
    assert {k: values[k] for k in CONTRACT_DEFAULTS} == CONTRACT_DEFAULTS


def test_string_fields_become_enums():
    config = SDP4BitConfig(weight_quant="direct", grad_quant="none", rounding="nearest")
    assert config.weight_quant is WeightQuant.DIRECT
    assert config.grad_quant is GradQuant.NONE
    assert config.rounding is Rounding.NEAREST


@pytest.mark.parametrize(
    "name, weights, grads, intra, inter, hadamard",
    [
        ("baseline", "none", "none", 8, 4, 32),
        ("qw", "direct", "none", 8, 4, 32),
        ("qwd", "diff", "none", 8, 4, 32),
        ("ulq", "none", "two_level", 4, 4, 0),
        ("tlq", "none", "two_level", 8, 4, 0),
        ("tlq_hs", "none", "two_level", 8, 4, 32),
        ("sdp4bit", "diff", "two_level", 8, 4, 32),
    ],
)
def test_presets_are_the_papers_ablations(name, weights, grads, intra, inter, hadamard):
    config = SDP4BitConfig.preset(name)
    assert config.weight_quant.value == weights
    assert config.grad_quant.value == grads
    assert (config.grad_intra_bits, config.grad_inter_bits, config.hadamard_size) == (intra, inter, hadamard)


def test_sdp4bit_preset_equals_defaults_and_presets_take_overrides():
    assert SDP4BitConfig.preset("sdp4bit") == SDP4BitConfig()
    assert SDP4BitConfig.preset("qw", weight_bits=8).weight_bits == 8
    assert set(PRESETS) == {"baseline", "qw", "qwd", "ulq", "tlq", "tlq_hs", "sdp4bit"}


BAD_VALUES = [
    ("weight_quant", "int4", "'diff', 'direct', 'none'"),
    ("weight_bits", 3, "2, 4, 8"),
    ("weight_bits", True, "2, 4, 8"),
    ("weight_group_size", 100, "power of two"),
    ("weight_group_size", 0, "power of two"),
    ("grad_quant", "one_level", "'two_level', 'none'"),
    ("grad_intra_bits", 16, "2, 4, 8"),
    ("grad_inter_bits", 1, "2, 4, 8"),
    ("grad_group_size", -128, "power of two"),
    ("grad_group_size", 128.0, "power of two"),
    ("hadamard_size", 24, "divides grad_group_size"),
    ("hadamard_size", 256, "divides grad_group_size"),
    ("hadamard_size", "32", "integer"),
    ("rounding", "floor", "'stochastic', 'nearest'"),
    ("ranks_per_node", 0, "positive integer"),
    ("ranks_per_node", 2.5, "integer"),
    ("bucket_numel", 0, "positive integer"),
    ("min_compress_numel", -1, ">= 0"),
    ("seed", "abc", "integer"),
    ("log_comm_stats", "yes", "true or false"),
    ("broadcast_buffers", 1, "true or false"),
]


@pytest.mark.parametrize("field, value, allowed", BAD_VALUES)
def test_every_bad_value_names_the_field_and_what_is_allowed(field, value, allowed):
    with pytest.raises(ValueError) as error:
        SDP4BitConfig(**{field: value})
    assert field in str(error.value) and allowed in str(error.value)


@pytest.mark.parametrize("field, value, allowed", BAD_VALUES[:6])
def test_bad_values_are_caught_on_every_loader(field, value, allowed, tmp_path):
    with pytest.raises(ValueError, match=field):
        SDP4BitConfig.from_dict({field: value})
    with pytest.raises(ValueError, match=field):
        SDP4BitConfig.from_dict(OmegaConf.create({field: value}))


def test_unknown_keys_and_presets_are_errors():
    with pytest.raises(ValueError, match="unknown SDP4BitConfig field.*'grad_bits'.*allowed: preset"):
        SDP4BitConfig.from_dict({"grad_bits": 4})
    with pytest.raises(ValueError, match="preset must be one of .*'sdp4bit'.*got 'zero\\+\\+'"):
        SDP4BitConfig.preset("zero++")
    with pytest.raises(ValueError, match="unknown SDP4BitConfig field"):
        SDP4BitConfig().with_overrides(["weight_bitz=8"])


def test_dict_and_dictconfig_loaders_accept_a_preset_key():
    config = SDP4BitConfig.from_dict({"preset": "tlq", "grad_inter_bits": 8})
    assert config == SDP4BitConfig.preset("tlq", grad_inter_bits=8)
    assert SDP4BitConfig.from_dict(OmegaConf.create({"preset": "qw"})) == SDP4BitConfig.preset("qw")


def test_dotlist_overrides():
    config = SDP4BitConfig().with_overrides(["grad_inter_bits=8", "rounding=nearest", "ranks_per_node=2"])
    assert (config.grad_inter_bits, config.rounding, config.ranks_per_node) == (8, Rounding.NEAREST, 2)
    assert SDP4BitConfig().with_overrides(["preset=qwd", "weight_bits=2"]) == SDP4BitConfig.preset("qwd", weight_bits=2)
    assert SDP4BitConfig(ranks_per_node=2).with_overrides(["ranks_per_node=null"]).ranks_per_node is None
    for bare in ("ranks_per_node", "=4"):  # omegaconf would read the first as ranks_per_node=None: automatic
        with pytest.raises(ValueError, match=f"override '{bare}': expected key=value"):
            SDP4BitConfig(ranks_per_node=2).with_overrides([bare])


def test_yaml_round_trip_and_overrides(tmp_path):
    original = SDP4BitConfig.preset("tlq_hs", rounding="nearest", ranks_per_node=2, seed=7)
    path = tmp_path / "sdp4bit.yaml"
    text = original.to_yaml(path)
    assert "weight_quant: none" in text and path.read_text() == text
    assert SDP4BitConfig.from_yaml(path) == original
    assert SDP4BitConfig.from_yaml(path, ["grad_intra_bits=4"]) == SDP4BitConfig.preset(
        "tlq_hs", rounding="nearest", ranks_per_node=2, seed=7, grad_intra_bits=4
    )
    with pytest.raises(ValueError, match="override 'ranks_per_node': expected key=value"):
        SDP4BitConfig.from_yaml(path, ["ranks_per_node"])


def test_yaml_with_a_preset_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("preset: qw\nweight_bits: 8\n")
    assert SDP4BitConfig.from_yaml(path) == SDP4BitConfig.preset("qw", weight_bits=8)


def test_coerce_accepts_what_users_pass(tmp_path):
    path = tmp_path / "c.yaml"
    SDP4BitConfig.preset("ulq").to_yaml(path)
    assert SDP4BitConfig.coerce(None) == SDP4BitConfig()
    assert SDP4BitConfig.coerce(str(path)) == SDP4BitConfig.preset("ulq")
    assert SDP4BitConfig.coerce(path) == SDP4BitConfig.preset("ulq")
    assert SDP4BitConfig.coerce({"preset": "ulq"}) == SDP4BitConfig.preset("ulq")
    with pytest.raises(ValueError, match="config must be an SDP4BitConfig, a dict"):
        SDP4BitConfig.coerce(42)
    with pytest.raises(ValueError, match="config path .* is not a file"):
        SDP4BitConfig.coerce(str(tmp_path / "missing.yaml"))


def test_broken_yaml_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("preset: baseline\nbucket_numel: 4096\n  rounding: nearest\n")  # a ScannerError in yaml
    with pytest.raises(ValueError, match=r"c\.yaml:3:11: invalid YAML: mapping values are not allowed in this context"):
        SDP4BitConfig.from_yaml(path)
    path.write_text('preset: "baseline\n')  # an unclosed quote: the problem and where it started
    started = r"\(while scanning a quoted scalar that starts at line 1, column 9\)"
    with pytest.raises(ValueError, match=rf"c\.yaml:2:1: invalid YAML: .* {started}"):
        SDP4BitConfig.coerce(str(path))


def test_ranks_per_node_is_checked_against_the_world_size(monkeypatch):
    assert SDP4BitConfig(ranks_per_node=2).resolve_ranks_per_node(world_size=4) == 2
    with pytest.raises(ValueError, match="ranks_per_node=3 must divide the world size 4"):
        SDP4BitConfig(ranks_per_node=3).resolve_ranks_per_node(world_size=4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert SDP4BitConfig().resolve_ranks_per_node(world_size=8) == 4
    with pytest.raises(ValueError, match="taken from LOCAL_WORLD_SIZE.*must divide the world size 6"):
        SDP4BitConfig().resolve_ranks_per_node(world_size=6)
    assert SDP4BitConfig().resolve_ranks_per_node(world_size=6, local_world_size=3) == 3


def test_node_sharding_needs_two_ranks_per_node_before_anything_starts():
    config = SDP4BitConfig(weight_sharding="node", ranks_per_node=1)
    with pytest.raises(
        ValueError, match=r"weight_sharding='node' needs at least 2 ranks per node, got ranks_per_node=1"
    ):
        config.resolve_ranks_per_node(4)
    assert SDP4BitConfig(weight_sharding="node").resolve_ranks_per_node(8, 4) == 4


def test_node_gather_prefetch_is_a_count_that_only_the_node_mode_takes():
    assert SDP4BitConfig(weight_sharding="node").gathers_ahead == 2
    assert SDP4BitConfig(weight_sharding="node", node_gather_prefetch=0).gathers_ahead == 0
    with pytest.raises(ValueError, match=r"node_gather_prefetch must be None \(2\) or an integer >= 0, got -1"):
        SDP4BitConfig(weight_sharding="node", node_gather_prefetch=-1)
    with pytest.raises(ValueError, match=r"node_gather_prefetch must be an integer, got 1.5"):
        SDP4BitConfig(weight_sharding="node", node_gather_prefetch=1.5)
    with pytest.raises(
        ValueError, match=r"node_gather_prefetch=1 needs weight_sharding='node', got weight_sharding='replicated'"
    ):
        SDP4BitConfig.from_dict({"node_gather_prefetch": 1})
    assert SDP4BitConfig().with_overrides(["weight_sharding=node", "node_gather_prefetch=1"]).gathers_ahead == 1
