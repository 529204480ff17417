#!/usr/bin/env bash
# The docs/RESULTS.md studies at their smallest useful size on 2 CPU cores (4 MT-bench prompts,
# 32 new tokens, each run interleaving plain and speculative decoding), then specdec-analyze.
# Run alone on the machine. The presets' own sizes (8 prompts, 64 tokens) are the fuller version.
set -u
cd "$(dirname "$0")/.."
small="workload.num_prompts=4 max_new_tokens=32 threads=2"
study() {
  local name=$1; shift
  echo "== $name $(date -u +%H:%M:%S)"
  .venv/bin/specdec-run -m "$@" $small hydra.sweep.dir=outputs/studies/$name > outputs/studies/$name.log 2>&1 \
    || echo "FAILED $name"
  .venv/bin/specdec-analyze outputs/studies/$name >> outputs/studies/$name.log 2>&1 || echo "FAILED analyze $name"
}
mkdir -p outputs/studies
while pgrep -f "bin/specdec-run" > /dev/null; do sleep 5; done  # measurements never overlap
study temperature experiment=study_temperature
study drafter-cost experiment=study_drafter_cost drafter=ngram,eagle,eagle2,layerskip,mtp,domino,medusa
study tree-budget experiment=study_tree_budget
study quantized experiment=study_quantized
study context experiment=study_context
echo "== done $(date -u +%H:%M:%S)"
