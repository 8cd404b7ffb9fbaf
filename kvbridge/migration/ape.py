"""A model's compressor positional bias (APE) and the two state-row rules that use it.

Each compressed layer of ratio ``r`` has an attention compressor and (ratio 4) an indexer
compressor, each with an APE parameter of shape ``[r, coff * dim]`` (coff = 2 for ratio 4,
else 1; dim = 512 attention, ``index_head_dim`` indexer). The engines keep it in fp32 (a bf16
checkpoint tensor is upcast, which is exact). A compressor-state row of position ``p`` is
``[kv | score]``, each half ``coff * dim`` values. SGLang stores the raw score; vLLM and
TensorRT-LLM store ``fp32(score + ape[p % r])`` (one IEEE fp32 add, then the state dtype).

- ``add_ape``: SGLang rows -> vLLM / TensorRT-LLM rows (exact: the destination's own add).
- ``remove_ape``: the reverse. The stored score ``t`` is a rounded sum, so several fp32 raw
  scores can give the same ``t`` (its preimage). kvbridge writes a preimage element ``s'``, so
  ``fp32(s' + a) == t``: the score SGLang's compression adds back is the one the source engine
  stored, bit for bit. ``s'`` is a bf16 value where the preimage holds one (vLLM's raw scores
  are bf16, the output of its GEMM; the only bf16 value of the preimage is that raw score), else
  ``fp32(t - a)`` moved to the nearest preimage element. Where the preimage holds several
  candidates, ``s'`` may differ from the raw score the source computed. A ``t`` that no fp32
  sum reaches (not written by an APE add with these weights) is refused. Sums compare bit for bit:
  a stored -0.0 comes back as -0.0 (the only fp32 ``s'`` with ``fp32(s' + a) == -0.0``, which
  needs ``a == -0.0``; any other APE value refuses it, since IEEE addition gives +0.0 there).

Only the checkpoint's APE tensors are valid input. SGLang rearranges the ratio-4 APE in memory
when it loads it (``srt/layers/attention/dsv4/compressor.py`` ``Compressor._apply_ape_hotfix``,
not on NPU): the ``[4, 2 * dim]`` tensor's two column halves ``A0 | A1`` become the rows of
``cat(A0, A1)`` ``[8, dim]``, read back as ``[4, 2 * dim]`` (row i = blocks 2i, 2i + 1), a
permutation of the same values under the same name and shape. It cannot be told from the
checkpoint's tensor by shape, dtype or content, so kvbridge cannot refuse it; with it the
scores come out wrong (or, removing APE, unreachable and refused).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbridge.engines.topology import ModelTopology, Role
from kvbridge.errors import InputError

#: Checkpoint names of the APE tensors (DeepSeek-V4 HF checkpoint; vLLM adds the ``model.`` prefix).
_NAME = re.compile(r"^(?:model\.)?(layers|mtp)\.(\d+)\.attn\.(indexer\.)?compressor\.ape$")


def ape_name(model: ModelTopology, layer: int, role: Role) -> str:
    """The checkpoint name of ``layer``'s APE for a STATE (attention) or INDEXER_STATE role."""
    base = f"layers.{layer}" if layer < model.num_layers else f"mtp.{layer - model.num_layers}"
    return f"{base}.attn.{'indexer.' if role == Role.INDEXER_STATE else ''}compressor.ape"


def _key(model: ModelTopology, name: object) -> tuple[int, Role]:
    if isinstance(name, tuple) and len(name) == 2 and isinstance(name[0], int) and name[1] in ("attn", "indexer"):
        return name[0], Role.INDEXER_STATE if name[1] == "indexer" else Role.STATE
    m = _NAME.match(name) if isinstance(name, str) else None
    if m is None:
        raise InputError(f"APE weights: {str(name)[:80]!r} is not a compressor APE name "
                         "(layers.N.attn.compressor.ape, layers.N.attn.indexer.compressor.ape, mtp.M.attn...)")
    layer = int(m.group(2)) + (model.num_layers if m.group(1) == "mtp" else 0)
    return layer, Role.INDEXER_STATE if m.group(3) else Role.STATE


