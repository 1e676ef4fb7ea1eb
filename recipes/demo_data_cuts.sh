#!/usr/bin/env bash
# Which smaller data costs the demo's head the least acceptance (docs/lab/benchmarks.md, "The demo: which data cut"):
# the demo's recipe (configs/hydra.yaml + configs/demo.yaml: one Hydra head, 3 epochs from the hidden-state cache)
# trained on ShareGPT's first conversations cut different ways at ~150k cached tokens (what a slow CPU caches within
# the demo's budget) and at ~300k (what a fast one does):
#   len512     400 conversations cut at 512 tokens (fewer conversations, whole)
#   len256     800 conversations cut at 256 tokens
#   len128   1,700 conversations cut at 128 tokens (the first answers of many conversations)
#   full       800 conversations cut at 512 tokens (the demo's largest shape before this measurement)
#   wide256  1,600 conversations cut at 256 tokens (full's tokens, spent on more first answers)
#   wide128  3,400 conversations cut at 128 tokens (the same, shorter still: the largest shape since)
# Hard labels (loss.teacher_weight=0.0, as configs/demo.yaml had then; the soft loss is recipes/demo_soft_loss.sh's).
# No wall-time cap (train.max_minutes=0), so every arm trains its full 3 epochs however busy the machine is; each
# export is then decoded with the demo's 4-node tree (the head's top-3) on EVAL_PROMPTS MT-bench prompts
# (acceptance is what counts here; the speed columns are only valid on an idle machine; recipes/demo_arm.sh).
# Resumable: a finished arm is skipped.
#
#   recipes/demo_data_cuts.sh
#   grep -H "acceptance_length" runs/cut-*/eval/mtbench-demo/report.md
set -euo pipefail
cd "$(dirname "$0")/.."
S=${SPECDRAFT:-.venv/bin/specdraft}
source recipes/train_once.sh
source recipes/demo_arm.sh   # THREADS (0 = torch's default; 1 beside another CPU job), EVAL_PROMPTS (24)
arm() {  # arm <name> <max_records> <max_length>
  demo_arm "cut-$1" data.max_records="$2" data.max_length="$3" loss.teacher_weight=0.0
}
arm len512 400 512
arm len256 800 256
arm len128 1700 128
arm full 800 512
arm wide256 1600 256
arm wide128 3400 128
