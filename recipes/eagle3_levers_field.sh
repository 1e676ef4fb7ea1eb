#!/usr/bin/env bash
# The training levers the field reports, for EAGLE-3 at equal CPU time, judged on the field benchmark (the exact
# simulated greedy acceptance on the base's stored answers, datasets/smollm2-field-refs; docs/howto/evaluate.md):
# the `EAGLE-3 levers on the field benchmark` table of docs/lab/results.md.
#
# Every arm trains on the same first N records of the on-policy store (datasets/smollm2-sharegpt-onpolicy), cut at
# 256 tokens, from one shared hidden-state cache (built once, outside the budget), at one thread. Arms whose step
# costs what the base arm's does (a loss, noise, the optimizer) get the same STEPS optimizer steps (= 30 minutes of
# the base arm on a quiet core: equal steps keep the budget equal when other jobs share the machine); EAGLE-3 arms whose
# step costs more (TTT depth, a second layer, P-EAGLE) get the base arm's compute instead: STEPS divided by their step
# cost relative to the base arm's, measured side by side (`bench/eagle3_train_step.py --threads 1 --variant ...`,
# bf16, one thread: ttt5 1.79x, layers2 1.46x, peagle 1.19x on the AVX512-BF16 EPYC). DSpark, another family, gets
# PAIR_MINUTES of training (train.max_minutes: the wall time the base arm's STEPS take with two arms side by side).
# Each arm is judged as a greedy chain of 4 on the first FIELD_PROMPTS stored prompts of every set (30: 330 prompts
# over 11 sets; FIELD_PROMPTS=0 = all 1,088), with a paired interval against the base arm
# (`specdraft field --against`). Arms (ARMS=... picks some; all by default):
#   base      the store recipe: soft CE to the base (forward KL), TTT 3, AdamW, lr 2e-3
#   noise     + Gaussian noise (std 0.05) on the aux hidden states in training (draft.eagle3.aux_noise_std)
#   tv        total-variation distillation instead of KL (loss.eagle3.divergence=tv)
#   rkl       reverse KL (loss.eagle3.divergence=rkl)
#   muon      the Muon optimizer for the 2-D weights (train.optimizer=muon)
#   ttt5      5 TTT steps (STEPS / 1.79)
#   lk        the LK hybrid (loss.eagle3.divergence=lk_lambda: λ·KL + (1-λ)·TV, λ = exp(-3·α), arXiv 2602.23881)
#   dspark_mix DSpark's mix, 0.1·CE + 0.9·TV
#   vocab32k  a 32,768-token draft vocabulary (the most frequent tokens) instead of 16,384: a wider LM head, so
#             each step costs more than the base arm's (equal steps favour it; its tokens/s is in its metrics)
#   layers2   2 decoder layers (draft.eagle3.num_layers=2: a plain decoder layer after the first, starting as the
#             identity); STEPS / 1.46
#   peagle    P-EAGLE: the same layer drafts 4 tokens in one forward (draft.eagle3.parallel_drafting, K = 4;
#             docs/families/eagle3.md), STEPS / 1.19
#   dspark_family the DSpark family (configs/dspark.yaml: a block drafter, its recipe's lr 6e-4, 128 anchors a
#             conversation as recipes/block_drafters_equal_data.sh), PAIR_MINUTES of training from the same cache, judged
#             as its default chain (8) in field-chain/ instead of field-chain4/, paired with the base arm all the same
#
#   ARMS="base noise" recipes/eagle3_levers_field.sh       # two arms; rerun to resume or add arms
#   JOBS=2 ARMS="tv rkl" recipes/eagle3_levers_field.sh    # two arms at once, one thread each (2 cores)
# Memory: an arm holds ~8.5 GB (the cache's rows in memory); on a 24 GB machine run at most two arms at once and
# nothing else big beside them (a third job got an arm killed by the kernel's out-of-memory killer).
#
# Resumable: a trained arm is skipped, an unfinished one continues from its last checkpoint; a judged arm is
# skipped (its field rows are resumable too).
set -uo pipefail
set -f  # no globbing: an arm's overrides hold `*` (loss mixtures)
cd "$(dirname "$0")/.."
S=${SPECDRAFT:-.venv/bin/specdraft}
mkdir -p runs/logs
. recipes/train_once.sh  # train <run> <args...>

