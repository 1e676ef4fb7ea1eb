#!/usr/bin/env bash
# The first family comparison (16 MT-bench questions, per-run evals, ReDrafter beam sweep, fp32 losslessness):
# trains through recipes/compare.sh (same budget), then evaluates each export with `specdraft eval`.
# The full comparison (80 questions + held-out ShareGPT, greedy and T=0.7, one run) is recipes/compare.sh.
# Resumable: a stage whose output exists is skipped, so re-running after a crash continues.
# This produced the "families on one CPU budget" section of docs/lab/benchmarks.md (~75 min on 2 cores, +40 min for the 3-epoch Hydra++).
#
#   recipes/compare_families.sh           # runs under runs/cmp-<family>, logs in runs/logs/
set -uo pipefail
cd "$(dirname "$0")/.."
S=${SPECDRAFT:-.venv/bin/specdraft}
PY=${PYTHON:-.venv/bin/python}
mkdir -p runs/logs

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

TRAIN_ONLY=1 recipes/compare.sh  # trains every family + the 3-epoch Hydra++, searches trees (resumable)
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
evaluate cmp-hydra_pp-3ep mtbench-cpu-searched16 "tree_choices=$(searched16 cmp-hydra_pp-3ep)"
$PY bench/compare_families.py runs/cmp-medusa runs/cmp-hydra runs/cmp-hydra_pp runs/cmp-hydra_pp-3ep runs/cmp-redrafter runs/cmp-ctc \
  --eval mtbench-cpu --eval mtbench-cpu-searched16 --eval mtbench-cpu-tree16 --eval fp32-lossless --out docs/lab/img/cmp
