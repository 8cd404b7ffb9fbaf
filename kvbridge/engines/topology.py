"""DeepSeek-V4 cache topology as data: which caches each layer holds.

Every layer has an SWA cache (one 512-wide token vector per token, last ``sliding_window``
tokens). A layer of compress ratio ``r`` in {4, 128} adds a COMPRESS cache (one 512-wide
compressed token per ``r`` tokens, all of them) and the running state of its compressor
(``[kv | score]`` rows, one per token of the unfinished window; each engine stores and
addresses them its own way, see ``kvbridge.engines.profiles``). Ratio-4 layers (CSA) also hold
INDEXER_COMPRESS keys (``index_head_dim`` values per compressed token) and their own
indexer-compressor state. Ratio 4 compresses overlapping windows (2r tokens), so its
compressor rows are ``2 * dim`` wide and its window is 2r = 8 positions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

from kvbridge.errors import InputError

COMPRESS_RATIOS = (0, 4, 128)
#: Longest request a migration plan accepts (16x DeepSeek-V4's 1M-token context; block tables stay in memory).
MAX_TOKENS = 2**24


class Role(str, Enum):
    """A cache role (TensorRT-LLM's names; SGLang and vLLM hold the same data)."""

    SWA = "swa"
    COMPRESS = "compress"
    INDEXER = "indexer_compress"
    STATE = "compressor_state"
    INDEXER_STATE = "indexer_compressor_state"



@dataclass(frozen=True)
class CacheSpec:
    """One cache of one layer.

    ``width`` is values per entry: 512 for KV roles, ``index_head_dim`` for indexer keys,
    values per ``[kv | score]`` row for state roles. ``window`` is the number of most
    recent tokens a windowed role keeps (SWA: sliding window; state: the compressor window),
    None when every entry is kept.
    """

    layer: int
    role: Role
    ratio: int
    width: int
    window: int | None


@dataclass(frozen=True)
class ModelTopology:
    """A DeepSeek-V4 model's cache-relevant config.

    ``compress_ratios`` has one entry per layer, main layers first then the MTP layers
    (HF ``config.json`` convention: length ``num_hidden_layers + num_nextn_predict_layers``).
    """

    name: str
    num_layers: int
    num_mtp_layers: int
    compress_ratios: tuple[int, ...]
    num_attention_heads: int
    sliding_window: int = 128
    head_dim: int = 512
    rope_head_dim: int = 64
    index_head_dim: int = 128

    def __post_init__(self) -> None:
        total = self.num_layers + self.num_mtp_layers
        if len(self.compress_ratios) != total:
            raise InputError(
                f"compress_ratios has {len(self.compress_ratios)} entries; {self.name} needs "
                f"num_layers + num_mtp_layers = {total}"
            )
        bad = sorted({r for r in self.compress_ratios if r not in COMPRESS_RATIOS})
        if bad:
            raise InputError(f"compress_ratios holds {bad}; DeepSeek-V4 layers use ratios {COMPRESS_RATIOS}")
        if self.head_dim != 512 or self.rope_head_dim != 64:
            raise InputError(
                f"head_dim={self.head_dim}, rope_head_dim={self.rope_head_dim}: kvbridge layouts store "
                "512-wide tokens (448 nope + 64 rope)"
            )
        for key in ("sliding_window", "index_head_dim", "num_attention_heads"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise InputError(f"{key} must be a positive integer, got {value!r}")

    @property
    def total_layers(self) -> int:
        return self.num_layers + self.num_mtp_layers

    def is_mtp(self, layer: int) -> bool:
        return layer >= self.num_layers

    def layers_with_ratio(self, ratio: int) -> list[int]:
        return [i for i, r in enumerate(self.compress_ratios) if r == ratio]

    @staticmethod
    def state_ring(ratio: int) -> int:
        """Compressor window for ratio ``r`` in positions: 2r with overlap (r = 4), else r."""
        return 2 * ratio if ratio == 4 else ratio

    def caches(self, layer: int) -> tuple[CacheSpec, ...]:
        """The caches of ``layer`` (0-based; MTP layers follow the main layers)."""
        if not 0 <= layer < self.total_layers:
            raise InputError(f"layer {layer} outside 0..{self.total_layers - 1} of {self.name}")
        r = self.compress_ratios[layer]
        specs = [CacheSpec(layer, Role.SWA, 0, self.head_dim, self.sliding_window)]
        if r == 0:
            return tuple(specs)
        coff = 2 if r == 4 else 1  # overlapping windows double the compressor's row
        ring = self.state_ring(r)
        specs.append(CacheSpec(layer, Role.COMPRESS, r, self.head_dim, None))
        specs.append(CacheSpec(layer, Role.STATE, r, 2 * coff * self.head_dim, ring))
        if r == 4:
            specs.append(CacheSpec(layer, Role.INDEXER, r, self.index_head_dim, None))
            specs.append(CacheSpec(layer, Role.INDEXER_STATE, r, 2 * coff * self.index_head_dim, ring))
        return tuple(specs)

    def all_caches(self, include_mtp: bool = True) -> list[CacheSpec]:
        last = self.total_layers if include_mtp else self.num_layers
        return [spec for layer in range(last) for spec in self.caches(layer)]

    def with_layers(self, num_layers: int) -> ModelTopology:
        """The same model cut to its first ``num_layers`` main layers (keeps the MTP layers)."""
        if not 1 <= num_layers <= self.num_layers:
            raise InputError(f"num_layers must be in 1..{self.num_layers}, got {num_layers}")
        ratios = self.compress_ratios[:num_layers] + self.compress_ratios[self.num_layers :]
        return replace(self, name=f"{self.name}[:{num_layers}]", num_layers=num_layers, compress_ratios=ratios)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_layers": self.num_layers,
            "num_mtp_layers": self.num_mtp_layers,
            "compress_ratios": list(self.compress_ratios),
            "num_attention_heads": self.num_attention_heads,
            "sliding_window": self.sliding_window,
            "head_dim": self.head_dim,
            "rope_head_dim": self.rope_head_dim,
            "index_head_dim": self.index_head_dim,
        }


def _alternating(num_layers: int) -> tuple[int, ...]:
    """Two SWA-only layers, then 4, 128, 4, ..., ending on whatever the count gives."""
    return (0, 0) + tuple(4 if i % 2 == 0 else 128 for i in range(num_layers - 2))


# DeepSeek-V4-Flash: HF config.json (num_hidden_layers 43, num_nextn_predict_layers 1,
# num_attention_heads 64, head_dim 512, qk_rope_head_dim 64, index_head_dim 128,
# sliding_window 128, compress_ratios [0, 0, 4, 128, ..., 4, 0]); spec section 5.
FLASH = ModelTopology("deepseek-v4-flash", 43, 1, _alternating(43) + (0,), num_attention_heads=64)
# DeepSeek-V4-Pro: HF config.json (num_hidden_layers 61, num_nextn_predict_layers 1,
# num_attention_heads 128, index_topk 1024, compress_ratios [128, 128, 4, 128, 4, ..., 128, 4, 0]):
# no SWA-only layer; ratio 4 on layers 2, 4, ..., 60 (30), ratio 128 on 0, 1, 3, ..., 59 (31).
PRO = ModelTopology("deepseek-v4-pro", 61, 1, (128, 128) + _alternating(61)[2:] + (0,), num_attention_heads=128)

PRESETS: dict[str, ModelTopology] = {FLASH.name: FLASH, PRO.name: PRO}


#: transformers 5's ``DeepseekV4Config`` layer types and its default ``compress_rates``.
HF_LAYER_TYPES = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def _hf_ratios(data: dict[str, Any]) -> list[int]:
    """Main layers' ratios of a transformers 5 config: ``layer_types`` through ``compress_rates``."""
    if "layer_types" not in data:
        raise InputError("config.json lacks 'compress_ratios' (or transformers 5's 'layer_types'); it is not a "
                         "DeepSeek-V4 config")
    layer_types = data["layer_types"]
    rates = {**HF_LAYER_TYPES, **(data.get("compress_rates") or {}), "sliding_attention": 0}
    unknown = sorted({t for t in layer_types if t not in rates})
    if unknown:
        raise InputError(f"config.json layer_types holds {unknown}; DeepSeek-V4 layers are {sorted(HF_LAYER_TYPES)}")
    return [int(rates[t]) for t in layer_types]


def from_hf_config(config: dict[str, Any] | str | Path, name: str | None = None) -> ModelTopology:
    """Build a topology from a Hugging Face ``config.json`` (a path or its parsed dict).

    Reads ``num_hidden_layers``, ``num_nextn_predict_layers`` (default 0), ``compress_ratios``,
    ``sliding_window`` (or ``window_size``), ``num_attention_heads``, ``head_dim``,
    ``qk_rope_head_dim`` and ``index_head_dim``. ``compress_ratios`` may omit the MTP entries
    (they are SWA-only and default to 0).

    A config saved by transformers 5 (``DeepseekV4Config.save_pretrained``) has no ``compress_ratios``:
    each main layer's ratio is ``compress_rates[layer_types[i]]`` (a sliding-window layer 0) and the MTP
    layers, which ``layer_types`` drops, are SWA-only (the rule of vLLM's ``get_compress_ratios``); the rope
    dims are ``head_dim * partial_rotary_factor`` when ``qk_rope_head_dim`` is absent.
    """
    if isinstance(config, (str, Path)):
        path = Path(config)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise InputError(f"config file {path} does not exist") from None
        except json.JSONDecodeError as exc:
            raise InputError(f"config file {path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
        name = name or path.parent.name or path.stem
    else:
        data = config
    if not isinstance(data, dict):
        raise InputError(f"config must be a JSON object, got {type(data).__name__}")

    def need(key: str, *alternatives: str) -> Any:
        for k in (key, *alternatives):
            if k in data:
                return data[k]
        raise InputError(f"config.json lacks {key!r}; it is not a DeepSeek-V4 config")

    num_layers = int(need("num_hidden_layers"))
    num_mtp = int(data.get("num_nextn_predict_layers", 0))
    ratios = _hf_ratios(data) if "compress_ratios" not in data else [int(r) for r in data["compress_ratios"]]
    if len(ratios) == num_layers:
        ratios += [0] * num_mtp
    head_dim = int(data.get("head_dim", 512))
    if "qk_rope_head_dim" in data or data.get("partial_rotary_factor") is None:
        rope_head_dim = int(data.get("qk_rope_head_dim", 64))
    else:
        rope_head_dim = round(head_dim * float(data["partial_rotary_factor"]))
    return ModelTopology(
        name=name or str(data.get("model_type", "deepseek_v4")),
        num_layers=num_layers,
        num_mtp_layers=num_mtp,
        compress_ratios=tuple(ratios),
        num_attention_heads=int(need("num_attention_heads")),
        sliding_window=int(need("sliding_window", "window_size")),
        head_dim=head_dim,
        rope_head_dim=rope_head_dim,
        index_head_dim=int(data.get("index_head_dim", 128)),
    )


def get_model(name: str | ModelTopology) -> ModelTopology:
    """A preset by name, or a ``config.json`` path; a ``ModelTopology`` is returned as is."""
    if isinstance(name, ModelTopology):
        return name
    if name in PRESETS:
        return PRESETS[name]
    if name.endswith(".json") or Path(name).is_file():
        return from_hf_config(name)
    raise InputError(f"unknown model {name!r}; presets: {', '.join(PRESETS)} (or a config.json path)")