@dataclass(frozen=True)
class ApeWeights:
    """Validated fp32 APE tensors ``[ratio, coff * dim]`` by ``(layer, STATE | INDEXER_STATE)``."""

    model: ModelTopology
    tensors: Mapping[tuple[int, Role], torch.Tensor]

    def get(self, layer: int, role: Role) -> torch.Tensor:
        return self.tensors[(layer, role)]

    @property
    def digest(self) -> str:
        """sha256 over the tensors' names and fp32 bytes (both ends of a transfer must hold the same)."""
        h = hashlib.sha256()
        for (layer, role), t in sorted(self.tensors.items(), key=lambda kv: (kv[0][0], kv[0][1].value)):
            h.update(f"{layer}:{role.value}:".encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def ape_shape(model: ModelTopology, layer: int, role: Role) -> tuple[int, int]:
    """``[ratio, coff * dim]`` of one compressor's APE (``coff`` 2 at ratio 4: overlapping windows)."""
    r = model.compress_ratios[layer]
    return r, (2 if r == 4 else 1) * (model.index_head_dim if role == Role.INDEXER_STATE else model.head_dim)


def nan_score(where: str, position: int) -> InputError:
    """The refusal of a stored score + APE that is NaN (no score to recover)."""
    return InputError(f"{where}: the compressor score of position {position} is NaN")


def synthetic_ape(model: ModelTopology, *, seed: int = 0, include_mtp: bool = True) -> dict[str, torch.Tensor]:
    """Stand-in APE weights of ``model``'s shapes, for benchmarks and tests without a checkpoint: each
    compressed layer's ``[ratio, coff * dim]`` tensors (attention, then the indexer's, layer by layer, MTP
    layers last with ``include_mtp``) drawn fp32 ~ N(0, 1) from one ``torch.Generator`` seeded ``seed``,
    under their checkpoint names. Not a model's weights: migrated bytes are exact for any APE, but the
    preimage search's work depends on how large the bias is next to the scores."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for spec in model.all_caches(include_mtp):
        if spec.role in (Role.STATE, Role.INDEXER_STATE):
            out[ape_name(model, spec.layer, spec.role)] = torch.randn(ape_shape(model, spec.layer, spec.role),
                                                                      generator=gen)
    return out


def _read_files(paths: Iterable[str | Path]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    found: dict[str, torch.Tensor] = {}
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise InputError(f"APE weights: {p} is not a file")
        try:
            with safe_open(str(p), framework="pt") as f:
                for name in f.keys():
                    if _NAME.match(name):
                        if name in found:
                            raise InputError(f"APE weights: {name} is in more than one file")
                        found[name] = f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as exc:  # truncated or foreign file
            raise InputError(f"APE weights: {p} is not a readable safetensors file ({str(exc)[:120]})") from None
    return found


def load_ape(source: object, model: ModelTopology, needed: Iterable[tuple[int, Role]]) -> ApeWeights:
    """Validate APE weights for the ``(layer, role)`` pairs in ``needed``.

    ``source``: an ``ApeWeights``, a safetensors path (or a list of them: a checkpoint's shards;
    only tensors named ``...compressor.ape`` are read), or a dict of tensors keyed by checkpoint
    name or by ``(layer, "attn" | "indexer")``. Each tensor must be ``[ratio, coff * dim]``,
    fp32 or bf16 (upcast to fp32, exact, as the engines hold it), every value finite. Tensors
    of other layers (a model cut to fewer layers) are not read.
    """
    if isinstance(source, ApeWeights):
        if source.model != model:
            raise InputError(f"APE weights were validated for {source.model.name}, not {model.name}")
        keyed: dict[tuple[int, Role], object] = dict(source.tensors)
    else:
        raw: Mapping[object, object]
        if isinstance(source, (str, Path)):
            raw = _read_files([source])
        elif isinstance(source, (list, tuple)) and all(isinstance(p, (str, Path)) for p in source):
            raw = _read_files(source)
        elif isinstance(source, Mapping):
            raw = source
        else:
            raise InputError("APE weights must be a safetensors path, a list of paths or a dict of tensors, "
                             f"got {type(source).__name__}")
        keyed = {}
        for name, t in raw.items():
            key = _key(model, name)
            if key in keyed:
                raise InputError(f"APE weights: {name} names a compressor given twice")
            keyed[key] = t
    out: dict[tuple[int, Role], torch.Tensor] = {}
    missing = [ape_name(model, layer, role) for layer, role in needed if (layer, role) not in keyed]
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise InputError(f"APE weights: missing {', '.join(missing[:4])}{more}")
    for layer, role in needed:
        t = keyed[(layer, role)]
        name = ape_name(model, layer, role)
        shape = ape_shape(model, layer, role)
        if not isinstance(t, torch.Tensor):
            raise InputError(f"APE weights: {name} is a {type(t).__name__}, not a tensor")
        if t.dtype not in (torch.float32, torch.bfloat16):
            raise InputError(f"APE weights: {name} is {t.dtype}; the checkpoint's APE is fp32 or bf16")
        if tuple(t.shape) != shape:
            raise InputError(f"APE weights: {name} has shape {list(t.shape)}; layer {layer} (ratio {shape[0]}) needs "
                             f"{list(shape)}")
        v = t.detach().to("cpu", torch.float32).contiguous()
        if not bool(torch.isfinite(v).all()):
            raise InputError(f"APE weights: {name} holds NaN or Inf")
        out[(layer, role)] = v
    return ApeWeights(model, out)


def _ape_rows(ape: torch.Tensor, first: int, n: int) -> torch.Tensor:
    return ape[torch.arange(first, first + n) % ape.shape[0]]


def add_ape(values: torch.Tensor, ape: torch.Tensor, first: int) -> torch.Tensor:
    """``[kv | score]`` fp32 rows of positions ``first, first + 1, ...`` with ``score += ape[p % r]``."""
    out = values.clone()
    half = values.shape[1] // 2
    out[:, half:] += _ape_rows(ape, first, values.shape[0])
    return out


def _next(x: torch.Tensor, up: bool) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, float("inf") if up else float("-inf")))


#: int32 bits of fp32 -0.0.
_NEG_ZERO_BITS = -(2**31)


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Element-wise bit equality of fp32 tensors (-0.0 differs from +0.0)."""
    return x.contiguous().view(torch.int32) == y.contiguous().view(torch.int32)


def _prefer_bf16(s: torch.Tensor, a: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A bf16 value of the preimage where there is one (the two bf16 neighbours of ``s``), else ``s``."""
    bits = s.view(torch.int32)
    low = (bits & -65536).view(torch.float32)  # bf16 truncation toward zero
    high = (((bits & -65536) + 65536) & -1).view(torch.float32)  # next bf16 away from zero
    finite = torch.isfinite(s) & torch.isfinite(high)
    return torch.where(finite & _same_bits(low + a, t), low, torch.where(finite & _same_bits(high + a, t), high, s))


def unreachable_score(where: str, position: int, col: int, stored: float, ape: float, bf16: bool) -> InputError:
    """The refusal of a stored score + APE ``stored`` that no fp32 score ``s'`` gives as ``fp32(s' + ape)``
    (``bf16``: the source stores its state as bf16)."""
    if stored == 0 and math.copysign(1.0, stored) < 0 and not bf16:
        why = ("an fp32 sum is -0.0 only when both addends are -0.0 (IEEE round-to-nearest gives +0.0 otherwise), "
               "so this APE value cannot have been added: was the state written with these APE weights?")
    elif bf16 and abs(stored) < abs(ape) * 2.0**-16:  # a bf16 sum finer than the fp32 sums' grid near -ape
        why = ("the source's bf16 state rounded score + APE where the score nearly cancels the APE (|sum| < "
               "2^-16 |APE|), which no fp32 score reproduces: run the source with fp32 compressor state "
               "(TensorRT-LLM's default, state=fp32)")
    else:
        why = ("was the state written with these APE weights? Pass the checkpoint's tensors, not SGLang's "
               "in-memory ones (Compressor._apply_ape_hotfix rearranges the ratio-4 APE)")
    return InputError(f"{where}: the compressor score + APE of position {position} (value {col}: {stored!r}, APE "
                      f"{ape!r}) is no fp32 sum of a score and the APE, so SGLang's raw score cannot reproduce it; "
                      + why)


def remove_ape(values: torch.Tensor, ape: torch.Tensor, first: int, where: str, bf16: bool = False) -> torch.Tensor:
    """``[kv | score+ape]`` fp32 rows -> ``[kv | s']`` with ``fp32(s' + ape[p % r]) == score+ape`` (see module;
    ``bf16``: the rows were stored as bf16, for the refusal's reason)."""
    half = values.shape[1] // 2
    t = values[:, half:]
    a = _ape_rows(ape, first, values.shape[0])
    if bool(torch.isnan(t).any()):
        raise nan_score(where, first + int(torch.isnan(t).any(dim=1).nonzero()[0]))
    s = t - a
    s = torch.where(torch.isinf(t), t, s)  # cleared rows (-inf) stay cleared
    # -0.0 is an fp32 sum only of -0.0 + -0.0: its one candidate is -0.0 (t - a would give +0.0)
    s = torch.where(t.contiguous().view(torch.int32) == _NEG_ZERO_BITS, t, s)
    for _ in range(4):  # fp32(t - a) is within a few ulps of the preimage
        low = (s + a) < t
        high = (s + a) > t
        if not bool((low | high).any()):
            break
        s = torch.where(low, _next(s, True), torch.where(high, _next(s, False), s))
    bad = ~_same_bits(s + a, t)  # bit for bit: a +0.0 sum does not stand for a stored -0.0
    if not bool(bad.any()):
        s = _prefer_bf16(s, a, t)
    else:
        row, col = (int(i) for i in bad.nonzero()[0])
        raise unreachable_score(where, first + row, col, float(t[row, col]), float(a[row, col]), bf16)
    out = values.clone()
    out[:, half:] = s
    return out
