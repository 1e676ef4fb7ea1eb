#!/usr/bin/env bash
# DFlash at the EAGLE-3 same-budget row's data and tokens (docs/families/dflash.md), at block size γ = 16 (the
# recipe) and γ = 8: the on-policy ablation's 800 regenerated conversations, as many training tokens as the
# ablation's arms (one epoch of the original-answers split), the same hidden-state cache (aux layers [2, 15, 27]),
# 128 anchors a conversation (the 23 GB CPU box's memory), a checkpoint every 10 steps. Whatever is missing is
# made, whatever exists is kept, so a rerun after a kill continues:
#   runs/onpolicy/regen-800.jsonl     the base's own answers (recipes/onpolicy_ablation.sh makes the same file)
#   runs/abl-eagle3-regen             EAGLE-3 at that budget (the ablation's regenerated arm)
#   runs/dflash-regen                 DFlash, γ = 16
#   runs/dflash-g8-regen              DFlash, γ = 8 (num_heads = γ - 1 = 7 slots reported)
# Then `specdraft compare --config configs/compare_dflash.yaml --update-docs` (block 16) and
# `... --config configs/compare_dflash_block8.yaml` (block 8); COMPARE=1 runs those of the block sizes trained here.
#   recipes/dflash_budget.sh                      # all of it, ~1.5 h alone on 2 cores
#   GAMMAS="8" recipes/dflash_budget.sh           # one block size
set -uo pipefail
cd "$(dirname "$0")/.."
S=${SPECDRAFT:-.venv/bin/specdraft}
PY=${PY:-.venv/bin/python}
mkdir -p runs/logs runs/onpolicy
. recipes/train_once.sh  # train <run> <args...>

DATA=runs/onpolicy/regen-800.jsonl
if [ ! -f "$DATA" ]; then  # up to 8 turns of 256 tokens, greedy; a longer regeneration with these settings serves it
  echo "=== regenerate 800 conversations $(date +%T) (log runs/logs/regen-800.log)"
  out=$($S regenerate --max-records 800 --max-turns 8 --max-new-tokens 256 --dtype bf16 --batch-size 256 \
        2> runs/logs/regen-800.log | tail -1) || { echo "!!! regenerate failed (runs/logs/regen-800.log)"; exit 1; }
  cp "$out.meta.json" "$DATA.meta.json" && cp "$out" "$DATA"
fi

# The token budget: one epoch of the original answers' train split (configs/cpu_budget.yaml's 800 ShareGPT records),
# what recipes/onpolicy_ablation.sh gives every arm. Tokenizing 800 conversations takes seconds (cached).
T=$($PY - <<'EOF'
import torch
from train.config import load_train_config
from train.distributed import DistInfo
from train.run_inputs import epoch_tokens_of, load_base_and_data

cfg = load_train_config(["configs/hydra.yaml", "configs/cpu_budget.yaml"], [])
_, train_ds, *_ = load_base_and_data(cfg, DistInfo(0, 1, 0, torch.device("cpu")), "fp32")
print(epoch_tokens_of(train_ds))
EOF
) || { echo "!!! could not count the budget's tokens"; exit 1; }
echo "token budget per run: $T"

B="--config configs/cpu_budget.yaml data.source=$DATA data.max_records=null data.onpolicy_heldout=64 train.max_tokens=$T"
train abl-eagle3-regen --config configs/eagle3.yaml $B train.lr=2e-3
for g in ${GAMMAS:-16 8}; do
  run=dflash-regen; [ "$g" = 16 ] || run=dflash-g$g-regen
  train "$run" --config configs/dflash.yaml $B draft.dflash.block_size="$g" draft.num_heads=$((g - 1)) \
    draft.dflash.num_anchors=128 train.save_every=10 resume=auto
done
if [ "${COMPARE:-0}" = 1 ]; then
  for g in ${GAMMAS:-16 8}; do
    c=configs/compare_dflash.yaml; [ "$g" = 16 ] || c=configs/compare_dflash_block$g.yaml
    $S compare --config "$c" --update-docs
  done
fi
exit 0
