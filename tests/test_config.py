"""ModelArgs: presets, HF config mapping, validation errors naming the field, the layer schedule (spec §1, §4)."""
import json
from pathlib import Path

import pytest

from dsv4lab.core.config import ConfigError, ModelArgs, get_preset

REAL = Path(__file__).resolve().parent / "data" / "dsv4_flash" / "config.json"  # the model's own, verbatim


def test_flash_schedule_matches_spec_section_4():
    a = get_preset("flash")
    kinds = [a.layer_kind(i) for i in range(a.n_layers)]
    assert kinds[:2] == ["swa", "swa"] and kinds[42] == "csa"  # layer 42 is CSA (spec §3.11 item 7)
    assert kinds.count("csa") == 21 and kinds.count("hca") == 20
    assert a.layer_kind(43) == "swa" and not a.is_hash_layer(43)
    assert [a.is_hash_layer(i) for i in range(4)] == [True, True, True, False]
    assert a.rope_params(0) == (10000.0, False) and a.rope_params(3) == (160000.0, True)
    assert a.nope_head_dim == 448 and a.mix_hc == 24 and a.hc_dim == 16384
    assert abs(a.softmax_scale - 0.0441942) < 1e-7 and abs(a.index_scale - 0.0110485) < 1e-7
    assert a.wo_a_in_per_group == 4096


def test_real_config_json_gives_the_flash_preset():
    a = ModelArgs.from_json(REAL)
    assert a == get_preset("flash")


def test_hf_round_trip_tiny():
    a = get_preset("tiny")
    assert ModelArgs.from_hf_config(a.to_hf_config()) == a.replace(max_seq_len=ModelArgs().max_seq_len)


def test_missing_and_inconsistent_keys_name_the_field(tmp_path):
    cfg = get_preset("tiny").to_hf_config()
    del cfg["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelArgs.from_hf_config(cfg)
    cfg = get_preset("tiny").to_hf_config()
    cfg["compress_ratios"] = cfg["compress_ratios"][:-1]
    with pytest.raises(ConfigError, match="compress_ratios"):
        ModelArgs.from_hf_config(cfg)
    cfg = get_preset("tiny").to_hf_config()
    cfg["num_experts_per_tok"] = 99
    with pytest.raises(ConfigError, match="n_activated_experts"):
        ModelArgs.from_hf_config(cfg)
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelArgs.from_json(p)
    with pytest.raises(ConfigError, match="unknown preset"):
        get_preset("nope")


def test_tiny_crosses_every_boundary_in_300_tokens():
    a = get_preset("tiny")
    kinds = {a.layer_kind(i) for i in range(a.n_layers)}
    assert kinds == {"swa", "csa", "hca"}
    ratios = sorted({r for r in a.compress_ratios if r})
    assert ratios == [4, 16] and a.window_size < 300
    assert a.index_topk < 300 // 4  # top-k smaller than the number of compressed CSA entries
    assert a.n_hash_layers >= 1 and a.n_hash_layers < a.n_layers and a.hc_mult == 4 and a.n_mtp_layers == 1
    assert a.n_routed_experts >= 8 and a.n_activated_experts >= 2 and a.n_shared_experts == 1
    json.dumps(a.to_hf_config())
