"""``scale="auto"`` keeps a lossless path lossless when one exists: s = 1, else any per-tensor scale
the codes admit (``loss.lossless_scale_candidates``), checked on the whole entry; else amax / 448."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvbridge as kb
from kvbridge.backends.loss_stats import lossless_scale_candidates
from kvbridge.dumps import dumpfile as dump_mod
from kvbridge.dumps.convert import convert_dump, convert_entry
from kvbridge.dumps.dumpfile import DumpEntry, read_dump
from kvbridge.dumps.writer import write_dump


def latents(n: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 512, generator=g) * scale).bfloat16()


@pytest.fixture
def small_chunks(monkeypatch):
    """Stream in chunks of 16 KiB so that an entry takes many chunks."""
    monkeypatch.setattr(dump_mod, "CHUNK_BYTES", 16 * 2**10)


def fp32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


@pytest.mark.parametrize("s0", [0.5, 0.037, 2.0**-7])
def test_round_trip_through_model1_finds_the_source_scale(tmp_path: Path, small_chunks, s0):
    """TensorRT-LLM FP8 at s0 -> MODEL1 (lossless) -> back with auto: the same scale and the same bytes,
    where s = 1 and amax / 448 would both round."""
    n = 700
    pages = kb.encode(latents(n), "trtllm-fp8", page_size=64, scale=s0)
    s0 = fp32(s0)
    src = write_dump(tmp_path / "s.kvd", [DumpEntry(0, "swa", pages, "trtllm-fp8", 64, n, s0, "swa")])
    if convert_dump(src, tmp_path / "m1.kvd", "model1")[0].report.lossless:
        mid = tmp_path / "m1.kvd"
    else:  # MODEL1 keeps no non-power-of-two scale: go through latents (fp32 values, exact)
        values = kb.decode(pages, "trtllm-fp8", page_size=64, num_tokens=n, scale=s0)
        mid = write_dump(tmp_path / "lat.kvd", [DumpEntry(0, "swa", values)])
    rep = convert_dump(mid, tmp_path / "back.kvd", "trtllm-fp8", page_size=64, scale="auto")[0]
    assert rep.report.lossless and rep.report.dst_scale == s0
    back = read_dump(tmp_path / "back.kvd")["layer.0.swa"]
    assert torch.equal(back.data, pages) and back.scale == s0
    entry = read_dump(mid)["layer.0.swa"]
    out, rep = convert_entry(entry, "trtllm-fp8", page_size=64, scale="auto")
    assert rep.lossless and rep.dst_scale == s0 and torch.equal(out.data, pages)


def test_model1_source_with_a_power_of_two_relation_of_tile_scales(tmp_path: Path):
    """MODEL1 values whose tiles' scales differ by powers of two store losslessly at a per-tensor
    scale 2^k that s = 1 does not reach (subnormal codes below it)."""
    x = latents(128, scale=0.004)  # small values: at s = 1 they fall into E4M3's subnormals and round
    m1 = kb.encode(kb.decode(kb.encode(x, "trtllm-fp8", page_size=64, scale=2.0**-10), "trtllm-fp8", page_size=64,
                             scale=2.0**-10), "model1", page_size=64)
    values = kb.decode(m1, "model1", page_size=64)
    _, at_one = kb.transcode(m1, "model1", "trtllm-fp8", src_page_size=64, dst_scale=1.0, report=True)
    assert not at_one.lossless
    entry = DumpEntry(0, "swa", m1, "model1", 64, 128, dialect="flashmla")
    src = write_dump(tmp_path / "m1.kvd", [entry])
    rep = convert_dump(src, tmp_path / "o.kvd", "trtllm-fp8", scale="auto")[0].report
    assert rep.lossless and rep.dst_scale != 1.0
    k = torch.tensor(rep.dst_scale).log2()
    assert k == k.round()  # a power of two
    out = read_dump(tmp_path / "o.kvd")["layer.0.swa"]
    assert torch.equal(kb.decode(out.data, "trtllm-fp8", page_size=64, scale=out.scale), values)


def test_no_lossless_scale_falls_back_to_no_saturation(tmp_path: Path):
    x = latents(300, scale=900.0)
    src = write_dump(tmp_path / "s.kvd", [DumpEntry(0, "kv", x)])
    rep = convert_dump(src, tmp_path / "o.kvd", "trtllm-fp8", page_size=64, scale="auto")[0].report
    assert not rep.lossless and rep.saturated == 0
    assert rep.dst_scale == kb.auto_scale(x.float())


def test_candidates_from_the_codes():
    x = latents(64)
    for s0 in (0.5, 0.037):
        v = kb.decode(kb.encode(x, "trtllm-fp8", page_size=64, scale=s0), "trtllm-fp8", page_size=64, scale=s0)
        found = lossless_scale_candidates(float(v.abs().max()), v[:8], "swa")
        assert fp32(s0) in found and found == sorted(found, reverse=True) and 1.0 not in found
    assert lossless_scale_candidates(0.0, torch.zeros(4, 512), "swa") == []
    m1 = kb.decode(kb.encode(x, "model1", page_size=64), "model1", page_size=64)  # tile scales unrelated to one s
    assert lossless_scale_candidates(float(m1.abs().max()), m1, "swa") == []


@pytest.mark.parametrize("src_name,scale", [("flashmla-model1", None), ("trtllm-fp8", 0.037), ("trtllm-fp8", 3.0)])
def test_transcode_auto_every_amax_implementation(src_name, scale):
    """``kb.transcode(dst_scale="auto")`` through each code-domain amax (numba, the compiled kernels' scalar and
    AVX-512 code) writes the bytes of decoding everything and encoding at ``auto_scale`` of the values; a NaN
    code, a NaN scale byte or a NaN rope word raises the decoded values' error (count and first position)."""
    from kvbridge.backends.reference import check_finite
    from kvbridge.errors import NonFiniteError
    from tests.test_ckernels import implementation, implementations
    from tests.test_native import edge_latents

    src = kb.get_layout(src_name)
    x = edge_latents(9).repeat(6, 1)[:560].clamp(-1e30, 1e30) * 3.0  # 3 chunks of 256 tokens
    pages = kb.encode(x, src, page_size=61, scale=scale)
    args = dict(src_page_size=61, dst_page_size=64, num_tokens=560, src_scale=scale, dst_scale="auto")
    values = kb.decode(pages, src, page_size=61, num_tokens=560, scale=scale)
    want = kb.encode(values, "trtllm-fp8", page_size=64, scale=kb.auto_scale(values))
    bad = []  # (pages, the decoded values' error)
    for field, index in (("nope", 3), ("scale", 5), ("rope", 8)):  # rope bytes 8, 9: bf16 word 4 = 0xFFFF (NaN)
        if field in {f.name for f in src.fields}:
            patched = pages.clone()
            at = src.field_offset(field, 300 % 61, 61) + index  # token 300: the second chunk
            patched[300 // 61, at : at + (2 if field == "rope" else 1)] = 0xFF
            with pytest.raises(NonFiniteError) as err:
                check_finite(kb.decode(patched, src, page_size=61, num_tokens=560, scale=scale))
            bad.append((patched, str(err.value)))
    assert len(bad) == (2 if src.per_tensor_scale else 3)
    for name in implementations():
        with implementation(name):
            assert torch.equal(kb.transcode(pages, src, "trtllm-fp8", **args), want), name
            for patched, message in bad:
                with pytest.raises(NonFiniteError) as got:
                    kb.transcode(patched, src, "trtllm-fp8", **args)
                assert str(got.value) == message, name
