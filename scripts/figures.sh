#!/usr/bin/env bash
# The docs/RESULTS.md drafter table: 80 MT-bench first turns, SmolLM2, 32 new tokens (TOKENS=128
# where a row says so), each run interleaving plain and speculative decoding prompt by prompt
# (group_size=1: a burst of outside load then hits both sides alike). Run alone on the machine
# (threads=2 on 2 cores).
set -u
cd "$(dirname "$0")/.."
run() {
  local name=$1; shift
  echo "== $name $(date -u +%H:%M:%S)"
  .venv/bin/specdec-run experiment=mtbench80 max_new_tokens=${TOKENS:-32} threads=2 "$@" hydra.run.dir=outputs/results/$name \
    > outputs/results/$name.log 2>&1 || echo "FAILED $name"
}
run1() { run "$@" group_size=1; }
mkdir -p outputs/results
while pgrep -f "bin/specdec-run" > /dev/null; do sleep 5; done  # measurements never overlap
run medusa-n2-t0 drafter=medusa drafter.total_tokens=2  # group_size 8 when recorded
run1 eagle3-d1-t0 drafter=eagle3 drafter.depth=1 drafter.top_k=1 drafter.total_tokens=1
run1 eagle2-n4-t0 drafter=eagle2 drafter.depth=2 drafter.top_k=2 drafter.total_tokens=4
run1 mtp-d2-t0 drafter=mtp drafter.depth=2
run1 domino-d2-t0 drafter=domino drafter.depth=2
run1 eagle3-d1-t1 drafter=eagle3 drafter.depth=1 drafter.top_k=1 drafter.total_tokens=1 sampling=sample
run1 eagle3-d1-t1-iid drafter=eagle3 drafter.depth=1 drafter.top_k=1 drafter.total_tokens=1 drafter.sampling=sampled_iid sampling=sample
run1 medusa-n2-t1 drafter=medusa drafter.total_tokens=2 sampling=sample
run1 eagle-d1-t1 drafter=eagle drafter.depth=1 sampling=sample
run1 eagle2-n4-t1 drafter=eagle2 drafter.depth=2 drafter.top_k=2 drafter.total_tokens=4 sampling=sample
run1 ngram-self-t0 drafter=ngram_self
run1 eagle3-d2-t0 drafter=eagle3 drafter.depth=2 drafter.top_k=1 drafter.total_tokens=2
run1 domino-d2-t1 drafter=domino drafter.depth=2 sampling=sample
run1 mtp-d2-t1 drafter=mtp drafter.depth=2 sampling=sample
run eagle3-d1-t0-b4 drafter=eagle3 drafter.depth=1 drafter.top_k=1 drafter.total_tokens=1 batch_size=4 group_size=80
# after the packed-GEMM / grouped-attention change (issue 8, item 3): the batch-1 and batch-4 rows again
run1 eagle3-d1-t0-v2 drafter=eagle3 drafter.top_k=1 drafter.total_tokens=1
run1 eagle2-n4-t0-v2 drafter=eagle2 drafter.depth=2 drafter.top_k=2 drafter.total_tokens=4
run eagle3-d1-t0-b4-v2 drafter=eagle3 drafter.top_k=1 drafter.total_tokens=1 batch_size=4 group_size=80
# self-speculation without weights (issue 6): both layer-skip variants at T=0 and T=1, ngram_self at T=1
run1 layerskip-skip-t0 drafter=layerskip
run1 layerskip-exit-t0 drafter=layerskip drafter.variant=early_exit
run1 ngram-self-t1 drafter=ngram_self sampling=sample
run1 layerskip-skip-t1 drafter=layerskip sampling=sample
run1 layerskip-exit-t1 drafter=layerskip drafter.variant=early_exit sampling=sample
# 2026-11-30, 433ee69 (every row from here to the end): EAGLE-3 trained on 2.3x the data (drafters/checkpoints/eagle3-smollm2, 750 steps),
# MTP retrained on the same cache (500 steps), EAGLE-3 at a 2-wide depth-1 tree, block verification
run1 eagle3-d1-t0-v3 drafter=eagle3 drafter.top_k=1 drafter.total_tokens=1
run1 eagle3-w2-t0-v3 drafter=eagle3 drafter.depth=1 drafter.top_k=2 drafter.total_tokens=2
run eagle3-d1-t0-b4-v3 drafter=eagle3 drafter.top_k=1 drafter.total_tokens=1 batch_size=4 group_size=80
run1 mtp-d2-t0-v3 drafter=mtp drafter.depth=2
run1 layerskip-skip-t1-block drafter=layerskip sampling=sample verifier=block
# block vs token-level verification on sampled (IID) EAGLE-3 chains of 3 at T=1: the same run twice
run1 eagle3-c3iid-t1-block drafter=eagle3 drafter.depth=3 drafter.top_k=1 drafter.total_tokens=3 drafter.sampling=sampled_iid sampling=sample verifier=block
run1 eagle3-c3iid-t1-token drafter=eagle3 drafter.depth=3 drafter.top_k=1 drafter.total_tokens=3 drafter.sampling=sampled_iid sampling=sample verifier=reference
# the budget chooser (issue 8 item 2) with the retrained EAGLE-3 head: T(n) measured now, acceptance calibrated on 4 prompts
run1 eagle3-auto-t0-v3 drafter=eagle3 drafter.top_k=2 budget.mode=auto
# 2026-11-30, c2793a5 (every row from here to the end): EAGLE-3 and MTP fine-tuned 300 more steps on the same
# ShareGPT cache from 433ee69's checkpoints (specdec-train init=...; docs/RESULTS.md)
run1 eagle3-w2-t0-v4 drafter=eagle3 drafter.depth=1 drafter.top_k=2 drafter.total_tokens=2
run1 eagle3-auto-t0-v4 drafter=eagle3 drafter.top_k=2 budget.mode=auto
run eagle3-d1-t0-b4-v4 drafter=eagle3 drafter.top_k=1 drafter.total_tokens=1 batch_size=4 group_size=80
run1 mtp-d2-t0-v4 drafter=mtp drafter.depth=2
# after T = 0 stopped hashing verifier noise (VerifyNoise.draw(greedy=True)); eagle3's default is now the 2-wide depth-1 tree
run eagle3-d1-t0-b4-v5 drafter=eagle3 drafter.top_k=1 drafter.total_tokens=1 batch_size=4 group_size=80
run1 eagle3-w2-t0-v5 drafter=eagle3
# 2026-11-30, 5b8c47c: EAGLE-3 and MTP fine-tuned 600 more steps on a 3.5x larger ShareGPT cache (docs/RESULTS.md);
# the union drafter (EAGLE-3's 2-wide tree + the request's own n-gram continuation, one verification)
run1 eagle3-w2-t0-v6 drafter=eagle3
run1 union-t0-v6 drafter=union
run1 mtp-d2-t0-v6 drafter=mtp drafter.depth=2
run union-t0-b4-v6 drafter=union batch_size=4 group_size=80
run1 union-t1-v6 drafter=union sampling=sample
# 2026-11-30, 139dc4b: traversal vs token-level verification on the same static sampled EAGLE-3 trees at T = 1
run1 eagle3-s8iid-t1-traversal drafter=eagle3 drafter.depth=3 drafter.top_k=2 drafter.total_tokens=8 drafter.sampling=sampled_iid drafter.shape=static sampling=sample verifier=traversal
run1 eagle3-s8iid-t1-token drafter=eagle3 drafter.depth=3 drafter.top_k=2 drafter.total_tokens=8 drafter.sampling=sampled_iid drafter.shape=static sampling=sample verifier=reference
# then EAGLE-3 and MTP fine-tuned on a 1.5x larger ShareGPT cache (docs/RESULTS.md)
run1 union-t0-v7 drafter=union
run union-t0-b4-v7 drafter=union batch_size=4 group_size=80
run1 mtp-d2-t0-v7 drafter=mtp drafter.depth=2
echo "== done $(date -u +%H:%M:%S)"
# 2026-11-30, d033509: retrieval drafting (REST) from the ShareGPT answers, alone and in a budgeted union
# (calibrated acceptance per member node, kept where it pays at the measured T(n)); the union again beside it
run1 union-t0-v8 drafter=union
run1 union-retrieval-t0-v8 drafter=union_retrieval
run1 retrieval-t0-v8 drafter=retrieval
run1 union-t1-v8 drafter=union sampling=sample
run1 union-retrieval-t1-v8 drafter=union_retrieval sampling=sample
run union-t0-b4-v8 drafter=union batch_size=4 group_size=80
run union-retrieval-t0-b4-v8 drafter=union_retrieval batch_size=4 group_size=80
# after the T = 1 calibration table was bundled (each step uses the table nearest its temperature)
run1 union-retrieval-t1-v8b drafter=union_retrieval sampling=sample
# batched budgets filling every tree up to the batch's widest (commit 174c58f, reverted in 4a20f64), then the union
run union-retrieval-t0-b4-v8b drafter=union_retrieval batch_size=4 group_size=80
run union-t0-b4-v8b drafter=union batch_size=4 group_size=80
# 2026-12-01, 8c179b3: drafters side by side in one run (rivals), bfloat16 with invariant kernels, Domino retrained
.venv/bin/python -m benchmarks.bench_target --dtype bfloat16 --invariant yes --threads 2 --sizes 1 2 3 4 5 6 8 12 16 24 32 --out docs/data/tn/tn-smollm2-cpu-bf16.csv
.venv/bin/python -m benchmarks.bench_target --dtype float32 --threads 2 --sizes 1 2 3 4 5 6 8 12 16 24 32 --out outputs/results/tn-fp32-v9.csv
run1 union-bf16-t0-v9 target=smollm2_bf16 drafter=union 'rivals=[union_retrieval]'
run union-bf16-t0-b4-v9 target=smollm2_bf16 drafter=union batch_size=4 group_size=40
# the Domino head before retraining, as a rival (recorded with the retrained head at its training output dir).
# Every Domino line of this script ran the miniature head: rerun them in a checkout of 1111c9b, its last commit
mkdir -p outputs/heads/domino-v1
for f in config.json model.safetensors; do git show 382fca9^:drafters/checkpoints/domino-smollm2/$f > outputs/heads/domino-v1/$f; done
run1 domino-vs-eagle3-t0-v9 drafter=domino 'rivals=[{drafter: domino_mini, checkpoint: outputs/heads/domino-v1}, {drafter: eagle3, depth: 2, top_k: 1, total_tokens: 2}, {drafter: domino, depth: 3}, {drafter: eagle3, depth: 3, top_k: 1, total_tokens: 3}]'
run1 union-vs-retrieval-t0-v9 drafter=union 'rivals=[union_retrieval]'
run1 union-vs-retrieval-t1-v9 drafter=union sampling=sample 'rivals=[union_retrieval]'
run1 union-bf16-t1-v9 target=smollm2_bf16 drafter=union sampling=sample 'rivals=[union_retrieval]'
run union-retrieval-bf16-t0-b4-v9 target=smollm2_bf16 drafter=union_retrieval batch_size=4 group_size=40
# Domino's second round (bundled now; recorded with it at outputs/train/domino-ft-v9b/head, the first-round head as `domino`)
run1 domino-b-vs-eagle3-t0-v9 drafter=domino 'rivals=[{drafter: eagle3, depth: 2, top_k: 1, total_tokens: 2}]'
# 2026-12-01, 0eac038: T(n) at batch 4 in bfloat16, the budgeted union priced at the run's batch size
# (cost_batch), invariant prompts prefilled alone on fast kernels; the first run predates both changes
# (code of 81a76f1, its cost-batch rivals via costs=CSV), the others are from e313e10 on
.venv/bin/python -m benchmarks.bench_target --dtype bfloat16 --invariant yes --threads 2 --batch 4 --sizes $(seq 1 16) --out docs/data/tn/tn-smollm2-cpu-bf16-b4.csv
run b4-pricing-v10 target=smollm2_bf16 drafter=union_retrieval batch_size=4 group_size=40 'rivals=[{drafter: union_retrieval, costs: docs/data/tn/tn-smollm2-cpu-bf16-b4.csv}, {drafter: union_retrieval, costs: docs/data/tn/tn-smollm2-cpu-bf16-b4.csv, draft_cost: 0.22}, union]'
run union-retrieval-bf16-t0-b4-v10b target=smollm2_bf16 drafter=union_retrieval batch_size=4 group_size=40 'rivals=[union, {drafter: union_retrieval, cost_batch: 1}, {drafter: union_retrieval, costs: docs/data/tn/tn-smollm2-cpu-bf16-b4.csv}]'
run1 union-retrieval-bf16-t0-v10 target=smollm2_bf16 drafter=union_retrieval 'rivals=[union]'
# the same drafter as the run's drafter and as a rival (40 prompts, 2 groups): the first drafter side pays more
.venv/bin/specdec-run experiment=mtbench80 workload.num_prompts=40 max_new_tokens=32 threads=2 group_size=20 target=smollm2_bf16 drafter=union batch_size=4 'rivals=[union]' hydra.run.dir=outputs/results/position-check-v10
# float32 at batch 4 once small CPU admissions were prefilled one prompt per forward (c91221e)
run union-t0-b4-v10 drafter=union batch_size=4 group_size=40
# 2026-12-01, 8fc5f3c: a request catching up an admitted prompt gets a head call of its own (d337400)
run union-retrieval-bf16-t0-b4-v11 target=smollm2_bf16 drafter=union_retrieval batch_size=4 group_size=40 'rivals=[union]'
# the union with a deeper EAGLE-3 member (49% of drafting steps ended at the tree's end, specdec-analyze)
NG='{name: ngram, num_draft: 5, max_ngram: 4, min_ngram: 2, max_branches: 1, rank: frequency, max_matches: 64}'
run1 union-deeper-bf16-t0-v11 target=smollm2_bf16 drafter=union "rivals=[{drafter: union, members: [{name: eagle3, depth: 2, top_k: 2, total_tokens: 3, sampling: deterministic}, $NG]}, {drafter: union, members: [{name: eagle3, depth: 2, top_k: 2, total_tokens: 4, sampling: deterministic}, $NG]}]"
# after the batch-1 commit stopped copying the root row (plain decoding paid ~1.7 ms per step for a no-op copy)
run1 union-retrieval-bf16-t0-v11 target=smollm2_bf16 drafter=union_retrieval 'rivals=[union]'
# 2026-12-01, ce4519b, on an AMD EPYC (CPU-2-AMD): kernels checked (invariance) and timed (packed_gemm_from=auto) at load
S="1 2 3 4 5 6 8 12 16 24 32"
.venv/bin/python -m benchmarks.bench_target --threads 2 --sizes $S --out docs/data/tn/tn-smollm2-amd-fp32.csv
.venv/bin/python -m benchmarks.bench_target --threads 2 --sizes $S --packed-gemm-from 4 --out outputs/results/tn-amd-fp32-from4.csv
.venv/bin/python -m benchmarks.bench_target --threads 2 --dtype bfloat16 --invariant yes --sizes $S --out docs/data/tn/tn-smollm2-amd-bf16.csv
run1 union-retrieval-bf16-t0-amd12 target=smollm2_bf16 drafter=union_retrieval 'rivals=[union]'
run1 union-fp32-t0-amd12 drafter=union 'rivals=[union_retrieval]'
run1 union-fp32-from4-t0-amd12 drafter=union target.packed_gemm_from=4
run union-retrieval-bf16-t0-b4-amd12 target=smollm2_bf16 drafter=union_retrieval batch_size=4 group_size=40 'rivals=[union]'
NG='{name: ngram, num_draft: 5, max_ngram: 4, min_ngram: 2, max_branches: 1, rank: frequency, max_matches: 64}'
run1 union-wider-bf16-t0-amd12 target=smollm2_bf16 drafter=union "rivals=[{drafter: union, members: [{name: eagle3, depth: 1, top_k: 4, total_tokens: 4, sampling: deterministic}, $NG]}, {drafter: union, members: [{name: eagle3, depth: 1, top_k: 8, total_tokens: 8, sampling: deterministic}, $NG]}]"
mkdir -p outputs/cal
sed 's/top_k: 2/top_k: 4/; s/total_tokens: 2/total_tokens: 4/' configs/drafter/union_retrieval.yaml > outputs/cal/union_retrieval_top4.yaml
.venv/bin/python -m experiments.calibrate_union --members outputs/cal/union_retrieval_top4.yaml --prompts 64 --out outputs/cal/t0-top4.json
.venv/bin/python -m experiments.calibrate_union --members outputs/cal/union_retrieval_top4.yaml --prompts 64 --temperature 1 --out outputs/cal/t1-top4.json
E4='{name: eagle3, checkpoint: null, depth: 1, top_k: 4, total_tokens: 4, sampling: deterministic}'
RT='{name: retrieval, datastore: null, num_draft: 4, max_ngram: 8, min_ngram: 2, max_matches: 256, min_count: 2, min_fraction: 0.05, max_nodes: 12}'
run1 union-top4-bf16-t0-amd12 target=smollm2_bf16 drafter=union_retrieval "rivals=[{drafter: union, members: [$E4, $NG]}, {drafter: union_retrieval, members: [$E4, $NG, $RT], calibration: [outputs/cal/t0-top4.json, outputs/cal/t1-top4.json]}]"
# 2026-12-02, 25cee74 (CPU-2-AMD): heads on the target's packed GEMMs and a leaner commit (46b3430, beea29c);
# a wider budgeted union (EAGLE-3 top 4, two n-gram continuations of 8, retrieval of 6 up to 16 nodes; its
# calibration tables fitted for it) as the run's drafter against the bundled union_retrieval and union
mkdir -p outputs/cal-v13-wide
sed 's/top_k: 2/top_k: 4/; s/total_tokens: 2/total_tokens: 4/; s/num_draft: 5/num_draft: 8/; s/max_branches: 1/max_branches: 2/; s/num_draft: 4/num_draft: 6/; s/max_nodes: 12/max_nodes: 16/' \
  configs/drafter/union_retrieval.yaml > outputs/cal-v13-wide/union_retrieval_wide.yaml
