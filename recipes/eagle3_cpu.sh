#!/usr/bin/env bash
# EAGLE-3 on the real SmolLM2-135M-Instruct on this 2-core CPU, two runs:
#   cmp-eagle3   the common budget of docs/lab/results.md (configs/cpu_budget.yaml: 800 ShareGPT records -> 660
#                training conversations, 312k tokens, one epoch, 16k draft vocabulary, frozen shared LM head);
#   eagle3-best  the same conversations for 5 epochs from the same hidden-state cache, capped at 55 min of
#                training (the LR anneals by the deadline, train/schedule.py); what an hour of this CPU buys.
# Then MT-bench (80 questions, 64 new tokens, bf16) as a chain of 4 and as a 16-node EAGLE-2 tree, with own AR and
# transformers `generate` in the same run, and the vLLM serve-check of the best run (chain of 3, what it trained).
# Resumable: a finished export / eval report is skipped.
#
#   recipes/eagle3_cpu.sh             # everything (~20 min + ~55 min training, ~40 min evaluating)
#   TRAIN_ONLY=1 recipes/eagle3_cpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
S=${SPECDRAFT:-.venv/bin/specdraft}
mkdir -p runs/logs

. recipes/train_once.sh  # train <run> <args...>
evaluate() {  # evaluate <run> <name> <args...>: MT-bench, bf16, own AR + HF generate side by side
  local run=$1 name=$2; shift 2
  [ -f "runs/$run/eval/$name/report.json" ] && { echo "skip eval $run/$name"; return; }
  echo "=== eval $run $name $(date +%T)"
  $S eval --draft "runs/$run/export" --config configs/eval/mtbench.yaml dtype=bf16 max_new_tokens=64 \
    hf_baseline=true name="$name" "$@" > "runs/logs/eval-$run-$name.log" 2>&1 || echo "!!! eval $run $name failed"
}

# lr 2e-3: one CPU epoch (82 steps) needs larger steps than the GPU recipe's 5e-4 (as Hydra++ / CTC in compare.sh).
train cmp-eagle3 --config configs/eagle3.yaml --config configs/cpu_budget.yaml train.lr=2e-3
train eagle3-best --config configs/eagle3.yaml --config configs/cpu_budget.yaml train.lr=2e-3 \
  train.epochs=5 train.max_minutes=55
[ "${TRAIN_ONLY:-0}" = 1 ] && exit 0
for run in cmp-eagle3 eagle3-best; do
  evaluate $run mtbench-chain4 extra.eagle3_mode=chain extra.num_speculative_tokens=4
  evaluate $run mtbench-tree16 extra.eagle3_mode=tree extra.tree_nodes=16
done
# vLLM + this draft vs vLLM AR on the same prompts (needs `make vllm`); exits 1 if acceptance differs from ours.
$S serve-check --draft runs/eagle3-best/export --config configs/eval/mtbench.yaml dtype=bf16 max_new_tokens=64 \
  num_prompts=16 extra.vllm_enforce_eager=true 2>&1 | tee runs/logs/serve-eagle3-best.log | grep -v "it/s\]"
