#!/usr/bin/env bash
# Drafter heads trained at scale in ONE GPU call, after back-to-back calls that bring the target and data.
#
# Here, once (a few minutes on 2 cores; writes the ignored folder .gpu/):
#   .venv/bin/python -m experiments.gpu_stage stage   # SmolLM2 (exact Q4_1/Q8_0 blocks) + ShareGPT tokens -> .gpu/parts
#   .venv/bin/python -m experiments.gpu_stage plan    # just before the calls: checks the parts still fit, prints the calls
# A call carries the working tree plus its parts within 64 MiB, so a part is what the tree leaves of that (the
# bundled checkpoints are most of the tree, the target most of the archive): as staged on 2026-12-03, 11 parts.
# `plan` prints one call per part, in order, all the same command:
#   run(command="bash scripts/gpu_train.sh", carry=[".gpu/manifest.json", ".gpu/parts/part-00"], timeout_s=60)
#   run(command="bash scripts/gpu_train.sh", carry=[".gpu/manifest.json", ".gpu/parts/part-01"], timeout_s=60)
#   ... the same for part-02 to part-09 ...
#   run(command="bash scripts/gpu_train.sh", carry=[".gpu/manifest.json", ".gpu/parts/part-10"], timeout_s=600)
# Issue them back to back: a machine stays warm only 30 s after a call, and a fresh one has none of the
# earlier parts (the call then lists them as missing: start again from part-00).
#
# Every call verifies the parts it has (sha256) and returns in seconds while some are missing. The call that
# completes them joins and verifies the archive, rebuilds the fp32 target bit for bit (checked by digest),
# and runs experiments/gpu_train.py for BUDGET seconds (default 480): the target's own answers for 60 s, then
# EAGLE-3, MTP and Domino on 70/15/15% of the time left, their features computed online (no cache).
# Expected wall time (not yet measured on the device): the part calls a few seconds each plus their transfers;
# the last call about 8.5 min (20-30 s reassembly and imports, then BUDGET), inside its 600 s timeout. With the
# machine's start and ten part calls that is 12-14 of a session's 15 device minutes: BUDGET=420 leaves more margin.
# Comes back under $OUT (8 files, each under 16 MiB): eagle3/, mtp/, domino/ (config.json + model.safetensors,
# float16; drafter=eagle3 drafter.checkpoint=DIR loads one), results.json (steps, labelled tokens/s, epochs,
# held-out teacher-forced accuracy, failures) and train.log.
# Extra arguments go to experiments/gpu_train.py (e.g. --methods eagle3 --shares 1); STAGED names another staging folder.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu-train}
STAGED=${STAGED:-.gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m experiments.gpu_stage check "$STAGED"
status=$?
if [ "$status" -eq 3 ]; then
  echo "waiting for the parts listed as missing: carry the next one"
  exit 0
fi
[ "$status" -eq 0 ] || exit "$status"
set -o pipefail
python3 -m experiments.gpu_train --staged "$STAGED" --out "$OUT" --budget "${BUDGET:-480}" "$@" 2>&1 | tee "$OUT/train.log"
