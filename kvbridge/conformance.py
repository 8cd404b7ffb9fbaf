"""Conformance: the peers' reference vectors through the public API, and writer identification.

``run_conformance`` replays the fixture files of ``fixtures/`` (FlashMLA's MODEL1 encoder and
dequantizer at P = 2, 64, 256; TensorRT-LLM's per-tensor FP8 writer and reader at each scale)
plus the dialect zero-tile scale bytes of spec section 4 (114 / 105 / 92), the DeepSeek-V4.1
pages written by FlashMLA's, SGLang's and vLLM's own writers, and the indexer-key pages and
records written by SGLang's and vLLM's own writers (fixtures/README.md), comparing bytes with
``torch.equal``, and FlashMLA's sparse-decode reference outputs through ``sparse_decode``
(reference backend) within FlashMLA's own test tolerances (spec section 6; fp32 accumulation
order differs, so these are not bitwise). ``identify_writer`` says which encoder (dialect, input precision, scale)
reproduces a given byte stream from its source values.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvbridge.attention.sparse import LSE_TOLERANCE, OUT_TOLERANCE, compare, sparse_decode
from kvbridge.engines.profiles import parse_engine
from kvbridge.engines.topology import FLASH, Role
from kvbridge.errors import DumpFormatError, InputError
from kvbridge.layouts import Layout, get_layout
from kvbridge.layouts.codec import HEAD_DIM, NUM_TILES
from kvbridge.migration.pools import scatter_records
from kvbridge.ops import keys as ix
from kvbridge.ops.pages import decode, encode, transcode

MODEL1_FIXTURE = "model1_reference.safetensors"
TRTLLM_FIXTURE = "trtllm_fp8_reference.safetensors"
DECODE_FIXTURE = "model1_decode_reference.safetensors"
SGLANG_INDEXER_FIXTURE = "sglang_indexer_reference.safetensors"
VLLM_INDEXER_FIXTURE = "vllm_indexer_reference.safetensors"
DERIVED_INDEXER_FIXTURE = "derived_indexer_reference.safetensors"
SGLANG_STATE_FIXTURE = "sglang_state_addressing_reference.safetensors"
CROSS_INDEXER_FIXTURE = "cross_indexer_reference.safetensors"
DEEPGEMM_INDEXER_FIXTURE = "deepgemm_indexer_reference.safetensors"
#: Engine of each destination rule in the cross-writer fixture.
_RULE_ENGINE = {"sglang": "SGLang 0.5.23", "sglang-triton": "SGLang 0.5.23", "sglang-rne": "SGLang 0.5.23",
                "sglang-rocm": "SGLang 0.5.23",
                "vllm": "vLLM 0.33.0", "vllm-ue8m0": "vLLM 0.33.0", "trtllm": "TensorRT-LLM main",
                "deepgemm": "DeepGEMM"}
#: Writers that cannot run on a CPU, re-implemented from their source outside kvbridge (derived, not golden).
DERIVED_INDEXER_WRITERS = (
    ("TensorRT-LLM main", "fp8", "trtllm", "compressorKernels.cu postProcessScatterKernel kFP8Blockwise"),
    ("TensorRT-LLM main", "fp4", "trtllm", "compressorKernels.cu postProcessScatterKernel kMXFP4Blockwise"),
    ("SGLang 0.5.23", "fp8", "sglang", "store.cuh fused_store_indexer_cache"),
    ("SGLang 0.5.23", "fp4", "sglang", "fused_norm_rope_v2.cuh forward_fp4 (C4 pools)"),
    ("vLLM 0.33.0", "fp4", "vllm", "_fused_kv_compress_norm_rope_insert_indexer_mxfp4_attn"),
)
#: Scale byte of an all-zero tile per dialect, as stated in spec section 4 (not derived from the encoder).
ZERO_TILE_SCALE_BYTE = {"flashmla": 114, "amax-1e-4": 105, "amax-1e-8": 92}
#: Odd page size (FlashMLA's tests use 61) for the re-paging round trip check.
ODD_PAGE_SIZE = 61


@dataclass(frozen=True)
class CheckResult:
    """One conformance check: which layout/dialect/case, what was compared, and the outcome."""

    layout: str
    dialect: str | None
    case: str
    check: str
    passed: bool
    detail: str
    engine: str = ""


@dataclass
class ConformanceReport:
    """All checks of one ``run_conformance`` call, the fixture directory and the device they ran on."""

    fixtures_dir: str
    device: str
    results: list[CheckResult]

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.passed]

    def to_dict(self) -> dict:
        return {
            "fixtures_dir": self.fixtures_dir,
            "device": self.device,
            "passed": self.passed,
            "num_checks": len(self.results),
            "num_failed": len(self.failures),
            "results": [asdict(r) for r in self.results],
        }


def default_fixtures_dir() -> Path:
    """The golden fixtures: ``kvbridge/fixtures`` of an installed wheel, else the source checkout's
    ``fixtures/`` (a source tree or an editable install); error if neither holds them."""
    here = Path(__file__).resolve().parent
    candidates = (here / "fixtures", here.parent / "fixtures")
    for path in candidates:
        if (path / MODEL1_FIXTURE).is_file():
            return path
    raise InputError(
        f"no conformance fixtures found in {' or '.join(map(str, candidates))}; "
        "pass the directory holding model1_reference.safetensors and trtllm_fp8_reference.safetensors"
    )


def byte_diff(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, str]:
    """Exact comparison of two uint8 tensors: (equal?, one-line detail naming the first differing byte)."""
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape:
        return False, f"shape {list(got.shape)} != expected {list(want.shape)}"
    if torch.equal(got, want):
        return True, f"{want.numel()} bytes equal"
    diff = (got != want).flatten().nonzero()
    first = int(diff[0])
    return False, (
        f"{diff.numel()} of {want.numel()} bytes differ; first at flat byte {first} "
        f"(got 0x{int(got.flatten()[first]):02x}, want 0x{int(want.flatten()[first]):02x})"
    )


def value_diff(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, str]:
    """Exact comparison of two fp32 tensors, NaN equal to NaN: (equal?, one-line detail)."""
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape:
        return False, f"shape {list(got.shape)} != expected {list(want.shape)}"
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    if bool(same.all()):
        return True, f"{want.numel()} values equal exactly"
    bad = int((~same).sum())
    return False, f"{bad} of {want.numel()} values differ; max |diff| {float((got - want).abs()[~same].max()):.3g}"


def _load(path: Path, device: torch.device) -> tuple[dict[str, torch.Tensor], dict]:
    try:
        with safe_open(str(path), "pt") as fh:
            cases = json.loads(fh.metadata()["cases"])
            tensors = {k: fh.get_tensor(k).to(device) for k in fh.keys()}
    except FileNotFoundError:
        raise InputError(f"fixture file {path} not found") from None
    except (SafetensorError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise DumpFormatError(f"{path}: not a kvbridge fixture file ({exc})") from None
    return tensors, cases


def _check(layout: str, dialect: str | None, case: str, check: str, outcome: tuple[bool, str]) -> CheckResult:
    return CheckResult(layout, dialect, case, check, *outcome)


def model1_checks(path: Path, device: torch.device) -> list[CheckResult]:
    """FlashMLA MODEL1 vectors: encode (flashmla dialect), decode, footer-scale layout, re-paging."""
    tensors, cases = _load(path, device)
    results = []
    for case, info in cases.items():
        p = int(info["page_size"])
        x = tensors[f"{case}.input"].reshape(-1, HEAD_DIM)
        want = tensors[f"{case}.model1"]
        label = f"P={p}"
        got = encode(x, "flashmla-model1", page_size=p, dialect="flashmla")
        results.append(_check("flashmla-model1", "flashmla", label, "encode = FlashMLA quant.py", byte_diff(got, want)))
        decoded = decode(want, "flashmla-model1", page_size=p)
        dequant = tensors[f"{case}.dequant"].reshape(-1, HEAD_DIM).float()
        results.append(
            _check("flashmla-model1", None, label, "decode = FlashMLA dequantize", value_diff(decoded, dequant))
        )
        ds = get_layout("trtllm-fp8-ds-mla")
        footer = encode(x, ds, page_size=p, dialect="flashmla")
        results.append(
            _check(
                ds.name,
                "flashmla",
                label,
                "records = MODEL1 records",
                byte_diff(ds.pages_to_records(footer, p), get_layout("flashmla-model1").pages_to_records(want, p)),
            )
        )
        model1 = get_layout("flashmla-model1")
        n = x.shape[0]
        at_odd = encode(x, model1, page_size=ODD_PAGE_SIZE, dialect="flashmla")
        results.append(
            _check(
                model1.name,
                "flashmla",
                label,
                f"encode at P={ODD_PAGE_SIZE}: records = FlashMLA's",
                byte_diff(model1.pages_to_records(at_odd, ODD_PAGE_SIZE, n), model1.pages_to_records(want, p)),
            )
        )
        odd = transcode(want, "flashmla-model1", "flashmla-model1", src_page_size=p, dst_page_size=ODD_PAGE_SIZE)
        back = transcode(
            odd,
            "flashmla-model1",
            "flashmla-model1",
            src_page_size=ODD_PAGE_SIZE,
            dst_page_size=p,
            num_tokens=x.shape[0],
        )
        results.append(
            _check("flashmla-model1", None, label, f"byte-move re-page via P={ODD_PAGE_SIZE}", byte_diff(back, want))
        )
    return results


def trtllm_checks(path: Path, device: torch.device) -> list[CheckResult]:
    """TensorRT-LLM per-tensor FP8 vectors: SWA writer bytes and reader values at each scale."""
    tensors, cases = _load(path, device)
    results = []
    for case, info in cases.items():
        s = float(info["scale"])
        x = tensors[f"{case}.input"]
        label = f"s={s:g}"
        got = encode(x, "trtllm-fp8", page_size=1, dialect="swa", scale=s)
        results.append(
            _check("trtllm-fp8", "swa", label, "encode = TensorRT-LLM writer", byte_diff(got, tensors[f"{case}.fp8"]))
        )
        decoded = decode(tensors[f"{case}.fp8"], "trtllm-fp8", page_size=1, scale=s)
        results.append(
            _check(
                "trtllm-fp8",
                None,
                label,
                "decode = TensorRT-LLM reader",
                value_diff(decoded, tensors[f"{case}.decoded"]),
            )
        )
    return results


def decode_checks(path: Path, device: torch.device) -> list[CheckResult]:
    """FlashMLA sparse decode vectors: ``sparse_decode`` out and lse within FlashMLA's tolerances."""
    tensors, cases = _load(path, device)
    results = []
    for case, info in cases.items():

        def get(key: str, case: str = case) -> torch.Tensor | None:
            return tensors.get(f"{case}.{key}")

        out, lse = sparse_decode(
            get("q"),
            get("k_cache"),
            get("indices"),
            layout="flashmla-model1",
            page_size=int(info["page_size"]),
            extra_k_cache=get("extra_k_cache"),
            extra_indices=get("extra_indices"),
            extra_page_size=info["extra_page_size"],
            topk_length=get("topk_length"),
            extra_topk_length=get("extra_topk_length"),
            attn_sink=get("attn_sink"),
            softmax_scale=float(info["sm_scale"]),
            backend="reference",
        )
        label = f"{case} (P={info['page_size']}" + (f"+{info['extra_page_size']})" if info["extra_page_size"] else ")")
        for what, got, tol in (("out", out, OUT_TOLERANCE), ("lse", lse, LSE_TOLERANCE)):
            cmp = compare(got, get(what), tol)
            results.append(
                CheckResult(
                    "flashmla-model1", None, label, f"sparse decode {what} ~ FlashMLA ref", cmp.passed, cmp.detail
                )
            )
    return results


