#!/usr/bin/env bash
# The strongest EAGLE-3 draft of SmolLM2 from the on-policy store kept in the repository
# (datasets/smollm2-sharegpt-onpolicy: the base's own answers to the first ShareGPT conversations, cut at the
# 512-token training length; docs/concepts.md#on-policy-data). The recipe of the 3,328-conversation draft of
# docs/lab/results.md ("The strongest on-policy EAGLE-3"): configs/eagle3.yaml on configs/cpu_budget.yaml, its own
# LM head over the 16k draft vocabulary, lr 2e-3, EPOCHS epochs from the hidden-state cache, a snapshot export every
# EXPORT_EVERY steps (the learning curve), scored on the base's answers to the 64 conversations after the store.
# Two epochs by default: that draft's held-out gain per epoch halved after its second. Costs on the 2-core
# AVX512-BF16 EPYC (bf16), measured: the whole store at 512 tokens is 4.38M tokens an epoch, its cache ~85 min at
# ~860 tok/s; at LENGTH=256, 2.33M tokens (9,590 train conversations), cache 34 min at ~1.1k tok/s, ~2 s a step of 8
# conversations, ~1,200 steps an epoch.
#
#   recipes/eagle3_store.sh                    # every record the store holds now, whole (512 tokens)
#   N=6000 EPOCHS=2 recipes/eagle3_store.sh    # its first 6,000 records (conversations whose first prompt fits)
#   LENGTH=256 EPOCHS=2 MINUTES=75 EXPORT_EVERY=575 RUN=eagle3-store-10778-256 recipes/eagle3_store.sh
#       # the draft of docs/lab/results.md ("EAGLE-3 on the 12,000-conversation store"): each conversation's first
#       # 256 tokens (where MT-bench's first answers live), 75 min of training (2,169 of 2,396 steps, 1.8 epochs)
#   specdraft compare --config configs/compare_store_eagle3.yaml --update-docs   # then decode it and its snapshots
#   LENGTH=256 EPOCHS=1 EXPORT_EVERY=300 RUN=eagle3-store-cont \
#     EXTRA="train.init_from=drafts/smollm2-eagle3-store/export train.lr=5e-4 train.decode_eval_prompts=8" \
#     recipes/eagle3_store.sh
#       # the shipped draft trained one more epoch from its weights (EXTRA: more keys, last, so they win), each
#       # snapshot scored on the field benchmark; export/ is the best-scored one
#
# Resumable: rerun after a kill and training continues from the last checkpoint (resume=auto). The run is named
# after the records it reads, so a store that has grown since trains a new run instead of resuming the old one.
# The hidden-state cache (base forwards over every token once, ~4.3 GB per million tokens) is written inside the
# work tree, runs/cache/<run> (git-ignored), beside the checkpoints, so a machine swap that wipes ~/.cache keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
S=${SPECDRAFT:-.venv/bin/specdraft}
PY=${PYTHON:-.venv/bin/python}
STORE=${STORE:-datasets/smollm2-sharegpt-onpolicy}
# The store's card: the records it holds, and where the held-out slice starts (after every conversation it read).
read -r HAVE SKIP < <("$PY" -c "import json, sys; c = json.load(open(sys.argv[1] + '/card.json'))
print(c['records'], c.get('skip', 0) + c['conversations'])" "$STORE")
N=${N:-$HAVE}
if [ "$N" -gt "$HAVE" ]; then
  echo "eagle3_store: N=$N but $STORE holds $HAVE records; grow it first (the command is its card's extend_with)" >&2
  exit 2
fi
EPOCHS=${EPOCHS:-2}
EXPORT_EVERY=${EXPORT_EVERY:-320}
LENGTH=${LENGTH:-512}  # data.max_length: each conversation's first LENGTH tokens (the store's token budget is 512)
MINUTES=${MINUTES:-0}  # > 0: a training time budget (train.max_minutes): the LR anneals by it, training stops there
RUN=${RUN:-eagle3-store-${N}}
HIDDEN=${HIDDEN:-runs/cache/$RUN}
mkdir -p runs/logs
# The on-policy held-out slice (the 64 conversations after the store, whole answers: no token budget) through vLLM
# when it is installed (`make vllm`); training would generate it with transformers, ~3x slower on this CPU.
if [ -x .venv-vllm/bin/python ]; then
  $S regenerate --base smollm2 --source sharegpt --engine vllm --max-turns 8 --max-new-tokens 256 --token-budget 0 \
    --dtype bf16 --batch-size 64 --skip "$SKIP" --max-records 64 > /dev/null 2> "runs/logs/regen-heldout-$RUN.log" \
    || echo "eagle3_store: the held-out regeneration failed (runs/logs/regen-heldout-$RUN.log); training makes it" >&2
fi
$S train --config configs/eagle3.yaml --config configs/cpu_budget.yaml data.source="$STORE" data.max_records="$N" data.max_length="$LENGTH" \
  data.hidden_cache="$HIDDEN" draft.share_lm_head=false data.onpolicy_heldout=64 train.lr=2e-3 train.epochs="$EPOCHS" train.max_minutes="$MINUTES" train.save_every=40 \
  train.export_every="$EXPORT_EVERY" resume=auto run_name="$RUN" ${EXTRA:-} 2>&1 | tee -a "runs/logs/$RUN.log" \
  | grep --line-buffered -v "step/s\]\|s/step\]"
