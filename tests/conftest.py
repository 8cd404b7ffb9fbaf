"""Shared fixtures: the reference vectors copied from ../shared/vectors into fixtures/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def load_vectors(name: str) -> tuple[dict, dict]:
    """Tensors and the parsed ``cases`` metadata of ``fixtures/<name>.safetensors``."""
    path = FIXTURES / f"{name}.safetensors"
    with safe_open(str(path), "pt") as handle:
        cases = json.loads(handle.metadata()["cases"])
    return load_file(str(path)), cases


@pytest.fixture(scope="session")
def model1_vectors():
    return load_vectors("model1_reference")


@pytest.fixture(scope="session")
def trtllm_vectors():
    return load_vectors("trtllm_fp8_reference")


@pytest.fixture(scope="session")
def decode_vectors():
    return load_vectors("model1_decode_reference")
