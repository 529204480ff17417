#!/usr/bin/env bash
# What the GPU-readiness work needs a GPU for, as ONE call of the device tool; results land in
# $OUT (default outputs/gpu). Needs only torch, triton and transformers (+ pytest for step 2):
#   run: bash scripts/gpu_check.sh   (expected ~5 min; the steps' timeouts add up to 580 s, under one
#   call's 600 s limit; the first call also pays the machine's start)
# Step 4 projects speedups from SmolLM2's measured EAGLE-3 acceptance on a deep, wide tree
# (docs/data/eagle3-deep-tree/eagle3-d6k8n48-smollm2-t0-results.json: depth 6, top 8, 48 nodes; docs/RESULTS.md) onto the
# 8B T(n) curves; the drafting cost per pass is assumed (--draft-cost, a fraction of T(1)).
# specdec-run's test on the device (tests/test_device_clean.py) needs Hydra, which the device image
# lacks: scripts/device/wheels.sh says how its wheels travel (the test is skipped without them).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
. scripts/device/wheels.sh
export SPECDEC_TRITON_GPU=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
step() { echo "== $1 $(date -u +%H:%M:%S)"; }
step versions
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  > "$OUT/versions.txt" 2>&1
# 1. T(n) of a Llama-3-8B-shaped random-weight target, bf16, n = 1..256 at batch 1, 8, 32
for batch in 1 8 32; do
  step "T(n) batch $batch"
  timeout 70 python3 -m benchmarks.bench_target --random llama3-8b --device cuda --dtype bfloat16 --batch "$batch" \
    --sizes 1 2 4 8 16 32 48 64 96 128 192 256 --context 512 --repeats 10 --out "$OUT/tn-llama8b-b$batch.csv" \
    > "$OUT/tn-llama8b-b$batch.txt" 2>&1 || echo "FAILED T(n) batch $batch"
done
# 2. the Triton verifier compiled for real: bit-equality with the reference, exactness through the loop,
# the first token's distribution through the kernel at the power of TV 0.002 (-o addopts="" runs every
# test of these files, those marked gpu or slow too, which the default options leave out),
# the synthetic workload on CUDA tensors, every drafter kind through the loop on a tiny model on the
# device, specdec-run with target.device=cuda (with Hydra's wheels, above), and verifier=auto's
# warm-up on the device. These files are the tests that put data on a CUDA
# device (the rest, test_exactness.py included, build CPU targets, so a GPU machine adds nothing to
# them). Every test runs and every failure is listed (-rfE), not just the first; -v names each test
# as it finishes, so a run cut short by the timeout still shows how far it got; the split pre-pass's
# tests (test_triton_rows.py) come last, as the least needed. Expected 1-3 min, mostly compiling
# each kernel variant once (a fresh machine has no Triton cache).
step tests
timeout 230 python3 -m pytest -o addopts="" -v -rfE --durations=15 tests/test_triton_verifier.py \
  tests/test_verifier_power.py::test_first_token_through_the_compiled_kernel tests/test_device_clean.py \
  tests/test_select_verifier.py tests/test_triton_rows.py \
  > "$OUT/tests.txt" 2>&1 || echo "FAILED tests (see $OUT/tests.txt)"
# 3. the verify step (noise + verify) at T = 0 and T = 1 against the copy bandwidth and an 8B forward,
# the kernel with the rows' statistics from its walk and split across blocks (where triton_rows.splits
# should switch); SmolLM2's and Llama 3's vocabularies (each compiles its own variants)
step bench_verify
timeout 140 python3 -m benchmarks.bench_verify --vocab 49152 128256 --repeats 10 --csv "$OUT/verify.csv" > "$OUT/verify.txt" 2>&1 || echo "FAILED bench_verify"
# 4. projected speedups at batch 1, 8 and 32
step projection
python3 -m benchmarks.project_speedup --acceptance docs/data/eagle3-deep-tree/eagle3-d6k8n48-smollm2-t0-results.json \
  --profile "$OUT/tn-llama8b-b1.csv" "$OUT/tn-llama8b-b8.csv" "$OUT/tn-llama8b-b32.csv" --draft-cost 0.05 \
  > "$OUT/projection.txt" 2>&1 || echo "FAILED projection"
step done
