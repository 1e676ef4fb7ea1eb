#!/usr/bin/env bash
# `specdraft tune` on the strongest draft (docs/lab/serving.md, "`specdraft tune` on the strongest draft"): each
# engine's speculation settings against that engine's AR, in interleaved pairs, on MT-bench and on the hidden ShareGPT
# set; the choices land in the export's tuning.json (MT-bench's last, so they are the ones kept). The section's 1B / 8B
# projection for llama.cpp is `python bench/llamacpp_scaling.py --tables-only --rates <the chain's per-depth rates>`.
#
#   recipes/tune_store.sh                               # the draft of recipes/eagle3_store.sh (LENGTH=256 run)
#   DRAFT=runs/<run>/export ENGINES="ours llamacpp" recipes/tune_store.sh
#
# Settings: 4 prompts x 64 new tokens, the default 3 paired repeats, 1 thread (torch for ours; -t/-td for llama.cpp;
# vLLM uses its own), bf16 for ours and vLLM (`fast` on an AVX512-BF16 CPU), llama.cpp on its Q8_0 base with an f16
# draft (the serving lab's hand-picked rows used the same), vLLM without torch.compile (engine starts of ~1 min
# instead of several). Run it on a machine with nothing else running: the pairs cancel slow drift, not a busy
# neighbour.
# Each tune replaces its engine's record; a rerun re-measures (nothing here is skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
S=${SPECDRAFT:-.venv/bin/specdraft}
DRAFT=${DRAFT:-runs/eagle3-store-10778-256/export}
ENGINES=${ENGINES:-ours llamacpp vllm}
SETS=${SETS:-sharegpt mtbench}  # MT-bench last: its choices are the ones tuning.json keeps
COMMON=(--draft "$DRAFT" --num-prompts 4 --max-new-tokens 64 --threads 1)
mkdir -p runs/logs
for set in $SETS; do
  for engine in $ENGINES; do
    case $engine in
      ours) extra=(--budget-minutes 15 dtype=fast) ;;
      llamacpp) extra=(--budget-minutes 15 serve_llamacpp_base_type=q8_0 serve_llamacpp_draft_type=f16) ;;
      vllm) extra=(--budget-minutes 20 --timeout 400 dtype=fast serve_enforce_eager=true) ;;
      *) echo "tune_store: unknown engine $engine (ours, llamacpp, vllm)" >&2; exit 2 ;;
    esac
    echo "== tune $engine on $set: $(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1-3 /proc/loadavg)"
    $S tune "${COMMON[@]}" --engine "$engine" --prompts "$set" --name "$set-$engine" "${extra[@]}" \
      2> >(tee "runs/logs/tune-$set-$engine.log" | grep -v "it/s\]\|s/it\]" >&2)
  done
done