STORE=${STORE:-datasets/smollm2-sharegpt-onpolicy}
REFS=${REFS:-datasets/smollm2-field-refs}
N=${N:-3500}
STEPS=${STEPS:-870}      # the base arm's steps in 30 min at one thread on a quiet 2-core AVX512-BF16 EPYC (2.07 s)
PAIR_MINUTES=${PAIR_MINUTES:-75}  # 870 base-arm steps took 75-80 min as one of two 1-thread arms on that EPYC
JOBS=${JOBS:-1}
ARMS=${ARMS:-base noise tv rkl muon lk vocab32k dspark_mix ttt5 layers2 peagle dspark_family}
FIELD_PROMPTS=${FIELD_PROMPTS:-30}
CACHE="runs/cache/levers-$N-256"
# shellcheck disable=SC2206
B=(--config configs/cpu_budget.yaml data.source="$STORE" data.max_records="$N"
   data.max_length=256 data.hidden_cache="$CACHE" draft.share_lm_head=false train.lr=2e-3 train.epochs=50
   train.save_every=40 train.num_threads=1 train.decode_eval_prompts=0 resume=auto ${EXTRA:-})
EQ=(train.max_steps="$STEPS")
TIMED=(train.max_minutes="$PAIR_MINUTES")
costed() { echo "train.max_steps=$((STEPS * 100 / $1))"; }  # costed <step cost x100>: the base arm's compute

arm_args() {  # the overrides of one arm
  case $1 in
    base) echo "${EQ[*]}" ;;
    noise) echo "${EQ[*]} draft.eagle3.aux_noise_std=0.05" ;;
    tv) echo "${EQ[*]} loss.eagle3.divergence=tv" ;;
    rkl) echo "${EQ[*]} loss.eagle3.divergence=rkl" ;;
    muon) echo "${EQ[*]} train.optimizer=muon" ;;
    ttt5) echo "$(costed 179) draft.eagle3.ttt_steps=5" ;;
    lk) echo "${EQ[*]} loss.eagle3.divergence=lk_lambda" ;;
    dspark_mix) echo "${EQ[*]} loss.eagle3.divergence=0.1*ce+0.9*tv" ;;
    vocab32k) echo "${EQ[*]} draft.vocab_size=32768" ;;
    layers2) echo "$(costed 146) draft.eagle3.num_layers=2" ;;
    peagle) echo "$(costed 119) draft.eagle3.parallel_drafting=true draft.eagle3.ttt_steps=4" ;;
    dspark_family) echo "${TIMED[*]} train.lr=6e-4 draft.dspark.num_anchors=128" ;;
    *) echo "unknown arm $1" >&2; return 2 ;;
  esac
}

arm_config() {  # the family config an arm starts from (before configs/cpu_budget.yaml)
  case $1 in dspark_family) echo configs/dspark.yaml ;; *) echo configs/eagle3.yaml ;; esac
}

judge() {  # judge <run>: chain of 4 on FIELD_PROMPTS stored prompts a set, paired against the base arm once judged
  local out="runs/$1/field-chain4" against=() some=() chain=(extra.eagle3_mode=chain extra.num_speculative_tokens=4)
  [ "$1" = levers-field-dspark_family ] && { out="runs/$1/field-chain"; chain=(); }  # its default chain
  [ "$FIELD_PROMPTS" -gt 0 ] && some=(--num-prompts "$FIELD_PROMPTS")
  [ -f "runs/$1/export/config.json" ] || return
  if [ "$1" != levers-field-base ] && [ -f runs/levers-field-base/field-chain4/field.json ]; then
    against=(--against runs/levers-field-base/field-chain4)
    [ -f "$out/paired.json" ] && { echo "skip judge $1"; return; }
  else
    [ -f "$out/field.json" ] && { echo "skip judge $1"; return; }
  fi
  echo "=== judge $1 $(date +%T)"
  $S field --draft "runs/$1/export" --refs "$REFS" --out "$out" "${some[@]}" "${against[@]}" "${chain[@]}" \
    use_tuning=false num_threads=1 > "runs/logs/field-$1.log" 2>&1 ||
    echo "!!! judge $1 failed (runs/logs/field-$1.log)"
}

one() {  # train then judge one arm
  local extra
  extra=$(arm_args "$1") || return
  # shellcheck disable=SC2086
  train "levers-field-$1" --config "$(arm_config "$1")" "${B[@]}" $extra
  judge "levers-field-$1"
}

# The cache first, alone (both ranks' arms read it; two builders would race).
[ -f "$CACHE/manifest.json" ] || $S cache --config configs/eagle3.yaml "${B[@]}" run_name=levers-field-cache > runs/logs/levers-field-cache.log 2>&1 ||
  { echo "!!! cache build failed (runs/logs/levers-field-cache.log)" >&2; exit 1; }
running=0
for a in $ARMS; do
  one "$a" &
  running=$((running + 1))
  if [ "$running" -ge "$JOBS" ]; then wait -n; running=$((running - 1)); fi
done
wait
for a in $ARMS; do judge "levers-field-$a"; done  # the pairs the parallel order missed (rows are reused)
