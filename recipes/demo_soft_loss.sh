#!/usr/bin/env bash
# The demo's head trained with the soft loss to the base, and its trees per dtype (docs/lab/benchmarks.md, "The demo:
# the soft loss and a tree chosen per machine"). Every arm is the demo's recipe (configs/hydra.yaml + configs/demo.yaml:
# one Hydra head, 3 epochs from the hidden-state cache, 16k draft vocabulary) on ShareGPT's first 3,400 conversations
# cut at 128 tokens, no wall-time cap:
#   wide128      hard labels (loss.teacher_weight=0; also an arm of recipes/demo_data_cuts.sh)
#   wide128-kd05 the soft loss at weight 0.5
#   wide128-kd10 the soft loss at weight 1.0 (what configs/demo.yaml trains with)
#   wide128-kd-l2     1.0 with a second block in the head (draft.num_layers=2)
#   wide128-kd-lr1e2  1.0 at lr 1e-2
#   wide128-store-kd10 1.0 on the base's own answers (the on-policy store in datasets/)
#   wide128-kd10-e4 / -e5  1.0 for 4 / 5 epochs instead of 3
# Each export is decoded with configs/eval/demo.yaml's 4-node tree on EVAL_PROMPTS MT-bench questions (acceptance is
# what counts; speed columns only on an idle machine). Then TREES=1 times the hard-label head's top-1 / top-2 / top-3
# trees in fp32 and bf16 (8 questions each, own AR side by side: needs an idle machine). Resumable: finished arms and
# evals are skipped.
#
#   THREADS=1 recipes/demo_soft_loss.sh
#   grep -H "acceptance_length" runs/cut-wide128*/eval/mtbench-demo/report.md
#   TREES=1 recipes/demo_soft_loss.sh && grep -H -E "acceptance_length|\| speedup " runs/cut-wide128/eval/shape-*/report.md
set -euo pipefail
cd "$(dirname "$0")/.."
S=${SPECDRAFT:-.venv/bin/specdraft}
source recipes/train_once.sh
source recipes/demo_arm.sh   # THREADS (0 = torch's default; 1 beside another CPU job), EVAL_PROMPTS (24)
arm() {  # arm <name> <overrides...>: ShareGPT's first 3,400 conversations cut at 128 tokens
  local name=$1; shift
  demo_arm "cut-$name" data.max_records=3400 data.max_length=128 "$@"
}
arm wide128 loss.teacher_weight=0.0
arm wide128-kd05 loss.teacher_weight=0.5
arm wide128-kd10 loss.teacher_weight=1.0
arm wide128-kd-l2 loss.teacher_weight=1.0 draft.num_layers=2
arm wide128-kd-lr1e2 loss.teacher_weight=1.0 train.lr=1e-2
arm wide128-store-kd10 loss.teacher_weight=1.0 data.source=datasets/smollm2-sharegpt-onpolicy
arm wide128-kd10-e4 loss.teacher_weight=1.0 train.epochs=4
arm wide128-kd10-e5 loss.teacher_weight=1.0 train.epochs=5

[ "${TREES:-0}" = 1 ] || exit 0
for dtype in fp32 bf16; do
  for tree in "[[0]]" "[[0],[1]]" "[[0],[1],[2]]"; do
    nodes=$(echo "$tree" | tr -cd '0-9' | wc -c)
    name="shape-$dtype-$nodes"
    [ -f "runs/cut-wide128/eval/$name/report.md" ] && { echo "skip $name"; continue; }
    echo "=== $name $(date +%T)"
    $S eval --draft runs/cut-wide128/export --config configs/eval/demo.yaml dtype="$dtype" "tree_choices=$tree" \
      hf_baseline=false name="$name" > "runs/logs/eval-cut-wide128-$name.log" 2>&1 || echo "!!! $name failed"
  done
done