def dialect_checks(device: torch.device) -> list[CheckResult]:
    """Spec section 4: an all-zero tile gets scale byte 114 / 105 / 92 and value bytes 0x00."""
    results = []
    zeros = torch.zeros(1, HEAD_DIM, device=device)
    for name in ("flashmla-model1", "trtllm-fp8-ds-mla"):
        lay = get_layout(name)
        for dialect, byte in ZERO_TILE_SCALE_BYTE.items():
            rec = lay.pages_to_records(encode(zeros, lay, page_size=1, dialect=dialect), 1, 1)[0]
            want = torch.cat([torch.zeros(576, dtype=torch.uint8), torch.full((NUM_TILES,), byte, dtype=torch.uint8)])
            results.append(_check(name, dialect, f"byte {byte}", "zero tile scale bytes", byte_diff(rec[:583], want)))
    return results


#: (engine version, fixture file, format, rule, writer function the fixture was made with).
INDEXER_WRITERS = (
    ("SGLang 0.5.23", SGLANG_INDEXER_FIXTURE, "fp4", "sglang-triton",
     "quantize_fp4_indexer_tensor(rne=False) + store_fp4_index_k_cache"),
    ("SGLang 0.5.23", SGLANG_INDEXER_FIXTURE, "fp4", "sglang-rne", "quantize_fp4_indexer_tensor(rne=True)"),
    ("SGLang 0.5.23", SGLANG_INDEXER_FIXTURE, "fp8", "sglang-rocm", "triton_fused_store_indexer"),
    ("SGLang 0.5.23", SGLANG_INDEXER_FIXTURE, "fp8", "sglang-rocm-fnuz", "triton_fused_store_indexer (gfx942)"),
    ("vLLM 0.33.0", VLLM_INDEXER_FIXTURE, "fp8", "vllm", "_fused_kv_compress_norm_rope_insert_indexer_attn"),
    ("vLLM 0.33.0", VLLM_INDEXER_FIXTURE, "fp8", "vllm-ue8m0",
     "_fused_kv_compress_norm_rope_insert_indexer_attn(MX_SCALE)"),
)


