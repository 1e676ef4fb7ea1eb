#!/usr/bin/env bash
# The recipe levers the peers report, ablated for EAGLE-3 at equal CPU time on the on-policy store kept in the
# repository (datasets/smollm2-sharegpt-onpolicy: SmolLM2's own answers): the `EAGLE-3 recipe levers` table of
# docs/lab/results.md. Every arm trains for MINUTES of training (train.max_minutes; the LR anneals by that deadline)
# and is judged by decoded acceptance: `specdraft compare --config configs/compare_eagle3_levers.yaml` decodes every
# arm as the same greedy chain of 4 on 16 MT-bench questions and 16 held-out ShareGPT first turns (after the store's
# conversations), whatever its TTT depth (each run also logs `decoded_al` at its own depth in metrics.jsonl,
# train.decode_eval_prompts). Arms:
#   levers-base     the first N records cut at 256 tokens, 3 training-time-test (TTT) steps (the store recipe)
#   levers-ttt1     1 TTT step (no training-time test: depth 1 only, the chain drafts on from its own states)
#   levers-ttt5     5 TTT steps (the same minutes buy fewer optimizer steps)
#   levers-len512   whole conversations up to 512 tokens instead of the 256-token cut (fewer conversations a minute)
#   levers-epochs   N/4 records: ~4x the epochs over a quarter of the data in the same minutes
#   levers-eagle31  EAGLE-3.1's normalisation: an RMSNorm per aux layer before fc and the normed output fed to the
#                   next depth (draft.eagle3.fc_norm, draft.eagle3.norm_output; docs/families/eagle3.md)
# The hidden-state caches are built outside the minutes (one per data cut) and shared by the arms that read them.
#
#   recipes/eagle3_levers.sh                          # N=800 MINUTES=8: ~65 min with the caches and the compare
#   EXTRA="train.num_threads=1" recipes/eagle3_levers.sh   # beside other jobs
#   COMPARE=0 recipes/eagle3_levers.sh                # train only; the table later:
#   specdraft compare --config configs/compare_eagle3_levers.yaml --update-docs
#
# Resumable: a run whose export exists is skipped, an unfinished one continues from its last checkpoint.
set -uo pipefail
cd "$(dirname "$0")/.."
S=${SPECDRAFT:-.venv/bin/specdraft}
mkdir -p runs/logs
. recipes/train_once.sh  # train <run> <args...>

STORE=${STORE:-datasets/smollm2-sharegpt-onpolicy}
N=${N:-800}
MINUTES=${MINUTES:-8}
DECODE=${DECODE:-8}
QUARTER=$((N / 4))
# shellcheck disable=SC2206
B=(--config configs/eagle3.yaml --config configs/cpu_budget.yaml data.source="$STORE" draft.share_lm_head=false
   train.lr=2e-3 train.epochs=50 train.max_minutes="$MINUTES" train.save_every=40 train.decode_eval_prompts="$DECODE"
   resume=auto ${EXTRA:-})
C256=(data.max_records="$N" data.max_length=256 data.hidden_cache="runs/cache/block-$N-256")

train levers-base "${B[@]}" "${C256[@]}"
train levers-ttt1 "${B[@]}" "${C256[@]}" draft.eagle3.ttt_steps=1
train levers-ttt5 "${B[@]}" "${C256[@]}" draft.eagle3.ttt_steps=5
train levers-len512 "${B[@]}" data.max_records="$N" data.max_length=512 data.hidden_cache="runs/cache/levers-$N-512"
train levers-epochs "${B[@]}" data.max_records="$QUARTER" data.max_length=256 \
  data.hidden_cache="runs/cache/levers-$QUARTER-256"
train levers-eagle31 "${B[@]}" "${C256[@]}" draft.eagle3.fc_norm=true draft.eagle3.norm_output=true

for run in base ttt1 ttt5 len512 epochs eagle31; do
  [ -f "runs/levers-$run/export/config.json" ] || { echo "!!! runs/levers-$run has no export: no compare" >&2; exit 1; }
done
if [ "${COMPARE:-1}" = 1 ]; then
  $S compare --config configs/compare_eagle3_levers.yaml --update-docs
fi
exit 0
