"""DeepSeek-V4 topology: presets, cache roles per layer, Hugging Face config loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbridge.engines.topology import FLASH, PRO, ModelTopology, Role, from_hf_config, get_model
from kvbridge.errors import InputError

# The published DeepSeek-V4-Flash config.json fields kvbridge reads (spec section 5).
FLASH_CONFIG = {
    "model_type": "deepseek_v4",
    "num_hidden_layers": 43,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 64,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "index_head_dim": 128,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


def test_flash_preset_layer_counts():
    assert FLASH.num_layers == 43 and FLASH.num_mtp_layers == 1 and FLASH.total_layers == 44
    assert FLASH.layers_with_ratio(4) == list(range(2, 43, 2))  # 21 CSA layers
    assert FLASH.layers_with_ratio(128) == list(range(3, 42, 2))  # 20 HCA layers
    assert FLASH.layers_with_ratio(0) == [0, 1, 43]  # two SWA-only layers and the MTP layer
    assert FLASH.is_mtp(43) and not FLASH.is_mtp(42)


# The published DeepSeek-V4-Pro config.json fields kvbridge reads: no SWA-only layer.
PRO_CONFIG = {
    "model_type": "deepseek_v4",
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "index_head_dim": 128,
    "index_topk": 1024,
    "sliding_window": 128,
    "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0],
}


def test_pro_preset_shape():
    assert PRO.num_layers == 61 and PRO.num_attention_heads == 128
    assert len(PRO.compress_ratios) == 62 and PRO.compress_ratios[-1] == 0


@pytest.mark.parametrize(("preset", "config"), [(FLASH, FLASH_CONFIG), (PRO, PRO_CONFIG)])
def test_each_preset_equals_its_published_config(preset, config):
    loaded = from_hf_config(config, name=preset.name)
    assert loaded == preset
    ratios = config["compress_ratios"]
    main = ratios[: config["num_hidden_layers"]]
    for r in (0, 4, 128):
        assert preset.layers_with_ratio(r) == [i for i, x in enumerate(ratios) if x == r]
    # layer lists and counts, derived from the config: every layer also has an SWA cache
    counts = {r: sum(1 for x in main if x == r) for r in (0, 4, 128)}
    assert counts == ({0: 2, 4: 21, 128: 20} if preset is FLASH else {0: 0, 4: 30, 128: 31})
    if preset is PRO:
        assert preset.layers_with_ratio(4) == list(range(2, 61, 2))
        assert preset.layers_with_ratio(128) == [0, 1, *range(3, 60, 2)]
    swa = [c for c in preset.all_caches() if c.role == Role.SWA]
    assert len(swa) == preset.total_layers
    indexer = [c.layer for c in preset.all_caches() if c.role == Role.INDEXER]
    assert indexer == preset.layers_with_ratio(4)


def test_cache_roles_and_widths():
    assert [c.role for c in FLASH.caches(0)] == [Role.SWA]
    swa = FLASH.caches(0)[0]
    assert (swa.width, swa.window) == (512, 128)
    csa = {c.role: c for c in FLASH.caches(2)}
    assert set(csa) == {Role.SWA, Role.COMPRESS, Role.STATE, Role.INDEXER, Role.INDEXER_STATE}
    assert csa[Role.COMPRESS].window is None and csa[Role.INDEXER].width == 128
    # Ratio 4 compresses overlapping windows: [kv | score] rows are 2 * (2 * dim) fp32, ring of 8.
    assert (csa[Role.STATE].width, csa[Role.STATE].window) == (2048, 8)
    assert (csa[Role.INDEXER_STATE].width, csa[Role.INDEXER_STATE].window) == (512, 8)
    hca = {c.role: c for c in FLASH.caches(3)}
    assert set(hca) == {Role.SWA, Role.COMPRESS, Role.STATE}
    assert (hca[Role.STATE].width, hca[Role.STATE].window) == (1024, 128)
    assert len(FLASH.all_caches()) == 44 + 41 + 41 + 21 + 21
    assert len(FLASH.all_caches(include_mtp=False)) == 43 + 41 + 41 + 21 + 21


def test_from_hf_config_file_matches_preset(tmp_path):
    path = tmp_path / "DeepSeek-V4-Flash" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(FLASH_CONFIG))
    topo = from_hf_config(path)
    assert topo.name == "DeepSeek-V4-Flash"
    assert topo.compress_ratios == FLASH.compress_ratios
    assert (topo.num_layers, topo.num_mtp_layers, topo.num_attention_heads) == (43, 1, 64)
    assert get_model(str(path)).compress_ratios == FLASH.compress_ratios


def test_from_hf_config_without_mtp_ratios_and_window_size_key():
    cfg = dict(FLASH_CONFIG, compress_ratios=FLASH_CONFIG["compress_ratios"][:43])
    del cfg["sliding_window"]
    cfg["window_size"] = 64
    topo = from_hf_config(cfg, name="x")
    assert topo.compress_ratios[-1] == 0 and topo.sliding_window == 64


HF_CONFIGS = Path(__file__).parents[1] / "fixtures" / "hf_configs"


@pytest.mark.parametrize("preset", [FLASH, PRO], ids=lambda p: p.name)
def test_transformers5_saved_config_gives_the_preset(preset):
    """``DeepseekV4Config.save_pretrained`` (transformers 5.20.2) writes ``layer_types`` + ``compress_rates``
    for the main layers only and no ``compress_ratios``; the MTP layer is SWA-only."""
    path = HF_CONFIGS / f"{preset.name}.transformers-5.20.2.json"
    data = json.loads(path.read_text())
    assert "compress_ratios" not in data and len(data["layer_types"]) == preset.num_layers
    topo = from_hf_config(path, name=preset.name)
    assert topo == preset
    del data["qk_rope_head_dim"]  # its rope dims then come from partial_rotary_factor alone
    assert from_hf_config(data, name=preset.name) == preset
    with pytest.raises(InputError, match=r"layer_types holds \['linear_attention'\]"):
        from_hf_config({**data, "layer_types": ["linear_attention"] * preset.num_layers}, name="bad")
    del data["layer_types"]
    with pytest.raises(InputError, match="lacks 'compress_ratios' \\(or transformers 5's 'layer_types'\\)"):
        from_hf_config(data, name="bad")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"compress_ratios": [0, 0, 8] + [4] * 41}, r"compress_ratios holds \[8\]"),
        ({"compress_ratios": [0, 4]}, "compress_ratios has 2 entries"),
        ({"head_dim": 576}, "head_dim=576"),
        ({"num_hidden_layers": None}, "lacks 'num_hidden_layers'"),
    ],
)
def test_bad_configs_are_refused(change, message):
    cfg = {k: v for k, v in {**FLASH_CONFIG, **change}.items() if v is not None}
    with pytest.raises(InputError, match=message):
        from_hf_config(cfg, name="bad")


def test_bad_config_file_and_unknown_model(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        from_hf_config(bad)
    with pytest.raises(InputError, match="does not exist"):
        from_hf_config(tmp_path / "missing.json")
    with pytest.raises(InputError, match="unknown model 'deepseek-v5'"):
        get_model("deepseek-v5")


def test_with_layers_keeps_mtp_and_checks_range():
    small = FLASH.with_layers(6)
    assert small.compress_ratios == (0, 0, 4, 128, 4, 128, 0)
    assert isinstance(small, ModelTopology) and small.num_mtp_layers == 1
    with pytest.raises(InputError, match="num_layers must be in 1..43"):
        FLASH.with_layers(44)
    with pytest.raises(InputError, match="layer 44 outside"):
        FLASH.caches(44)