def page_records(pages: torch.Tensor, slots: torch.Tensor, page_size: int, split: int, record_bytes: int
                 ) -> torch.Tensor:
    """Records of the keys at ``slots`` of block-planar indexer pages (values at ``row * split``,
    scales at ``page_size * split + row * (record_bytes - split)``); page stride = ``pages.shape[1]``."""
    page, row = slots // page_size, slots % page_size
    cols = torch.arange(split, device=pages.device)
    tail = torch.arange(record_bytes - split, device=pages.device)
    values = pages[page.unsqueeze(1), row.unsqueeze(1) * split + cols]
    scales = pages[page.unsqueeze(1), page_size * split + row.unsqueeze(1) * (record_bytes - split) + tail]
    return torch.cat([values, scales], dim=1)


def indexer_checks(root: Path, device: torch.device) -> list[CheckResult]:
    """Indexer-key bytes written by SGLang's and vLLM's own writers: encode = their records and pages."""
    results = []
    loaded = {name: _load(root / name, device) for name in (SGLANG_INDEXER_FIXTURE, VLLM_INDEXER_FIXTURE)}
    for engine, name, fmt_name, rule, writer in INDEXER_WRITERS:
        tensors, info = loaded[name]
        fmt = ix.indexer_format(fmt_name)
        p = int(info["page_size"])
        key = f"{fmt_name}.{rule}"
        layout = f"indexer-{fmt_name}"
        if name == SGLANG_INDEXER_FIXTURE:
            keys, slots = tensors["keys"], tensors["slots"]
            want_records = tensors.get(f"{key}.records")
        else:
            keys, slots = tensors[f"{key}.page_keys"], tensors[f"{key}.slots"]
            want_records = None
        got = ix.encode_keys(keys, fmt, rule)
        pages = tensors[f"{key}.pages"]
        have = page_records(pages, slots.long(), p, fmt.split, fmt.record_bytes)
        results.append(CheckResult(layout, rule, f"P={p}, {pages.shape[1]} B pages", f"page bytes = {writer}",
                                   *byte_diff(got, have), engine=engine))
        if name == VLLM_INDEXER_FIXTURE:
            keys, want_records = tensors[f"{key}.keys"], tensors[f"{key}.records"]
            got = ix.encode_keys(keys, fmt, rule)
        if want_records is not None:
            results.append(CheckResult(layout, rule, f"{keys.shape[0]} keys", f"records = {writer}",
                                       *byte_diff(got, want_records), engine=engine))
    return results


