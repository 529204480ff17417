#!/usr/bin/env bash
# Drafter heads trained at scale in ONE GPU call, after a back-to-back call that brings the rest of the target and data.
#
# Here, once (about 5 minutes on 2 cores; writes the ignored folder .gpu/):
#   .venv/bin/python -m experiments.train.device.stage slim    # the bundled checkpoints (most of the tree) stay behind
#   .venv/bin/python -m experiments.train.device.stage stage   # SmolLM2 (exact Q4_1/Q8_0 blocks) + ShareGPT tokens -> .gpu/parts
#     (--target gemma3_270m: Gemma 3, 5 parts: docs/usage.md)
#   .venv/bin/python -m experiments.train.device.stage plan    # just before the calls: checks the parts still fit, prints the calls
# A call carries the working tree plus its parts within 64 MiB, so a part is what the tree leaves of that. Slim,
# the archive travels in 2 parts, so `plan` prints two calls (sizes in docs/usage.md, "Training heads on a lent GPU"):
#   run(command="bash scripts/gpu_train.sh", carry=[".gpu/manifest.json", ".gpu/parts/part-00"], timeout_s=60)
#   run(command="bash scripts/gpu_train.sh", carry=[".gpu/manifest.json", ".gpu/parts/part-01"], timeout_s=600)
# Issue them back to back: a machine stays warm only 30 s after a call, and a fresh one has none of the
# earlier parts (the call then lists them as missing: start again from part-00). Afterwards, before any commit:
#   .venv/bin/python -m experiments.train.device.stage unslim  # the checkpoints back in git's index (they never left the disk)
#
# Every call verifies the parts it has (sha256) and returns in seconds while some are missing. The call that
# completes them joins and verifies the archive, rebuilds the fp32 target bit for bit (checked by digest),
# and runs experiments/train/device/schedule.py for BUDGET seconds (default 480): the target's own answers for 60 s, then
# EAGLE-3, MTP and Domino on 70/15/15% of the time left, their features computed online (no cache).
# Expected wall time (not yet measured on the device): the first call a few seconds plus its transfer; the
# last about 8.5 min (20-30 s reassembly and imports, then BUDGET), inside its 600 s timeout. With the machine's
# start that is about 11 of a session's 15 device minutes (unslimmed, ten part calls make it 12-14).
# Comes back under $OUT (8 files, each under 16 MiB): eagle3/, mtp/, domino/ (config.json + model.safetensors,
# float16; drafter=eagle3 drafter.checkpoint=DIR loads one), results.json (steps, labelled tokens/s, epochs,
# held-out teacher-forced accuracy, failures) and train.log.
# Extra arguments go to experiments/train/device/schedule.py (e.g. --methods eagle3 --shares 1); STAGED names another staging folder.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu-train}
STAGED=${STAGED:-.gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m experiments.train.device.stage check "$STAGED"
status=$?
if [ "$status" -eq 3 ]; then
  echo "waiting for the parts listed as missing: carry the next one"
  exit 0
fi
[ "$status" -eq 0 ] || exit "$status"
set -o pipefail
python3 -m experiments.train.device.schedule --staged "$STAGED" --out "$OUT" --budget "${BUDGET:-480}" "$@" 2>&1 | tee "$OUT/train.log"
