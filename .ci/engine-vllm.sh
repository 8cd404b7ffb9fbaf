#!/usr/bin/env bash
# Create the vLLM 0.33.0 environment the vLLM adapter test runs its engine side in: a separate
# venv (vLLM's resolver would otherwise touch the project's torch). CPU torch first, then the
# vLLM wheel without its dependency list (which pins a CUDA torch), then the packages vLLM imports
# on the scheduler / KV-connector path, by name (transformers, xgrammar, llguidance and numba at the
# versions vLLM declares; none touches torch), then kvbridge itself with its vLLM extra (editable; the
# docs' install line). Prints the venv's python path as the last line.
# Usage: .ci/engine-vllm.sh [VENV_DIR]   (default .ci/venv-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.ci/venv-vllm}"
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q "torch==2.13.0"
"$py" -m pip install -q --no-deps "vllm==0.33.0"
"$py" -m pip install -q packaging psutil pyzmq urllib3 regex numpy cbor2 aiohttp requests \
    openai_harmony openai pillow pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo prometheus_client \
    "xgrammar==0.2.8" fastapi partial_json_parser "llguidance>=1.7.0,<1.8.0" einops "transformers>=5.16.1,<5.21.0"
# kvbridge with its vLLM extra (safetensors, numba, xxhash, nixl: what the connector imports beyond vLLM), after
# the CPU torch, which nixl's CUDA sub-packages must not replace; numba first at the version vLLM declares
"$py" -m pip install -q "numba==0.65.0"
"$py" -m pip install -q -e ".[vllm]"
# vLLM must import its connector and scheduler path, nixl its API, and torch must still be the CPU build
"$py" -c "import torch, nixl._api, vllm.v1.core.sched.scheduler; assert torch.__version__.startswith('2.13.0'), \
torch.__version__"
echo "$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"
