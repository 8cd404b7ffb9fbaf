#!/usr/bin/env bash
# Creates the SGLang 0.5.23 environment the SGLang adapter test runs the engine's own classes in.
# Usage: .ci/engine-sglang.sh VENV_DIR ; prints nothing on success, the venv's python is VENV_DIR/bin/python.
# SGLang pins torch 2.14.1: torch and torchvision are installed first, pinned together (a plain
# torchvision would swap torch for another build), then the SGLang wheel without its dependencies
# (most are GPU serving stacks the PD classes never import), then what its disaggregation modules
# import, by name.
set -euo pipefail
venv="${1:?usage: engine-sglang.sh VENV_DIR}"
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
"$py" -m pip install -q --no-deps "sglang==0.5.23"
# found by importing the decode side (nixl.conn, deepseek_v4_memory_pool, disaggregation.utils) until
# nothing was missing; torch is repeated so that no dependency may move it. openai and partial_json_parser:
# what sglang.srt.managers.io_struct (GenerateReqInput, tests/test_pd_proxy.py) imports beyond that
"$py" -m pip install -q "torch==2.14.1" "apache-tvm-ffi==0.1.11" "nixl==1.5.1" "transformers==5.19.0" \
    "tokenizers==0.23.2" "sentencepiece==0.2.1" "compressed-tensors==0.18.0" \
    numpy pyzmq requests aiohttp fastapi uvicorn psutil packaging orjson pybase64 msgspec tqdm IPython dill \
    gguf "openai==2.8.0" partial_json_parser
"$py" -c "import torch, nixl._api; assert torch.__version__.startswith('2.14.1'), torch.__version__"
