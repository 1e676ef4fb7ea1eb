#!/usr/bin/env bash
# Original vs regenerated answers (docs/concepts.md#on-policy-data), everything else equal: the same 800 ShareGPT
# prompts (configs/cpu_budget.yaml), the same recipes and learning rates as recipes/compare.sh, the same number of
# training tokens (the regenerated arm's epochs are scaled to the original arm's token count), for Hydra (the
# demo's family) and EAGLE-3. Every run also scores the draft on the base's own answers to the 64 prompts after
# record 800 (data.onpolicy_heldout), so both kinds of held-out accuracy sit beside the measured acceptance.
# Then `specdraft compare` with configs/compare_onpolicy.yaml (Hydra) and configs/compare_onpolicy_eagle3.yaml (MT-bench
# chain of 4 and 16-node tree, EAGLE-3's chain also in vLLM, the hidden ShareGPT set). Hydra's tree is the static 16-node one for both arms (no per-arm
# search, so the tree cannot favour either). Resumable: finished exports and compare rows are kept.
#
#   recipes/onpolicy_ablation.sh                # regenerate (vLLM when `make vllm` ran), train, search, compare
#   TRAIN_ONLY=1 recipes/onpolicy_ablation.sh
set -uo pipefail
cd "$(dirname "$0")/.."
S=${SPECDRAFT:-.venv/bin/specdraft}
B="--config configs/cpu_budget.yaml data.onpolicy_heldout=64"
mkdir -p runs/logs runs/onpolicy

. recipes/train_once.sh  # train <run> <args...>

train abl-hydra-orig --config configs/hydra.yaml $B train.lr=5e-3
train abl-eagle3-orig --config configs/eagle3.yaml $B train.lr=2e-3

# The base's own answers to the first 800 conversations, up to 8 turns of 256 tokens (a longer regeneration with
# the same settings serves them without generating); copied beside the runs with its metadata.
REGEN=runs/onpolicy/regen-800.jsonl
if [ ! -f "$REGEN" ]; then
  out=$($S regenerate --max-records 800 --max-turns 8 --max-new-tokens 256 --dtype bf16 --batch-size 256 \
        2> runs/logs/regen-800.log | tail -1) || { echo "!!! regenerate failed (runs/logs/regen-800.log)"; exit 1; }
  cp "$out.meta.json" "$REGEN.meta.json" && cp "$out" "$REGEN"
fi

# Same token budget: the regenerated arms train for as many tokens as the original arms' epoch held.
T=$(.venv/bin/python -c "import json; print(json.load(open('runs/abl-hydra-orig/export/config.json'))['train_data']['epoch_tokens'])") \
  || { echo "!!! no epoch_tokens in runs/abl-hydra-orig/export/config.json"; exit 1; }
echo "token budget per run: $T"
train abl-hydra-regen --config configs/hydra.yaml $B train.lr=5e-3 data.source=$REGEN data.max_records=null \
  train.max_tokens=$T
train abl-eagle3-regen --config configs/eagle3.yaml $B train.lr=2e-3 data.source=$REGEN data.max_records=null \
  train.max_tokens=$T
[ "${TRAIN_ONLY:-0}" = 1 ] && exit 0
echo "=== compare $(date +%T)"
for c in compare_onpolicy compare_onpolicy_eagle3; do  # Hydra's arms, then EAGLE-3's (with vLLM), each its own pass
  $S compare --config configs/$c.yaml --update-docs 2>&1 | tee runs/logs/$c.log | grep -v "run/s\]\|s/run\]"
done
