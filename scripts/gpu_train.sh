#!/usr/bin/env bash
# Drafter heads trained at scale in ONE GPU call, after back-to-back calls that bring the rest of the target and data.
# What runs there is `specdec-train schedule=gpu` (configs/schedule/gpu.yaml), as a GPU user with the model and
# ShareGPT at hand would run it; this script only brings what our lent machine lacks (the target, the data, Hydra).
#
# Here, once (about 5 minutes on 2 cores; writes the ignored folders .gpu/ and .whl/):
#   the Hydra wheels as scripts/device/wheels.sh says
#   .venv/bin/python -m scripts.device.stage slim    # the bundled heads (most of the tree) stay behind: larger parts
#   .venv/bin/python -m scripts.device.stage stage   # SmolLM2 (exact Q4_1/Q8_0 blocks) + ShareGPT tokens -> .gpu/parts
#     (--target gemma3_270m: Gemma 3: docs/usage.md)
#   .venv/bin/python -m scripts.device.stage plan    # just before the calls: checks the parts still fit, prints the calls
# A call carries the working tree plus its parts within 64 MiB, so a part is what the tree leaves of that; `plan`
# prints one call per part (sizes in docs/usage.md, "Training heads on a lent GPU"), e.g. for two parts:
#   run(command="bash scripts/gpu_train.sh target.path=.gpu/target/smollm2", carry=[".whl", ".gpu/manifest.json", ".gpu/parts/part-00"], timeout_s=60)
#   run(command="bash scripts/gpu_train.sh target.path=.gpu/target/smollm2", carry=[".whl", ".gpu/manifest.json", ".gpu/parts/part-01"], timeout_s=600)
# (add ".whl" to each carry list `plan` prints). Issue them back to back: a machine stays warm only 30 s after a
# call, and a fresh one has none of the earlier parts (the call then lists them as missing: start again from part-00).
# Afterwards, before any commit: .venv/bin/python -m scripts.device.stage unslim (the heads back in git's index).
#
# Every call verifies the parts it has (sha256) and returns in seconds while some are missing. The call that
# completes them joins and verifies the archive, rebuilds the fp32 target bit for bit (checked by digest), and
# runs specdec-train schedule=gpu on it for BUDGET seconds (default 480): the target's own answers for 60 s,
# then EAGLE-3, MTP and Domino on 70/15/15% of the time left, their features computed online (no cache).
# eval.prompts=0: the device has no MT-bench; measure the heads here with specdec-run.
# Expected wall time (not yet measured on the device): a part call a few seconds plus its transfer; the last
# about 8.5 min (20-30 s reassembly and imports, then BUDGET), inside its 600 s timeout.
# Comes back under $OUT (8 files, each under 16 MiB): eagle3/, mtp/, domino/ (config.json + model.safetensors,
# float16; drafter=eagle3 drafter.checkpoint=DIR loads one), results.json (each method's steps, labelled tokens/s,
# epochs, failures) and train.log.
# Extra arguments are specdec-train overrides (e.g. 'schedule.methods=[eagle3]' 'schedule.shares=[1]');
# STAGED names another staging folder.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu-train}
STAGED=${STAGED:-.gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
. scripts/device/wheels.sh
python3 -m scripts.device.stage check "$STAGED"
status=$?
if [ "$status" -eq 3 ]; then
  echo "waiting for the parts listed as missing: carry the next one"
  exit 0
fi
[ "$status" -eq 0 ] || exit "$status"
RUN="$STAGED/runs/$(date +%Y-%m-%d_%H-%M-%S)"
set -o pipefail
python3 -m experiments.train schedule=gpu target=hf data.sequences="$STAGED/payload/sequences.npz" \
  schedule.budget_s="${BUDGET:-480}" eval.prompts=0 output="$OUT" hydra.run.dir="$RUN" "$@" 2>&1 | tee "$OUT/train.log"
status=$?
cp "$RUN/train_results.json" "$OUT/results.json" || status=1
exit "$status"
