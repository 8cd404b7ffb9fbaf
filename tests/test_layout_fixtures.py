"""Every layout fixture made by a peer's own writer (``fixtures/*.safetensors`` whose metadata has
``entries``, see fixtures/README.md) is reproduced byte for byte by ``kvbridge.encode`` on every
CPU backend, and decodes to the peer's own dequantized values.

A new fixture file with ``entries`` is picked up here with no change to this module.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import kvbridge as kb
from kvbridge.backends import dispatch
from kvbridge.layouts import get_layout

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _entries() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(FIXTURES.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        for entry in json.loads(meta.get("entries", "[]")):
            found.append((path.name, entry))
    return found


ENTRIES = _entries()


@pytest.fixture(scope="module")
def tensors():
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def get(name: str) -> dict[str, torch.Tensor]:
        if name not in cache:
            cache[name] = load_file(str(FIXTURES / name))
        return cache[name]

    return get


def test_fixtures_cover_every_page_size():
    sizes = {e["page_size"] for _, e in ENTRIES}
    assert {1, 3, 61, 64, 256} <= sizes


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize(("file", "entry"), ENTRIES, ids=lambda v: v["pages"] + ":" + v["layout"] if isinstance(v, dict)
                         else v)
def test_encode_reproduces_the_peer_writer(tensors, file, entry, backend, monkeypatch):
    monkeypatch.setenv(dispatch.BACKEND_ENV, backend)
    t = tensors(file)
    x, want = t[entry["input"]], t[entry["pages"]]
    lay = get_layout(entry["layout"])
    got = kb.encode(x, lay, page_size=entry["page_size"], dialect=entry["dialect"],
                    nonfinite=entry.get("nonfinite", "error"))
    assert got.shape == want.shape
    diff = (got != want).nonzero()
    assert diff.numel() == 0, f"{entry['writer']}: {diff.shape[0]} bytes differ, first at {diff[0].tolist()}"
    decoded = kb.decode(want, lay, page_size=entry["page_size"], num_tokens=x.shape[0])
    if "dequant" in entry:  # the peer's dequantizer returns bf16; the products are exact in bf16
        assert torch.equal(decoded, t[entry["dequant"]].float())