.venv/bin/python -m experiments.calibrate_union --members outputs/cal-v13-wide/union_retrieval_wide.yaml --prompts 64 --out outputs/cal-v13-wide/t0.json
.venv/bin/python -m experiments.calibrate_union --members outputs/cal-v13-wide/union_retrieval_wide.yaml --prompts 64 --temperature 1 --out outputs/cal-v13-wide/t1.json
E4='{name: eagle3, checkpoint: null, depth: 1, top_k: 4, total_tokens: 4, sampling: deterministic}'
NG8='{name: ngram, num_draft: 8, max_ngram: 4, min_ngram: 2, max_branches: 2, rank: frequency, max_matches: 64}'
RT6='{name: retrieval, datastore: null, num_draft: 6, max_ngram: 8, min_ngram: 2, max_matches: 256, min_count: 2, min_fraction: 0.05, max_nodes: 16}'
TOKENS=128 run1 union-retrieval-fp32-t0-128-v13 drafter=union_retrieval "drafter.members=[$E4, $NG8, $RT6]" \
  'drafter.calibration=[outputs/cal-v13-wide/t0.json, outputs/cal-v13-wide/t1.json]' 'rivals=[union_retrieval, union]'
# the bundled drafters with 46b3430 and beea29c, against the amd12 rows (ce4519b) of the same commands
run1 union-retrieval-bf16-t0-v13 target=smollm2_bf16 drafter=union_retrieval 'rivals=[union]'
run1 union-fp32-t0-v13 drafter=union 'rivals=[union_retrieval]'
run union-retrieval-fp32-t0-b4-v13 drafter=union_retrieval batch_size=4 group_size=40 'rivals=[union]'
run union-retrieval-bf16-t0-b4-v13 target=smollm2_bf16 drafter=union_retrieval batch_size=4 group_size=40 'rivals=[union]'
TOKENS=128 run1 union-retrieval-bf16-t0-128-v13 target=smollm2_bf16 drafter=union_retrieval 'rivals=[union]'
TOKENS=128 run union-retrieval-fp32-t0-128-b4-v13 drafter=union_retrieval batch_size=4 group_size=40 'rivals=[union]'
# 2026-12-02, 0618404 (CPU-2-AMD): a GPU-sized EAGLE-3 tree, for its acceptance (committed as
# docs/data/eagle3-deep-tree/eagle3-d6k8n48-smollm2-t0-results.json, which scripts/gpu_check.sh projects from)
TOKENS=64 run1 eagle3-d6k8n48-t0-v14 drafter=eagle3 drafter.depth=6 drafter.top_k=8 drafter.total_tokens=48
# the bundled best drafter with 256-token answers (Spec-Bench lets answers run to 1024)
TOKENS=256 run1 union-retrieval-fp32-t0-256-v14 drafter=union_retrieval 'rivals=[union]'
TOKENS=128 run1 union-deeper-fp32-t0-128-v14 drafter=union "rivals=[{drafter: union, members: [{name: eagle3, depth: 2, top_k: 2, total_tokens: 3, sampling: deterministic}, $NG]}]"