def deepgemm_checks(path: Path, device: torch.device) -> list[CheckResult]:
    """DeepGEMM's own quantizers (``deep_gemm/utils/math.py``, run on CPU): fp8 and fp4 key records."""
    tensors, _ = _load(path, device)
    results = []
    for fmt_name, writer in (("fp8", "per_token_cast_to_fp8(gran_k=128)"),
                             ("fp4", "per_token_cast_to_fp4(use_ue8m0, gran_k=32)")):
        got = ix.encode_keys(tensors["keys"], ix.indexer_format(fmt_name), "deepgemm")
        results.append(CheckResult(f"indexer-{fmt_name}", "deepgemm", f"{got.shape[0]} keys", f"records = {writer}",
                                   *byte_diff(got, tensors[f"{fmt_name}.deepgemm.records"]), engine="DeepGEMM"))
    return results


def derived_indexer_checks(path: Path, device: torch.device) -> list[CheckResult]:
    """Indexer records of the writers that need a GPU, from an independent re-implementation (derived)."""
    tensors, _ = _load(path, device)
    keys = tensors["keys"]
    results = []
    for engine, fmt_name, rule, writer in DERIVED_INDEXER_WRITERS:
        got = ix.encode_keys(keys, ix.indexer_format(fmt_name), rule)
        results.append(CheckResult(f"indexer-{fmt_name}", rule, f"{keys.shape[0]} keys (derived)",
                                   f"records = {writer}", *byte_diff(got, tensors[f"{fmt_name}.{rule}.records"]),
                                   engine=engine))
    return results


