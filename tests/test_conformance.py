"""Conformance suite over fixtures/ and writer identification across dialects and precisions."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES

import kvbridge
from kvbridge.conformance import (
    ZERO_TILE_SCALE_BYTE,
    default_fixtures_dir,
    identify_writer,
    run_conformance,
)
from kvbridge.errors import DumpFormatError, InputError


@pytest.fixture(scope="module")
def report():
    return run_conformance()


def test_every_fixture_check_passes(report):
    assert report.passed, [r for r in report.failures]
    assert report.fixtures_dir == str(FIXTURES) and report.device == "cpu"
    cases = {(r.layout, r.case, r.check) for r in report.results}
    for p in (2, 64, 256):
        assert ("flashmla-model1", f"P={p}", "encode = FlashMLA quant.py") in cases
        assert ("flashmla-model1", f"P={p}", "decode = FlashMLA dequantize") in cases
        assert ("trtllm-fp8-ds-mla", f"P={p}", "records = MODEL1 records") in cases
        assert ("flashmla-model1", f"P={p}", "encode at P=61: records = FlashMLA's") in cases
    for check in ("encode = TensorRT-LLM writer", "decode = TensorRT-LLM reader"):
        scales = {r.case for r in report.results if r.layout == "trtllm-fp8" and r.check == check}
        assert scales == {"s=1", "s=0.5", "s=2", "s=0.037"}
    zero = {(r.layout, r.dialect, r.case) for r in report.results if r.check.startswith("zero tile")}
    assert zero == {
        (layout, dialect, f"byte {byte}")
        for layout in ("flashmla-model1", "trtllm-fp8-ds-mla")
        for dialect, byte in (("flashmla", 114), ("amax-1e-4", 105), ("amax-1e-8", 92))
    }
    decode = {(r.case, r.check) for r in report.results if r.check.startswith("sparse decode")}
    assert decode == {
        (c, f"sparse decode {w} ~ FlashMLA ref") for c in ("c0 (P=64)", "c1 (P=64+2)") for w in ("out", "lse")
    }
    assert report.to_dict()["num_failed"] == 0
    writers = [r for r in report.results if r.layout.startswith("indexer") and r.check != "converted = engine writer"]
    golden = {(r.engine, r.layout, r.dialect) for r in writers if "derived" not in r.case}
    assert golden == {("SGLang 0.5.23", "indexer-fp4", "sglang-triton"), ("SGLang 0.5.23", "indexer-fp4", "sglang-rne"),
                      ("SGLang 0.5.23", "indexer-fp8", "sglang-rocm"),
                      ("SGLang 0.5.23", "indexer-fp8", "sglang-rocm-fnuz"), ("vLLM 0.33.0", "indexer-fp8", "vllm"),
                      ("vLLM 0.33.0", "indexer-fp8", "vllm-ue8m0"), ("DeepGEMM", "indexer-fp8", "deepgemm"),
                      ("DeepGEMM", "indexer-fp4", "deepgemm")}
    derived = {(r.engine, r.layout, r.dialect) for r in writers if "derived" in r.case}
    assert derived == {("TensorRT-LLM main", "indexer-fp8", "trtllm"), ("TensorRT-LLM main", "indexer-fp4", "trtllm"),
                       ("SGLang 0.5.23", "indexer-fp8", "sglang"), ("SGLang 0.5.23", "indexer-fp4", "sglang"),
                       ("vLLM 0.33.0", "indexer-fp4", "vllm")}
    # every fixture writer's records converted into every other writer: 10 sources x (7 golden + 5 derived)
    cross = [r for r in report.results if r.check == "converted = engine writer"]
    assert len(cross) == 120 and len({r.case for r in cross}) == 20
    state = {r.case for r in report.results if r.layout.startswith("state")}
    assert state == {f"c4.swa{p}.ring{n} (page-ring)" for p in (256, 128) for n in (8, 16)} | {
        "c128.ring128 (ring)", "c128.ring256 (ring)"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_fixture_check_passes_on_cuda():
    cuda = run_conformance(device="cuda")
    assert cuda.passed, cuda.failures


def test_zero_tile_bytes_are_the_spec_constants():
    assert ZERO_TILE_SCALE_BYTE == {"flashmla": 114, "amax-1e-4": 105, "amax-1e-8": 92}


def test_a_corrupted_fixture_fails_with_the_first_differing_byte(tmp_path: Path):
    for name in (
        "model1_reference.safetensors",
        "trtllm_fp8_reference.safetensors",
        "model1_decode_reference.safetensors",
        "sglang_indexer_reference.safetensors",
        "vllm_indexer_reference.safetensors",
        "derived_indexer_reference.safetensors",
        "sglang_state_addressing_reference.safetensors",
        "cross_indexer_reference.safetensors",
        "deepgemm_indexer_reference.safetensors",
    ):
        shutil.copy(FIXTURES / name, tmp_path / name)
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = tmp_path / "trtllm_fp8_reference.safetensors"
    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata()
    tensors = load_file(str(path))
    tensors["s2.fp8"][3, 5] ^= 1
    save_file(tensors, str(path), metadata=meta)
    bad = run_conformance(tmp_path)
    assert not bad.passed
    encode_failure, decode_failure = bad.failures
    assert (encode_failure.layout, encode_failure.case, encode_failure.check) == (
        "trtllm-fp8",
        "s=2",
        "encode = TensorRT-LLM writer",
    )
    assert encode_failure.detail.startswith("1 of 153600 bytes differ; first at flat byte 1541")
    assert (decode_failure.case, decode_failure.check) == ("s=2", "decode = TensorRT-LLM reader")


def test_a_corrupted_v41_page_fails_verify_naming_its_writer(tmp_path: Path):
    """The V4.1 fixtures (pages written by FlashMLA's, SGLang's and vLLM's own writers) are part of
    ``run_conformance``: one flipped byte is a failure naming the layout, the case and the writer."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    for path in FIXTURES.glob("*.safetensors"):
        shutil.copy(path, tmp_path / path.name)
    path = tmp_path / "v41_fp8_reference.safetensors"
    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata()
    entry = next(e for e in json.loads(meta["entries"]) if e["pages"] == "p3.sglang")
    tensors = load_file(str(path))
    tensors["p3.sglang"].view(-1)[100] ^= 1
    save_file(tensors, str(path), metadata=meta)
    bad = run_conformance(tmp_path)
    assert not bad.passed
    encode_failure, decode_failure = bad.failures  # the page no longer decodes to FlashMLA's values either
    assert (encode_failure.layout, encode_failure.case, encode_failure.check, encode_failure.engine) == (
        entry["layout"], "P=3", "encode = sglang", "SGLang 0.5.23")
    assert encode_failure.detail.startswith("1 of ") and "first at flat byte 100" in encode_failure.detail
    assert (decode_failure.case, decode_failure.check) == ("P=3", "decode = flashmla_dequant")


def test_missing_fixtures_are_a_clear_error(tmp_path: Path):
    with pytest.raises(InputError, match="fixture file .* not found"):
        run_conformance(tmp_path)
    with pytest.raises(InputError, match="does not exist"):
        run_conformance(tmp_path / "nowhere")
    (tmp_path / "model1_reference.safetensors").write_bytes(b"garbage")
    with pytest.raises(DumpFormatError, match="not a kvbridge fixture file"):
        run_conformance(tmp_path)
    assert default_fixtures_dir() == FIXTURES


def tiles_with_small_amax() -> torch.Tensor:
    """bf16 latents whose tiles straddle the dialect boundary amax = 448 * 2^-14."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 512, generator=g)
    x[:, :448] *= torch.logspace(-7, 1, 40).unsqueeze(1)
    return x.bfloat16()


@pytest.mark.parametrize("dialect", ["flashmla", "amax-1e-4", "amax-1e-8"])
def test_identify_model1_dialect_from_bf16_values(dialect: str):
    x = tiles_with_small_amax()
    pages = kvbridge.encode(x, "model1", page_size=16, dialect=dialect)
    rep = identify_writer(pages, "model1", x, page_size=16)
    matched = {c.dialect for c in rep.candidates if c.matches}
    assert matched == {dialect}  # bf16 values: both input precisions are the same writer
    assert all(c.matches for c in rep.candidates if c.dialect == dialect)
    assert all(c.differing_bytes > 0 for c in rep.candidates if c.dialect != dialect)


def test_identify_bf16_first_vs_fp32_input():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 512, generator=g)  # fp32 values: bf16 rounding first changes some bytes
    from_fp32 = kvbridge.encode(x, "model1", page_size=64, dialect="amax-1e-4")
    from_bf16 = kvbridge.encode(x.bfloat16(), "model1", page_size=64, dialect="amax-1e-4")
    fp32_rep = identify_writer(from_fp32, "model1", x, page_size=64)
    bf16_rep = identify_writer(from_bf16, "model1", x, page_size=64)
    # every tile's amax is far above 0.0273, so the three dialects agree; the precision does not
    assert {c.input_precision for c in fp32_rep.candidates if c.matches} == {"fp32"}
    assert {c.input_precision for c in bf16_rep.candidates if c.matches} == {"bf16"}
    assert "amax-1e-4/fp32: SGLang V4 SWA store (fp32 input)" in fp32_rep.matches
    assert "amax-1e-4/bf16: vLLM writer / DeepSeek act_quant" in bf16_rep.matches


def test_identify_trtllm_swa_vs_compress_writer_at_a_scale():
    x = torch.randn(32, 512, generator=torch.Generator().manual_seed(7)) * 4
    swa = kvbridge.encode(x.bfloat16(), "trtllm-fp8", page_size=32, scale=0.037, dialect="swa")
    compress = kvbridge.encode(x, "trtllm-fp8", page_size=32, dialect="compress")
    assert identify_writer(swa, "trtllm-fp8", x, page_size=32, scale=0.037).matches == [
        "swa/bf16@s=0.037: TensorRT-LLM SWA writer"
    ]
    rep = identify_writer(compress, "trtllm-fp8", x, page_size=32, scale=0.037)
    assert rep.matches == ["compress/fp32@s=1: TensorRT-LLM COMPRESS writer"]
    assert rep.to_dict()["num_tokens"] == 32


def test_identify_tells_the_fnuz_writers_apart():
    from safetensors.torch import load_file

    fx = load_file(str(FIXTURES / "fnuz_reference.safetensors"))
    x = fx["p64.input"].float()
    for engine, label in (("vllm", "amax-1e-4/224/bf16: vLLM ROCm gfx942 SWA writer"),
                          ("sglang", "amax-1e-8/240/bf16: SGLang HIP store (gfx942)")):
        rep = identify_writer(fx[f"p64.{engine}"], "model1-fnuz", x, page_size=64)
        assert label in rep.matches  # bf16 values: the fp32-input candidate of the same dialect matches too
        assert {c.dialect for c in rep.candidates if c.matches} == {label.split("/bf16")[0]}
        assert all(c.differing_bytes > 0 for c in rep.candidates if not c.matches)


def test_identify_sglang_trtllm_uniform_fp8_is_the_trtllm_writer_at_unit_scale():
    # SGLang's trtllm backend stores bf16 rows as e4m3 at scale 1 (saturating): TensorRT-LLM's writers at s = 1
    x = (torch.randn(16, 512, generator=torch.Generator().manual_seed(9)) * 200).bfloat16().float()
    pages = kvbridge.encode(x, "sglang-uniform-fp8", page_size=16, dialect="compress")
    assert bool((pages == 0x7E).any())  # values beyond 448 saturate
    # SGLang's compressed-row store (DeepSeekV4UniformFP8KVPool.set_key_buffer_fused): bf16 .to(float8_e4m3fn)
    assert torch.equal(pages.view(16, 512), x.bfloat16().to(torch.float8_e4m3fn).view(torch.uint8))
    rep = identify_writer(pages, "trtllm-fp8", x, page_size=16)
    assert "compress/bf16@s=1: SGLang --dsv4-attn-backend trtllm (unit scale)" in rep.matches
    assert "swa/bf16@s=1: TensorRT-LLM SWA writer" in rep.matches


def test_identify_ignores_pad_bytes_and_checks_arguments():
    x = tiles_with_small_amax()[:5]
    pages = kvbridge.encode(x, "trtllm-fp8-ds-mla", page_size=8, dialect="amax-1e-8")
    lay = kvbridge.get_layout("trtllm-fp8-ds-mla")
    pages[0, lay.field_offset("pad", 2, 8)] = 0xAB  # TensorRT-LLM never writes the pad byte
    pages[0, lay.field_offset("nope", 6, 8)] = 0x55  # a row past the 5 tokens: not compared
    assert {c.dialect for c in identify_writer(pages, lay, x, page_size=8).candidates if c.matches} == {"amax-1e-8"}
    with pytest.raises(InputError, match="values must be"):
        identify_writer(pages, lay, x[:, :448], page_size=8)
    with pytest.raises(InputError, match="exceeds"):
        identify_writer(pages, lay, x, page_size=8, num_tokens=6)


def test_identify_indexer_writer_names_the_engine():
    from safetensors.torch import load_file

    from kvbridge.conformance import identify_indexer_writer

    sg = load_file(str(FIXTURES / "sglang_indexer_reference.safetensors"))
    report = identify_indexer_writer(sg["fp4.sglang-triton.pages"], "fp4", sg["keys"], page_size=64,
                                     slots=sg["slots"])
    assert report.matches == ["sglang-triton: SGLang Triton quantize_fp4_indexer_tensor"]
    vl = load_file(str(FIXTURES / "vllm_indexer_reference.safetensors"))
    report = identify_indexer_writer(vl["fp8.vllm-ue8m0.pages"], "fp8", vl["fp8.vllm-ue8m0.page_keys"], page_size=64,
                                     slots=vl["fp8.vllm-ue8m0.slots"])
    assert report.matches == ["vllm-ue8m0: vLLM on SM100 (UE8M0 scales)"]
    rocm = identify_indexer_writer(sg["fp8.sglang-rocm.pages"], "fp8", sg["keys"], page_size=64, slots=sg["slots"])
    assert rocm.matches == ["sglang-rocm: SGLang ROCm store"]
    gfx942 = identify_indexer_writer(sg["fp8.sglang-rocm-fnuz.pages"], "fp8", sg["keys"], page_size=64,
                                     slots=sg["slots"])
    assert gfx942.matches == ["sglang-rocm-fnuz: SGLang ROCm store on gfx942 (E4M3 FNUZ)"]
    with pytest.raises(InputError, match="slots must be"):
        identify_indexer_writer(sg["fp4.sglang-rne.pages"], "fp4", sg["keys"], page_size=64, slots=sg["slots"][:3])
