#!/usr/bin/env bash
# The strongest EAGLE-3 draft this CPU makes on on-policy data (docs/concepts.md#on-policy-data): the base's own
# answers to the first N ShareGPT conversations (a slice of the long background regeneration, copied out of its
# file, finished or still being written), the EAGLE-3 recipe with its own LM head over the 16k draft vocabulary,
# several epochs from the hidden-state cache, a snapshot export every EXPORT_EVERY steps (the learning curve), the
# on-policy held-out score on the 64 prompts after the slice. Resumable: rerun it after a kill and training continues
# from the last checkpoint (resume=auto); the snapshots already written stay.
#
#   N=3328 EPOCHS=2 recipes/onpolicy_best.sh
#   specdraft compare --config configs/compare_onpolicy_best.yaml --update-docs    # then decode the snapshots
set -euo pipefail
cd "$(dirname "$0")/.."
S=${SPECDRAFT:-.venv/bin/specdraft}
N=${N:-3328}
EPOCHS=${EPOCHS:-2}
EXPORT_EVERY=${EXPORT_EVERY:-120}
RUN=${RUN:-eagle3-onpolicy-${N}}
REGEN=(--base smollm2 --source sharegpt --max-turns 8 --max-new-tokens 256 --dtype bf16 --batch-size 256)
mkdir -p runs/logs runs/onpolicy
DATA=runs/onpolicy/regen-$N.jsonl
if [ ! -f "$DATA" ]; then  # copied from a longer regeneration with these settings when one holds the slice
  out=$($S regenerate "${REGEN[@]}" --max-records "$N" 2> "runs/logs/regen-$N.log" | tail -1)
  cp "$out.meta.json" "$DATA.meta.json" && cp "$out" "$DATA"
fi
# the on-policy held-out slice through vLLM when it is installed (training would generate it with transformers)
$S regenerate "${REGEN[@]}" --skip "$N" --max-records 64 > /dev/null 2> "runs/logs/regen-heldout-$N.log"
$S train --config configs/eagle3.yaml --config configs/cpu_budget.yaml data.source="$DATA" data.max_records=null \
  draft.share_lm_head=false data.onpolicy_heldout=64 train.lr=2e-3 train.epochs="$EPOCHS" train.save_every=40 \
  train.export_every="$EXPORT_EVERY" resume=auto run_name="$RUN" 2>&1 | tee -a "runs/logs/$RUN.log" \
  | grep --line-buffered -v "step/s\]\|s/step\]"
