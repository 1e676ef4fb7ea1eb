#!/usr/bin/env bash
# Every learned family at ONE budget on ONE data set, judged on the field benchmark: docs/lab/field_families.md.
#
# Data: the on-policy store kept in the repository (datasets/smollm2-sharegpt-onpolicy: SmolLM2's own answers), all
# of its records (N), each conversation's first LENGTH = 256 tokens (the shipped draft's cut), read by every family
# from ONE hidden-state cache built with EAGLE-3's aux layers (the families that read only h take it from that cache:
# data/hidden_cache.py find_superset_cache). The cache lives in the work tree, CACHE_ROOT (git-ignored), so a machine
# swap that wipes ~/.cache keeps it; a missing one is rebuilt here (~15-40 min on 2 cores).
#
# Budget: every family trains the same STEPS optimizer steps of 8 conversations (configs/cpu_budget.yaml's batch)
# over the same records in the same order (the data order is a function of seed and step), so every family sees the
# same training tokens. STEPS = 1,880 = the tokens EAGLE-3 trains on in 60 minutes at one thread on the
# AMX Xeon this was set on (bench/eagle3_train_step.py --threads 1 --arms bf16: 1,016 tok/s; 60 min = 3.66M tokens
# = 1,880 steps of 8 conversations of ~243 tokens). Families differ in cost per token, so each run's CPU-minutes
# (user + system time of its training process, every restart summed) and the machine kind are recorded beside it.
# Each family gets its best recipe from its paper and the repository's sweeps (recipes/best.sh's learning rates
# and heads; EAGLE-3 the store recipe: own LM head, lr 2e-3, TTT 3; the block drafters their recipes' lr 6e-4, 128
# anchors a conversation, block size 8). Each family declares its runs in its registration (FamilySpec.field_runs,
# models/families/<family>/__init__.py: config, overrides, label, shapes, queue place, the reference run, a
# diagnostics script); recipes/field_plan.py prints them (`dump`: all, read once into runs/logs/<prefix>-plan.tsv;
# `runs`: the default list, `args` / `label` / `shapes <run>`), and this script names no family:
#   medusa     configs/medusa.yaml     4 heads, weighted CE (decay 0.8), frozen base LM head, lr 5e-3
#   hydra      configs/hydra.yaml      4 sequentially dependent heads, frozen base LM head, lr 5e-3
#   hydra_pp   configs/hydra_pp.yaml   4 blocks a head, prefix attention, teacher loss, dropout 0.2, lr 2e-3
#   redrafter  configs/redrafter.yaml  RNN draft head, 2 ResBlocks, 5 depths, lr 5e-3
#   ctc        configs/ctc.yaml        attention module + 6 frames, CTC loss on distilled labels + 0.1 token CE, lr 2e-3
#   eagle3     configs/eagle3.yaml     the store recipe (draft.share_lm_head=false, lr 2e-3)
#   peagle     P-EAGLE, an EAGLE-3 option (4 tokens from one forward); not in the default list
#   dflash     configs/dflash.yaml     block 8 (7 drafted slots), lr 6e-4, 32 anchors (docs/lab/field_families/notes.md)
#   dspark     configs/dspark.yaml     block 8, lr 6e-4, 32 anchors (docs/lab/field_families/notes.md)
#   domino     configs/domino.yaml     block 8, lr 6e-4, 32 anchors (docs/lab/field_families/notes.md)
# At most JOBS = 2 families at once, each at one thread (train.num_threads=1, OMP/MKL threads 1), under
# nice -n NICE; a family's slot trains it, then judges it. The cache build runs alone first (CACHE_THREADS).
#
# Judging (FIELD=1): `specdraft field --full` (all 1,088 stored answers, fp32, 256 tokens) per shape:
#   medusa, hydra, hydra_pp  chain4 (tree=chain4) and tree16 (the static 16-node tree, tree=tree16), batched
#                            (lockstep) with measured agreement
#   redrafter                chain (1 beam x 5: 4 drafts) and beam8x3 (8 beams of length 3, the best-per-family row)
#   ctc                      chain (1 collapsed path) and paths8 (8 collapsed paths)
#   eagle3 / peagle          chain4 and tree16 (the 16-node dynamic tree), batched (lockstep) with measured agreement
#   dflash, dspark, domino   chain (the default: block - 1 drafts), batched (lockstep) with measured agreement
#   ngram (learning-free, no training; recipes/field_ngram.py): lookup4 (one prompt-lookup row of 4, what serving
#                            engines draft), mixed10x10 (10 rows x 10 tokens, context + the model's bigram table)
#                            and mixed4x4 (the same, 4 x 4: the learned families' 16-node budget)
# each paired (`--against`) with the equal-budget reference's (EAGLE-3's) report of the same kind (chains against its
# chain4, trees against its tree16) once that exists; a last pass adds the pairs the order missed. A shape whose exact path (one
# prompt at a time) would take over FIELD_MAX_MIN minutes is first timed on one prompt of every set (11 prompts,
# field-<shape>/probe.json) and, over the limit, not judged (said loudly in the log; FIELD_MAX_MIN=0 judges it
# anyway). Each report's small files (field.json, field.md, paired.*, the rows xz-compressed) and the run's
# train.json go to REPORTS/<run>/, which recipes/field_families_table.py turns into docs/lab/field_families.md
# (rewritten after every family); the CTC drafter also gets recipes/ctc_diagnostics.py on 10 prompts a set (blank
# rate, collapsed path length, depth-k accuracy: ctc_diagnostics.json).
# Decoded speed (TUNE=1): after its judging, each trained family is tuned on this machine (`specdraft tune --engine
# ours --threads 1`, TUNE_MIN minutes: its fastest shape against its own AR, paired, with the load average; a sweep
# taken above the core count is marked loaded and goes into no claim) and REPORTS/<run>/tuning.json is kept, so the
# results page's speed column survives a machine swap, which takes the export with it.
#
#   setsid nohup recipes/field_families.sh > runs/logs/field-families.log 2>&1 &   # everything, resumable
#   FAMILIES="medusa ctc" recipes/field_families.sh            # some runs (the order is the queue's; default:
#                                                              # recipes/field_plan.py runs)
#   FIELD=0 recipes/field_families.sh                          # train only
#   .venv/bin/python recipes/field_families_table.py           # the table, from REPORTS only (no run needed)
#
# Resumable: a family whose kept reports (REPORTS) already cover every stored answer in every shape is skipped, so a
# fresh clone retrains only what the repository lacks; the cache build skips finished shards; a trained family (runs/<run>/export) is skipped and an
# unfinished one continues from its last checkpoint (resume=auto, save_every 40 steps); a judged shape is skipped and a
# half-judged one keeps its rows. Memory: the cache (~11 GB at N = 10,778, LENGTH = 256) is memory-mapped and shared by
# the two runs reading it.
set -uo pipefail
set -f  # no globbing in the override lists
{  # the whole script is read before it runs: editing the file meanwhile cannot derail a running copy
cd "$(dirname "$0")/.."
S=${SPECDRAFT:-.venv/bin/specdraft}
PY=${PYTHON:-.venv/bin/python}
STORE=${STORE:-datasets/smollm2-sharegpt-onpolicy}
REFS=${REFS:-datasets/smollm2-field-refs}
LENGTH=${LENGTH:-256}
STEPS=${STEPS:-1880}
JOBS=${JOBS:-2}
NICE=${NICE:-10}
# The cache build's threads. 1 by default: on a box shared with other jobs at a higher priority, two threads at nice
# 10 stalled (a shard of ~62k tokens took over 15 min, the CPU spent spinning at the threads' barriers while one
# was descheduled); 2 on a quiet machine (~3k tok/s on the 2-core AMX Xeon).
CACHE_THREADS=${CACHE_THREADS:-1}
FIELD=${FIELD:-1}
FIELD_MAX_MIN=${FIELD_MAX_MIN:-60}
# Decoded speed (`specdraft tune`) of each family right after its judging, while its export is on the machine:
# TUNE=1 tunes a run with an export and no kept tuning.json; TUNE=2 also counts a family without one as not done, so
# it retrains (same seed, same steps: the same draft) to be tuned; 0 skips. TUNE_ENGINE ours | vllm | llamacpp | all.
TUNE=${TUNE:-1}
TUNE_MIN=${TUNE_MIN:-20}
TUNE_ENGINE=${TUNE_ENGINE:-ours}
PREFIX=${RUN_PREFIX:-ff}
REPORTS=${REPORTS:-docs/lab/field_families}
mkdir -p runs/logs "$REPORTS"
# Each run's recipe, label, shapes and pairing, as its family declares them (recipes/field_plan.py), read once
PLAN_FILE=runs/logs/$PREFIX-plan.tsv
"$PY" recipes/field_plan.py dump > "$PLAN_FILE" || { echo "!!! recipes/field_plan.py dump failed"; exit 2; }
plan() { awk -F'\t' -v r="$1" -v k="$2" '$1 == r && $2 == k { print $3 }' "$PLAN_FILE"; }  # plan <run|-> <key>
FAMILIES=${FAMILIES:-$(plan - runs)}
HAVE=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1] + '/card.json'))['records'])" "$STORE")
N=${N:-$HAVE}
CACHE_ROOT=${CACHE_ROOT:-runs/cache/field-families-$LENGTH}
TABLE="$PY recipes/field_families_table.py"
TABLE_OUT=${TABLE_OUT:-$([ "$REPORTS" = docs/lab/field_families ] && echo docs/lab/field_families.md || echo "$REPORTS/table.md")}
# Every stored answer, asked for explicitly: `--full` where `specdraft field` has it (its default may be a subset),
# else more prompts a set than any set holds.
if "$S" field --help 2>/dev/null | grep -q -- "--full"; then ALL=(--full); else ALL=(--num-prompts 100000); fi

