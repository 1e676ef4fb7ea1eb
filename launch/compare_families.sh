#!/usr/bin/env bash
# Train every learned family on the same CPU budget (configs/cpu_budget.yaml: same data, one epoch, bf16,
# one shared hidden-state cache), search trees for the static-tree families, evaluate on MT-bench.
# Resumable: a stage whose output exists is skipped, so re-running after a crash continues.
# This produced the "families on one CPU budget" section of docs/benchmarks.md (~75 min on 2 cores, +40 min for the 3-epoch Hydra++).
#
#   launch/compare_families.sh            # runs under runs/cmp-<family>, logs in runs/logs/
set -uo pipefail
cd "$(dirname "$0")/.."
S=${SPECDRAFT:-.venv/bin/specdraft}
PY=${PYTHON:-.venv/bin/python}
B="--config configs/cpu_budget.yaml"
mkdir -p runs/logs

train() {  # train <run> <args...>
  local run=$1; shift
  [ -f "runs/$run/export/config.json" ] && { echo "skip train $run"; return; }
  echo "=== train $run $(date +%T)"
  $S train "$@" run_name="$run" > "runs/logs/$run.log" 2>&1 || echo "!!! train $run failed (runs/logs/$run.log)"
}
search() {  # search <run>: stores the throughput-best tree in the export
  grep -q '"tree_search"' "runs/$1/export/config.json" 2>/dev/null && { echo "skip tree-search $1"; return; }
  echo "=== tree-search $1 $(date +%T)"
  $S tree-search --draft "runs/$1/export" > "runs/logs/ts-$1.log" 2>&1 || echo "!!! tree-search $1 failed"
}
evaluate() {  # evaluate <run> <name> [key=value ...]
  local run=$1 name=$2; shift 2
  [ -f "runs/$run/eval/$name/report.json" ] && { echo "skip eval $run $name"; return; }
  echo "=== eval $run $name $(date +%T)"
  $S eval --draft "runs/$run/export" --config configs/eval/cpu_compare.yaml name="$name" "$@" \
    > "runs/logs/ev-$run-$name.log" 2>&1 || echo "!!! eval $run $name failed"
}
searched16() {  # the first 16 nodes grown by the tree search, as tree_choices
  $PY -c "import json; d=json.load(open('runs/$1/tree_search/tree_search.json'));
print(json.dumps([n['choice'] for n in d['nodes'][:16]]).replace(' ', ''))"
}

# Learning rates: the recipes' rates are for GPU runs of several epochs; one CPU epoch (82 steps) needs
# larger steps. Medusa/Hydra/ReDrafter (zero-init MLP blocks): 5e-3, the demo's rate. Hydra++ / CTC (a
# transformer layer inside): 2e-3. Dropout off for Hydra++ (one epoch cannot overfit).
train cmp-medusa --config configs/medusa.yaml $B train.lr=5e-3
train cmp-hydra --config configs/hydra.yaml $B train.lr=5e-3
train cmp-hydra_pp --config configs/hydra_pp.yaml $B train.lr=2e-3 draft.dropout=0.0
train cmp-redrafter --config configs/redrafter.yaml $B train.lr=5e-3
train cmp-ctc --config configs/ctc.yaml $B train.lr=2e-3

for r in cmp-medusa cmp-hydra cmp-hydra_pp; do search $r; done
for r in cmp-medusa cmp-hydra cmp-hydra_pp cmp-redrafter cmp-ctc; do evaluate $r mtbench-cpu; done
for r in cmp-medusa cmp-hydra cmp-hydra_pp; do
  evaluate $r mtbench-cpu-tree16 tree=tree16
  evaluate $r mtbench-cpu-searched16 "tree_choices=$(searched16 $r)"
done
for L in 3 5; do for W in 1 4 8 16; do
  evaluate cmp-redrafter "beam-w$W-l$L" num_prompts=8 max_new_tokens=64 extra.beam_width=$W extra.beam_length=$L
done; done
for r in cmp-medusa cmp-hydra cmp-hydra_pp cmp-redrafter cmp-ctc; do  # fp32: the exact losslessness check
  evaluate $r fp32-lossless dtype=fp32 num_prompts=4 max_new_tokens=64
done
# The learning-free baseline on the same prompts (its best bf16 (k, w) from the N-gram sweep).
if [ ! -f runs/cmp-ngram/eval/mtbench-cpu/report.json ]; then
  echo "=== eval ngram $(date +%T)"
  $S eval --method ngram --config configs/eval/cpu_compare.yaml name=mtbench-cpu run_dir=runs/cmp-ngram \
    extra.k=1 extra.w=2 > runs/logs/ev-cmp-ngram.log 2>&1 || echo "!!! eval ngram failed"
fi
# Hydra++ for 3 epochs from the same cache: what the multi-epoch recipe buys (~37 min).
train cmp-hydra_pp-3ep --config configs/hydra_pp.yaml $B train.lr=2e-3 draft.dropout=0.0 train.epochs=3
search cmp-hydra_pp-3ep
evaluate cmp-hydra_pp-3ep mtbench-cpu-searched16 "tree_choices=$(searched16 cmp-hydra_pp-3ep)"
$PY bench/compare_families.py runs/cmp-medusa runs/cmp-hydra runs/cmp-hydra_pp runs/cmp-hydra_pp-3ep runs/cmp-redrafter runs/cmp-ctc \
  --eval mtbench-cpu --eval mtbench-cpu-searched16 --eval mtbench-cpu-tree16 --eval fp32-lossless --out docs/img/cmp
