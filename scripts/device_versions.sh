#!/usr/bin/env bash
# Pre-flight for a lent GPU, on this CPU: the tests scripts/gpu_check.sh runs (under the Triton
# interpreter here), the sm_90 compile of every kernel variant, and the GPU training's tests, in a
# venv holding the device image's library versions (torch 2.11, triton 3.6.0, transformers 5.17.0:
# /work/.library/device/KINDS.md), not the project's pins. numpy stays below 2.3: Triton 3.6's
# interpreter converts one-element arrays to scalars, which newer numpy refuses (the compiled kernel
# never meets that). Downloads about 5 GB once into $VENV (default /tmp/device-versions).
#   run: bash scripts/device_versions.sh   (expected ~6 min after the download)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/device-versions}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.11.0 triton==3.6.0 transformers==5.17.0 "numpy<2.3" scipy safetensors \
  hydra-core==1.3.8 omegaconf==2.3.1 rich pytest pytest-xdist hypothesis pyyaml accelerate matplotlib
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline PYTHONPATH=$PWD
"$VENV/bin/python" -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
# the warnings filter: Triton 3.6's interpreter still warns where numpy < 2.3 deprecates (one test
# turns warnings into errors)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -W "ignore::DeprecationWarning" tests/test_triton_verifier.py \
  tests/test_device_clean.py tests/test_select_verifier.py tests/test_triton_rows.py tests/test_verifier_power.py \
  tests/test_hf_target.py tests/test_decode.py
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_triton_compile.py tests/test_gpu_train.py