# What every family shares: data, length, cache, steps, batch (cpu_budget.yaml: 8 conversations), one thread.
# shellcheck disable=SC2206
B=(--config configs/cpu_budget.yaml data.source="$STORE" data.max_records="$N" data.max_length="$LENGTH"
   data.cache_dir="$CACHE_ROOT" data.hidden_cache=auto data.onpolicy_heldout=0 train.epochs=50
   train.max_steps="$STEPS" train.max_minutes=0 train.save_every=40 train.num_threads=1 train.decode_eval_prompts=0
   resume=auto ${EXTRA:-})

family_args() {  # the run's config and its recipe's overrides (after the shared ones: they win)
  grep -q "^$1	args	" "$PLAN_FILE" || { echo "field_families: unknown run $1 (known: $(cut -f1 "$PLAN_FILE" |
    grep -v '^-$' | uniq | tr '\n' ' '))" >&2; return 2; }
  plan "$1" args
}
label_of() { plan "$1" label; }  # the row's name in the table
shapes() { plan "$1" shape; }  # shape name and its eval overrides, one per line: chains first

stamp() { echo "$(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"; }

build_cache() {  # the one hidden-state cache, the reference's (EAGLE-3's aux layers: a superset of what the others
  # read), alone on the machine (CACHE_THREADS threads)
  local cfg
  cfg=$(plan "$(plan - reference)" args)
  echo "=== cache start $(stamp)"
  OMP_NUM_THREADS=$CACHE_THREADS MKL_NUM_THREADS=$CACHE_THREADS nice -n "$NICE" "$S" cache \
    --config "${cfg%% *}" "${B[@]}" train.num_threads="$CACHE_THREADS" run_name="$PREFIX-cache" \
    >> runs/logs/$PREFIX-cache.log 2>&1 ||
    { echo "!!! cache build failed (runs/logs/$PREFIX-cache.log)"; return 1; }
  echo "=== cache end $(stamp)"
}

