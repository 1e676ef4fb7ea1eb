#!/usr/bin/env bash
# DFlash at the EAGLE-3 same-budget row's data and tokens (docs/families/dflash.md): the on-policy ablation's 800
# regenerated conversations (runs/onpolicy/regen-800.jsonl, launch/onpolicy_ablation.sh), as many training tokens
# as its EAGLE-3 arm (runs/abl-eagle3-regen), from the same hidden-state cache (the same aux layers [2, 15, 27]),
# 128 anchors a conversation (the 23 GB CPU box's memory), a checkpoint every 10 steps. Resumable: rerun it after a
# kill. Then `specdraft compare --config configs/compare_dflash.yaml --update-docs`.
set -euo pipefail
cd "$(dirname "$0")/.."
S=${SPECDRAFT:-.venv/bin/specdraft}
RUN=${RUN:-dflash-regen}
DATA=runs/onpolicy/regen-800.jsonl
[ -f "$DATA" ] || { echo "no $DATA: run launch/onpolicy_ablation.sh first"; exit 1; }
# the EAGLE-3 arm's token budget (its train.max_tokens: the original-answers arm's epoch)
T=$(.venv/bin/python -c "import yaml; print(yaml.safe_load(open('runs/abl-eagle3-regen/config.yaml'))['train']['max_tokens'])")
mkdir -p runs/logs
$S train --config configs/dflash.yaml --config configs/cpu_budget.yaml data.source="$DATA" data.max_records=null \
  data.onpolicy_heldout=64 draft.num_anchors=128 train.max_tokens="$T" train.save_every=10 \
  resume=auto run_name="$RUN" 2>&1 | tee -a "runs/logs/$RUN.log" | grep --line-buffered -v "step/s\]\|s/step\]"
