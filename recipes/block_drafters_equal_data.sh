#!/usr/bin/env bash
# Block drafters against EAGLE-3 on the same data for the same minutes (configs/compare_block_eagle3.yaml, the
# `block_drafters` section of docs/lab/results.md): DSpark, DFlash, EAGLE-3 and P-EAGLE (EAGLE-3 with
# draft.eagle3.parallel_drafting: K tokens from one forward, docs/families/eagle3.md#p-eagle-parallel-drafting),
# each trained on the first N records of the on-policy store kept in the repository
# (datasets/smollm2-sharegpt-onpolicy: SmolLM2's own answers), the first LENGTH tokens of each, for MINUTES of
# training (train.max_minutes: the LR anneals by that deadline; the epochs are set high so the clock is what stops
# every run), from one hidden-state cache (all four read the aux layers [2, 15, 27]), each with its own LM head over
# the 16k draft vocabulary (configs/cpu_budget.yaml). Per family the recipe's own settings and learning rate
# (EAGLE-3 and P-EAGLE: lr 2e-3, the store recipe's; DFlash and DSpark: their recipes' 6e-4) and 128 anchors a
# conversation for the block drafters (a 2-core box's memory, as recipes/dflash_budget.sh). P-EAGLE trains K = 4
# depths (its chain of 4 = vLLM's num_speculative_tokens), EAGLE-3 its recipe's 3 TTT steps (decoded as the chain
# of 4 every EAGLE-3 row of docs/lab uses). Then `specdraft compare` decodes each as a chain on 16 MT-bench
# questions in our decoder, EAGLE-3 and P-EAGLE also in vLLM.
#
#   recipes/block_drafters_equal_data.sh                 # N=800 LENGTH=256 MINUTES=30: ~2 h of training + the cache
#   MINUTES=60 recipes/block_drafters_equal_data.sh      # longer runs (new run names: the minutes are in them)
#   COMPARE=0 recipes/block_drafters_equal_data.sh       # train only; later:
#   EXTRA="train.num_threads=1" recipes/block_drafters_equal_data.sh   # more keys for every run (beside other jobs)
#   specdraft compare --config configs/compare_block_eagle3.yaml --update-docs
#   FAMILIES="dflash dspark domino" COMPARE=0 FIELD=5 recipes/block_drafters_equal_data.sh
#       # some families only (Domino too: SpecForge's block drafter with a GRU correction, docs/families/domino.md),
#       # each judged on the field benchmark (the first FIELD stored prompts of every set, its default chain) in
#       # runs/<prefix>-<family>/field-chain/
#
# Resumable: a run whose export exists is skipped, an unfinished one continues from its last checkpoint
# (resume=auto); the compare keeps the rows it has stored. The run names are fixed (runs/block-<family>) because
# configs/compare_block_eagle3.yaml reads them: set RUN_PREFIX to keep two settings apart (and edit the config).
set -uo pipefail
cd "$(dirname "$0")/.."
S=${SPECDRAFT:-.venv/bin/specdraft}
PY=${PYTHON:-.venv/bin/python}
mkdir -p runs/logs
. recipes/train_once.sh  # train <run> <args...>

STORE=${STORE:-datasets/smollm2-sharegpt-onpolicy}
N=${N:-800}
LENGTH=${LENGTH:-256}
MINUTES=${MINUTES:-30}
PREFIX=${RUN_PREFIX:-block}
HIDDEN=${HIDDEN:-runs/cache/$PREFIX-$N-$LENGTH}  # shared by the four runs (same data, same aux layers)
read -r HAVE SKIP < <("$PY" -c "import json, sys; c = json.load(open(sys.argv[1] + '/card.json'))
print(c['records'], c.get('skip', 0) + c['conversations'])" "$STORE")
if [ "$N" -gt "$HAVE" ]; then
  echo "block_drafters: N=$N but $STORE holds $HAVE records" >&2
  exit 2
fi
# The on-policy held-out slice (the 64 conversations after the store) through vLLM when it is installed, before
# any run, so no run's minutes pay for it (training would generate it with transformers otherwise).
if [ -x .venv-vllm/bin/python ]; then
  $S regenerate --base smollm2 --source sharegpt --engine vllm --max-turns 8 --max-new-tokens 256 --token-budget 0 \
    --dtype bf16 --batch-size 64 --skip "$SKIP" --max-records 64 > /dev/null 2> "runs/logs/regen-heldout-$PREFIX.log" \
    || echo "block_drafters: the held-out regeneration failed (runs/logs/regen-heldout-$PREFIX.log); training makes it" >&2
fi

# Same data, same budget, same cache, own LM heads: what every run shares.
B="--config configs/cpu_budget.yaml data.source=$STORE data.max_records=$N data.max_length=$LENGTH
   data.hidden_cache=$HIDDEN data.onpolicy_heldout=64 draft.share_lm_head=false train.epochs=50
   train.max_minutes=$MINUTES train.save_every=40 resume=auto ${EXTRA:-}"
FAMILIES=${FAMILIES:-eagle3 peagle dflash dspark}
# EAGLE-3 first: its run builds the hidden-state cache (outside its training minutes), the others reuse it.
for fam in $FAMILIES; do
  case $fam in
    # shellcheck disable=SC2086
    eagle3) train "$PREFIX-eagle3" --config configs/eagle3.yaml $B train.lr="${LR_EAGLE3:-2e-3}" ;;
    # shellcheck disable=SC2086
    peagle) train "$PREFIX-peagle" --config configs/eagle3.yaml $B train.lr="${LR_EAGLE3:-2e-3}" \
              draft.eagle3.parallel_drafting=true draft.eagle3.ttt_steps=4 ;;
    # shellcheck disable=SC2086
    dflash|dspark|domino) train "$PREFIX-$fam" --config "configs/$fam.yaml" $B train.lr="${LR_BLOCK:-6e-4}" \
              "draft.$fam.num_anchors=128" ;;
    *) echo "block_drafters: unknown family $fam (eagle3 peagle dflash dspark domino)" >&2; exit 2 ;;
  esac
done

if [ "${FIELD:-0}" -gt 0 ]; then  # the field benchmark: each draft's default chain on FIELD prompts of every set
  for fam in $FAMILIES; do
    out="runs/$PREFIX-$fam/field-chain"
    [ -f "runs/$PREFIX-$fam/export/config.json" ] || { echo "!!! runs/$PREFIX-$fam has no export: not judged" >&2; continue; }
    [ -f "$out/field.json" ] && { echo "skip field $PREFIX-$fam"; continue; }
    echo "=== field $PREFIX-$fam $(date +%T)"
    $S field --draft "runs/$PREFIX-$fam/export" --num-prompts "$FIELD" --out "$out" use_tuning=false num_threads=1 \
      > "runs/logs/field-$PREFIX-$fam.log" 2>&1 || echo "!!! field $PREFIX-$fam failed (runs/logs/field-$PREFIX-$fam.log)"
  done
fi

if [ "${COMPARE:-1}" = 1 ]; then
  for run in eagle3 peagle dflash dspark; do
    [ -f "runs/$PREFIX-$run/export/config.json" ] || { echo "!!! runs/$PREFIX-$run has no export: no compare" >&2; exit 1; }
  done
  $S compare --config configs/compare_block_eagle3.yaml --update-docs
fi
exit 0