train_family() {  # train_family <fam> <args>: one training run, timed (CPU seconds added to runs/logs/<run>.cpu.tsv)
  local fam=$1 args=$2 run="$PREFIX-$1" cfg t rc start
  [ -f "runs/$run/export/config.json" ] && { echo "skip train $run"; return 0; }
  cfg=${args%% *}
  start=$(date -u +%FT%TZ)
  echo "=== train $run start $(stamp)" | tee -a "runs/logs/$run.log"
  t=$(mktemp)
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 /usr/bin/time -f "%e %U %S %M" -o "$t" nice -n "$NICE" \
    "$S" train --config "$cfg" "${B[@]}" ${args#"$cfg"} run_name="$run" >> "runs/logs/$run.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$start" "$(date -u +%FT%TZ)" "$(tail -n1 "$t" | tr ' ' '\t')" "$rc" >> "runs/logs/$run.cpu.tsv"
  rm -f "$t"
  echo "=== train $run end rc=$rc $(stamp)" | tee -a "runs/logs/$run.log"
  [ "$rc" = 0 ] || { echo "!!! train $run failed (runs/logs/$run.log)"; return 1; }
  $TABLE collect --run "$run" --family "$fam" --label "$(label_of "$fam")" --reports "$REPORTS" \
    --command "FAMILIES=$fam recipes/field_families.sh" >> "runs/logs/$run.log" 2>&1
}

against_of() {  # the equal-budget reference report a shape is paired with (empty: none yet, or the reference itself)
  local ref
  ref=$(plan "$1" "against:$2")
  [ -n "$ref" ] && [ -f "runs/$PREFIX-${ref% *}/field-${ref#* }/field.json" ] && echo "runs/$PREFIX-${ref% *}/field-${ref#* }"
}

probe() {  # probe <run> <out> <log> <overrides...>: one prompt of every set, timed (<out>/probe.json)
  local run=$1 out=$2 log=$3
  shift 3
  echo "=== field probe $run ${out##*/} $(stamp)" | tee -a "$log"
  OMP_NUM_THREADS=1 nice -n "$NICE" "$S" field --draft "runs/$run/export" --refs "$REFS" --num-prompts 1 \
    --out "$out-probe" "$@" use_tuning=false num_threads=1 >> "$log" 2>&1 &&
    $TABLE probe --report "$out-probe" --refs "$REFS" --out "$out/probe.json" >> "$log" 2>&1
}

judge_shape() {  # judge_shape <fam> <shape> <overrides...>
  local fam=$1 shape=$2 run="$PREFIX-$1" out against pair=() log est
  shift 2
  out="runs/$run/field-$shape"
  log="runs/logs/field-$run-$shape.log"
  against=$(against_of "$fam" "$shape")
  [ -n "$against" ] && pair=(--against "$against")
  if $TABLE done --report "$out" --refs "$REFS" ${against:+--paired}; then
    echo "skip field $run $shape"
  else
    if [ "$FIELD_MAX_MIN" -gt 0 ] && [ "$(plan "$fam" batched)" != 1 ] && ! $TABLE done --report "$out" --refs "$REFS"; then
      # the exact path, one prompt at a time: time one prompt of every set first
      if [ ! -f "$out/probe.json" ]; then
        probe "$run" "$out" "$log" "$@"
        est=$($TABLE probe-minutes --probe "$out/probe.json" 2>/dev/null || echo 0)
        if [ "${est%.*}" -gt "$FIELD_MAX_MIN" ]; then  # again, the field cache of these prompts now built
          rm -rf "$out-probe" "$out/probe.json"
          probe "$run" "$out" "$log" "$@"
        fi
      fi
      est=$($TABLE probe-minutes --probe "$out/probe.json" 2>/dev/null || echo 0)
      if [ "${est%.*}" -gt "$FIELD_MAX_MIN" ]; then
        echo "!!! field $run $shape: ~$est min on all prompts ($out/probe.json) > FIELD_MAX_MIN=$FIELD_MAX_MIN: not judged"
        mkdir -p "$REPORTS/$run/field-$shape" && cp "$out/probe.json" "$REPORTS/$run/field-$shape/"
        return
      fi
    fi
    echo "=== field $run $shape start $(stamp)" | tee -a "$log"
    OMP_NUM_THREADS=1 nice -n "$NICE" "$S" field --draft "runs/$run/export" --refs "$REFS" "${ALL[@]}" --out "$out" \
      "${pair[@]}" "$@" use_tuning=false num_threads=1 >> "$log" 2>&1 ||
      { echo "!!! field $run $shape failed ($log)"; return; }
    echo "=== field $run $shape end $(stamp)" | tee -a "$log"
    $TABLE done --report "$out" --refs "$REFS" || echo "!!! field $run $shape: the report does not cover every stored answer"
  fi
  $TABLE keep --report "$out" --dest "$REPORTS/$run/field-$shape" >> "$log" 2>&1 ||
    echo "!!! keeping $out failed ($log)"
}

judge_family() {
  local fam=$1 line run="$PREFIX-$1" diag
  [ "$FIELD" = 1 ] || return 0
  [ -f "runs/$run/export/config.json" ] || return 0
  while read -r line; do
    # shellcheck disable=SC2086
    [ -n "$line" ] && judge_shape "$fam" $line
  done < <(shapes "$fam")
  diag=$(plan "$fam" diagnostics)  # its own diagnostics script, if it declares one (CTC: blanks, collapse, depths)
  if [ -n "$diag" ] && [ ! -f "$(diagnostics_of "$fam")" ]; then
    OMP_NUM_THREADS=1 nice -n "$NICE" "$PY" "$diag" --draft "runs/$run/export" --refs "$REFS" \
      --num-prompts 10 --out "$(diagnostics_of "$fam")" > "runs/logs/diagnostics-$run.log" 2>&1 ||
      echo "!!! $diag failed (runs/logs/diagnostics-$run.log)"
  fi
}

tune_family() {  # tune_family <fam>: its decoded speed against its own AR (`specdraft tune`, one thread, the
  # load recorded and a loaded sweep marked as such), kept as REPORTS/<run>/tuning.json for the results page
  local fam=$1 run="$PREFIX-$1" dest="$REPORTS/$PREFIX-$1/tuning.json" log="runs/logs/tune-$PREFIX-$1.log"
  [ "$TUNE" != 0 ] || return 0
  [ -f "runs/$run/export/config.json" ] || return 0
  [ -f "$dest" ] && { echo "skip tune $run"; return 0; }
  echo "=== tune $run start $(stamp)" | tee -a "$log"
  OMP_NUM_THREADS=1 nice -n "$NICE" "$S" tune --draft "runs/$run/export" --engine "$TUNE_ENGINE" --threads 1 \
    --budget-minutes "$TUNE_MIN" --name field-families >> "$log" 2>&1 || { echo "!!! tune $run failed ($log)"; return; }
  mkdir -p "${dest%/*}" && cp "runs/$run/export/tuning.json" "$dest"
  echo "=== tune $run end $(stamp)" | tee -a "$log"
}

diagnostics_of() {  # diagnostics_of <fam>: where its diagnostics go, REPORTS/<run>/<script's stem>.json
  local diag
  diag=$(plan "$1" diagnostics)
  diag=${diag##*/}
  echo "$REPORTS/$PREFIX-$1/${diag%.py}.json"
}

judge_free() {  # judge_free <fam> <script>: a learning-free run (no training), judged by its own script on the field
  # benchmark's exact path (N-gram: recipes/field_ngram.py), each shape's overrides its arguments
  local run="$PREFIX-$1" script=$2 line shape out
  [ "$FIELD" = 1 ] || return 0
  while read -r line; do
    shape=${line%% *} out="runs/$run/field-$shape"
    [ -n "$shape" ] || continue
    if $TABLE done --report "$out" --refs "$REFS"; then
      echo "skip field $run $shape"
    else
      echo "=== field $run $shape start $(stamp)"
      # shellcheck disable=SC2086
      OMP_NUM_THREADS=1 nice -n "$NICE" "$PY" $script --refs "$REFS" ${line#"$shape"} --out "$out" \
        >> "runs/logs/field-$run-$shape.log" 2>&1 || { echo "!!! field $run $shape failed"; continue; }
      echo "=== field $run $shape end $(stamp)"
    fi
    $TABLE keep --report "$out" --dest "$REPORTS/$run/field-$shape" > /dev/null
  done < <(shapes "$1")
}

kept_complete() {  # kept_complete <fam>: judged (kept_judged) and, with TUNE=2, tuned: nothing to train, judge or
  # tune again, on this machine or a fresh one
  kept_judged "$1" && { [ "$TUNE" != 2 ] || [ -f "$REPORTS/$PREFIX-$1/tuning.json" ]; }
}

kept_judged() {  # kept_judged <fam>: every shape's report kept in REPORTS covers every stored answer (or was timed
  # and left unjudged), and its diagnostics are kept
  local fam=$1 line shape d run="$PREFIX-$1"
  while read -r line; do
    shape=${line%% *} d="$REPORTS/$run/field-$shape"
    [ -n "$shape" ] || continue
    { $TABLE done --report "$d" --refs "$REFS" || { [ -f "$d/probe.json" ] && [ ! -f "$d/field.json" ]; }; } || return 1
  done <<< "$(shapes "$fam")"  # read whole: the loop may return before its last line
  [ -z "$(plan "$fam" diagnostics)" ] || [ -f "$(diagnostics_of "$fam")" ]
}

one() {  # one run in one slot: train, judge, then the table as it stands
  local args
  if [ "$FIELD" = 1 ] && kept_complete "$1"; then echo "skip $1: its kept reports ($REPORTS) are complete"; return 0; fi
  args=$(family_args "$1") || return 2
  case ${args%% *} in  # a config file: train, then judge; a script: a learning-free run it judges
    *.py) judge_free "$1" "$args" ;;
    # a family judged before (TUNE=2 retrains it to be tuned) keeps its reports: the retrain, same recipe and data
    # order, differs from the judged draft only by the rounding of its thread count
    *) train_family "$1" "$args" && { kept_judged "$1" || judge_family "$1"; } && tune_family "$1" ;;
  esac
  [ "$FIELD" = 1 ] && $TABLE table --reports "$REPORTS" --out "$TABLE_OUT" > /dev/null
}

echo "=== field_families: N=$N LENGTH=$LENGTH STEPS=$STEPS JOBS=$JOBS FAMILIES=$FAMILIES $(stamp)"
[ -n "$FAMILIES" ] || { echo "!!! no runs to do (FAMILIES, or recipes/field_plan.py runs)"; exit 2; }
for fam in $FAMILIES; do family_args "$fam" > /dev/null || exit 2; done  # an unknown run fails before the cache
build_cache || exit 1
running=0
for fam in $FAMILIES; do
  one "$fam" &
  running=$((running + 1))
  if [ "$running" -ge "$JOBS" ]; then wait -n; running=$((running - 1)); fi
done
wait
for fam in $FAMILIES; do kept_judged "$fam" || judge_family "$fam"; done  # the pairs against EAGLE-3 the order missed (rows are reused)
[ "$FIELD" = 1 ] && $TABLE table --reports "$REPORTS" --out "$TABLE_OUT"
echo "=== field_families done $(stamp)"
exit 0
}