def indexer_source_records(root: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """The indexer records of every fixture writer, by ``fmt.rule`` (the sources of the cross-writer cases)."""
    sg, _ = _load(root / SGLANG_INDEXER_FIXTURE, device)
    vl, _ = _load(root / VLLM_INDEXER_FIXTURE, device)
    dv, _ = _load(root / DERIVED_INDEXER_FIXTURE, device)
    return {
        "fp4.sglang-triton": sg["fp4.sglang-triton.records"], "fp4.sglang-rne": sg["fp4.sglang-rne.records"],
        "fp4.sglang": dv["fp4.sglang.records"],
        "fp4.trtllm": dv["fp4.trtllm.records"], "fp8.trtllm": dv["fp8.trtllm.records"],
        "fp8.sglang": dv["fp8.sglang.records"], "fp8.vllm": vl["fp8.vllm.records"],
        "fp8.vllm-ue8m0": vl["fp8.vllm-ue8m0.records"],
        **{k.removesuffix(".records"): v for k, v in _load(root / DEEPGEMM_INDEXER_FIXTURE, device)[0].items()
           if k != "keys"},
    }


def cross_indexer_checks(root: Path, device: torch.device) -> list[CheckResult]:
    """Converted keys = what the destination engine's own writer wrote from the source's decoded values.

    Each case is a source writer's records, decoded and re-written by SGLang's or vLLM's writer
    (golden), or by the independent re-implementation of a GPU-only writer (keys ``derived:...``),
    see ``fixtures/README.md``; kvbridge's conversion must give the same bytes.
    """
    sources = indexer_source_records(root, device)
    tensors, _ = _load(root / CROSS_INDEXER_FIXTURE, device)
    results = []
    for key in sorted(tensors):
        derived = key.startswith("derived:")
        src, dst = key.removeprefix("derived:").split("->")
        (src_fmt, src_rule), (dst_fmt, dst_rule) = src.split(".", 1), dst.split(".", 1)
        got, _ = ix.transcode_keys(sources[src], ix.indexer_format(src_fmt), ix.indexer_format(dst_fmt), dst_rule,
                                   src_rule)
        case = f"from {src}" + (" (derived)" if derived else "")
        results.append(CheckResult(f"indexer-{dst_fmt}", dst_rule, case, "converted = engine writer",
                                   *byte_diff(got, tensors[key]), engine=_RULE_ENGINE[dst_rule]))
    return results


def state_addressing_checks(path: Path, device: torch.device) -> list[CheckResult]:
    """SGLang's compressor-state rows (its pool's own translate functions) = kvbridge's addressing.

    Each live position's record is scattered through kvbridge's storage of the SGLang profile and
    the flat row it lands in (page * ring + row) is compared with SGLang's state_loc.
    """
    tensors, cases = _load(path, device)
    results = []
    for name, info in cases.items():
        ring = int(info["ring"])
        if info["kind"] == "page-ring":
            draft = ":draft=1" if ring == 16 else ""
            profile = parse_engine(f"sglang:swa={info['swa_page']}{draft}")
            spec = next(c for c in FLASH.caches(2) if c.role == Role.INDEXER_STATE)
        else:
            profile = parse_engine("sglang:draft=1" if ring == 256 else "sglang")
            spec = next(c for c in FLASH.caches(3) if c.role == Role.STATE)
        st = profile.storage(spec)
        positions = tensors[f"{name}.positions"].long().cpu()
        table = [int(t) for t in tensors[f"{name}.table"]]
        first, n = int(positions[0]), positions.numel()
        records = torch.zeros(n, st.record_bytes, dtype=torch.uint8)
        records[:, :8] = (positions + 1).view(-1, 1).view(torch.uint8)  # a label per position (never 0)
        pool = torch.zeros(max(table) + 1, st.page_bytes, dtype=torch.uint8)
        scatter_records(pool, st, table, first, records)
        rows = pool[:, : st.page_size * st.record_bytes].reshape(-1, st.record_bytes)[:, :8].contiguous()
        labels = rows.view(torch.int64).view(-1)
        got = torch.full((n,), -1, dtype=torch.int64)
        for flat in labels.nonzero().view(-1).tolist():
            got[int(labels[flat]) - 1 - first] = flat
        want = tensors[f"{name}.state_loc"].long().cpu()
        ok = torch.equal(got, want)
        bad = got != want
        detail = f"{n} rows equal" if ok else f"rows {got[bad][:4].tolist()} != SGLang's {want[bad][:4].tolist()}"
        results.append(CheckResult(f"state-{st.fmt}", None, f"{name} ({st.addressing})",
                                   "rows = CompressStatePool.translate_from_*_to_state_loc", ok, detail,
                                   engine="SGLang 0.5.23"))
    return results


def _writer_engine(writer: str) -> str:
    """The engine (and version, or the open PR, where the writer names one) of a fixture's writer string."""
    words = writer.split()
    if len(words) > 2 and words[1] == "PR" and words[2].startswith("#"):
        return " ".join(words[:3])
    return " ".join(words[:2]) if len(words) > 1 and words[1][:1].isdigit() else words[0]


def _tensor_tag(name: str) -> str:
    """A fixture tensor's name without its case prefix (``p3.sglang`` -> ``sglang``): the writer it holds."""
    return name.split(".", 1)[-1]


def layout_fixture_checks(root: Path, device: torch.device) -> list[CheckResult]:
    """Fixtures whose metadata lists ``entries`` (pages a peer's own writer made for a layout, e.g.
    the DeepSeek-V4.1 files): ``encode`` reproduces each page tensor byte for byte (with the entry's
    ``nonfinite`` policy: ``propagate`` for the writers' NaN/Inf tiles, check "NaN/Inf"), and ``decode``
    equals the peer's dequantized values where the entry has them (exact: the products are bf16)."""
    results = []
    for path in sorted(root.glob("*.safetensors")):
        try:
            with safe_open(str(path), "pt") as fh:
                entries = json.loads((fh.metadata() or {}).get("entries", "[]"))
                tensors = {k: fh.get_tensor(k).to(device) for k in fh.keys()} if entries else {}
        except (SafetensorError, TypeError, json.JSONDecodeError) as exc:
            raise DumpFormatError(f"{path}: not a kvbridge fixture file ({exc})") from None
        for e in entries:
            x, want, p = tensors[e["input"]], tensors[e["pages"]], int(e["page_size"])
            engine, case = _writer_engine(e["writer"]), f"P={p}"
            nonfinite = e.get("nonfinite", "error")  # "propagate": the writer's NaN/Inf tiles
            got = encode(x, e["layout"], page_size=p, dialect=e["dialect"], nonfinite=nonfinite)
            what = "encode" if nonfinite == "error" else "NaN/Inf"
            results.append(CheckResult(e["layout"], e["dialect"], case, f"{what} = {_tensor_tag(e['pages'])}",
                                       *byte_diff(got, want), engine=engine))
            if "dequant" in e:
                values = decode(want, e["layout"], page_size=p, num_tokens=x.shape[0])
                results.append(CheckResult(e["layout"], e["dialect"], case, f"decode = {_tensor_tag(e['dequant'])}",
                                           *value_diff(values, tensors[e["dequant"]].float()), engine=engine))
    return results


def run_conformance(
    fixtures_dir: str | os.PathLike | None = None, device: str | torch.device = "cpu"
) -> ConformanceReport:
    """Run every conformance check against ``fixtures_dir`` (default: the repository's ``fixtures/``).

    ``device``: where the inputs go, so ``cuda`` checks the GPU paths (Triton kernels) byte for byte.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(f"device must be a torch device such as 'cpu' or 'cuda', got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError("device 'cuda' requested but CUDA is not available on this machine")
    root = default_fixtures_dir() if fixtures_dir is None else Path(fixtures_dir)
    if not root.is_dir():
        raise InputError(f"fixtures directory {root} does not exist")
    results = [
        *model1_checks(root / MODEL1_FIXTURE, dev),
        *trtllm_checks(root / TRTLLM_FIXTURE, dev),
        *dialect_checks(dev),
        *decode_checks(root / DECODE_FIXTURE, dev),
        *indexer_checks(root, dev),
        *deepgemm_checks(root / DEEPGEMM_INDEXER_FIXTURE, dev),
        *derived_indexer_checks(root / DERIVED_INDEXER_FIXTURE, dev),
        *state_addressing_checks(root / SGLANG_STATE_FIXTURE, dev),
        *cross_indexer_checks(root, dev),
        *layout_fixture_checks(root, dev),
    ]
    return ConformanceReport(str(root), str(dev), results)


@dataclass(frozen=True)
class WriterCandidate:
    """One encoder tried by ``identify_writer`` and how its bytes compare with the given ones.

    ``differing_bytes`` counts record bytes (pad bytes excluded) that differ.
    """

    writer: str
    dialect: str | None
    input_precision: str
    scale: float | None
    matches: bool
    differing_bytes: int


@dataclass
class WriterReport:
    """Result of ``identify_writer``: every candidate, and the names of those matching exactly."""

    layout: str
    num_tokens: int
    candidates: list[WriterCandidate]

    @property
    def matches(self) -> list[str]:
        return [c.writer for c in self.candidates if c.matches]

    def to_dict(self) -> dict:
        return {
            "layout": self.layout,
            "num_tokens": self.num_tokens,
            "matches": self.matches,
            "candidates": [asdict(c) for c in self.candidates],
        }


#: Engines known to use each (dialect, input precision), from spec sections 3-4; other pairs get a plain label.
KNOWN_WRITERS: dict[tuple[str, str], str] = {
    ("flashmla", "bf16"): "FlashMLA tests/quant.py",
    ("amax-1e-4", "bf16"): "vLLM writer / DeepSeek act_quant",
    ("amax-1e-4", "fp32"): "SGLang V4 SWA store (fp32 input)",
    ("amax-1e-8", "bf16"): "TensorRT-LLM fp8_ds_mla writer",
    ("swa", "bf16"): "TensorRT-LLM SWA writer",
    ("compress", "fp32"): "TensorRT-LLM COMPRESS writer",
    ("compress", "bf16"): "SGLang --dsv4-attn-backend trtllm (unit scale)",
    ("amax-1e-4/224", "bf16"): "vLLM ROCm gfx942 SWA writer",
    ("amax-1e-8/240", "bf16"): "SGLang HIP store (gfx942)",
}


def _meaningful_bytes(lay: Layout) -> torch.Tensor:
    """Boolean mask over a record: True except pad bytes (unspecified by the writers)."""
    mask = torch.ones(lay.record_bytes, dtype=torch.bool)
    for f in lay.fields:
        if f.format == "pad":
            mask[f.offset : f.offset + f.nbytes] = False
    return mask


def identify_writer(
    pages: torch.Tensor,
    layout: str | Layout,
    values: torch.Tensor,
    *,
    page_size: int,
    num_tokens: int | None = None,
    scale: float | None = None,
) -> WriterReport:
    """Which encoder reproduces ``pages`` exactly from source ``values`` (``[num_tokens, 512]``).

    Tries every dialect of ``layout`` with bf16-rounded input and with the values as given
    (fp32); for ``trtllm-fp8`` the ``swa`` writer at ``scale`` (default 1.0) and the
    ``compress`` writer (scale 1). Token records are compared over the first ``num_tokens``
    tokens (default: ``values.shape[0]``), pad bytes excluded. Bf16 ``values`` make the two
    input precisions indistinguishable, so both match or neither.
    """
    lay = get_layout(layout)
    lay.check_pages(pages, page_size)
    if not isinstance(values, torch.Tensor) or values.dim() != 2 or values.shape[1] != HEAD_DIM:
        raise InputError(f"values must be a tensor [num_tokens, {HEAD_DIM}], got {getattr(values, 'shape', values)!r}")
    n = values.shape[0] if num_tokens is None else num_tokens
    if n > values.shape[0]:
        raise InputError(f"num_tokens={n} exceeds the {values.shape[0]} source values given")
    mask = _meaningful_bytes(lay).to(pages.device)
    have = lay.pages_to_records(pages, page_size, n)[:, mask]
    src = values[:n].to(pages.device)
    inputs = {"bf16": src.bfloat16(), "fp32": src.float()}
    candidates = []
    for dialect in lay.dialects or (None,):
        s = (1.0 if dialect == "compress" or scale is None else scale) if lay.takes_scale else None
        for precision, x in inputs.items():
            got = lay.pages_to_records(encode(x, lay, page_size=page_size, dialect=dialect, scale=s), page_size, n)
            differing = int((got[:, mask] != have).sum())
            family = dialect or lay.name
            name = KNOWN_WRITERS.get((family, precision), f"{family} ({precision} input)")
            label = f"{family}/{precision}" + (f"@s={s:g}" if s is not None else "") + f": {name}"
            candidates.append(WriterCandidate(label, dialect, precision, s, differing == 0, differing))
    return WriterReport(lay.name, n, candidates)


#: Engine writer behind each indexer rule.
INDEXER_RULE_WRITERS = {
    "trtllm": "TensorRT-LLM indexer writer", "sglang": "SGLang CUDA (C4 pools)",
    "sglang-triton": "SGLang Triton quantize_fp4_indexer_tensor", "sglang-rocm": "SGLang ROCm store",
    "sglang-rocm-fnuz": "SGLang ROCm store on gfx942 (E4M3 FNUZ)",
    "sglang-rne": "SGLang Triton fp4 with rne=True", "deepgemm": "DeepGEMM reference",
    "vllm": "vLLM", "vllm-ue8m0": "vLLM on SM100 (UE8M0 scales)",
}


def identify_indexer_writer(pages: torch.Tensor, fmt: str, keys: torch.Tensor, *, page_size: int,
                            slots: torch.Tensor | None = None) -> WriterReport:
    """Which engine's indexer writer reproduces block-planar indexer ``pages`` (uint8
    ``[num_pages, page_bytes]``) from the source ``keys`` ``[N, dim]`` stored at ``slots``
    (default 0..N-1). Every rule of the format is tried; all bytes of each key are compared."""
    f = ix.indexer_format(fmt, keys.shape[1] if isinstance(keys, torch.Tensor) and keys.dim() == 2 else 128)
    if not isinstance(pages, torch.Tensor) or pages.dtype != torch.uint8 or pages.dim() != 2 \
            or pages.shape[1] < page_size * f.record_bytes:
        raise InputError(f"{fmt} indexer pages must be uint8 [num_pages, >= {page_size * f.record_bytes}]")
    n = keys.shape[0]
    slots = torch.arange(n) if slots is None else slots.long()
    if slots.shape != (n,) or (n and (int(slots.min()) < 0 or int(slots.max()) >= pages.shape[0] * page_size)):
        raise InputError(f"slots must be {n} indices into {pages.shape[0]} pages of {page_size} keys")
    have = page_records(pages, slots.to(pages.device), page_size, f.split, f.record_bytes)
    candidates = []
    for rule in f.rules:
        got = ix.encode_keys(keys, f, rule).to(pages.device)
        differing = int((got != have).sum())
        candidates.append(WriterCandidate(f"{rule}: {INDEXER_RULE_WRITERS[rule]}", rule, "as given", None,
                                          differing == 0, differing))
    return WriterReport(f"indexer-{fmt}", n, candidates)


__all__ = [
    "CheckResult",
    "ConformanceReport",
    "WriterCandidate",
    "WriterReport",
    "default_fixtures_dir",
    "identify_indexer_writer",
    "identify_writer",
    "run_conformance",
]
