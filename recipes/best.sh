#!/usr/bin/env bash
# The best draft per family at <= 2 CPU-hours each (configs/best_budget.yaml: 2400 ShareGPT
# records, 90 min of training from one shared hidden-state cache), then `specdraft compare --config
# configs/compare_best.yaml`, which writes the best-per-family part of docs/lab/results.md (--update-docs).
# Resumable and incremental: the cache build resumes, a run cut short (session end, Ctrl-C) continues from its
# last checkpoint with its clock (resume=auto; the 90 min count across restarts), a finished run is skipped,
# and compare reuses every finished (prompt, method). One family per session fits a 3-hour session:
#
#   FAMILIES="eagle3" recipes/best.sh         # cache (~30 min, once) + EAGLE-3 (90 min) + compare (~20 min)
#   FAMILIES="hydra_pp medusa" TRAIN_ONLY=1 recipes/best.sh
#
# compare_best.yaml lists the families trained so far; add a family's rows there once its export exists.
set -uo pipefail
cd "$(dirname "$0")/.."
S=${SPECDRAFT:-.venv/bin/specdraft}
B="--config configs/cpu_budget.yaml --config configs/best_budget.yaml"
FAMILIES=${FAMILIES:-"eagle3 hydra_pp medusa hydra redrafter ctc"}
mkdir -p runs/logs

. recipes/train_once.sh  # train <run> <args...>, search <run>

echo "=== hidden-state cache $(date +%T)"  # with EAGLE-3's aux layers: every family reads it
$S cache --config configs/eagle3.yaml $B run_name=best-cache > runs/logs/best-cache.log 2>&1 \
  || { echo "!!! cache build failed (runs/logs/best-cache.log)"; exit 1; }

# Recipes: the same-budget learning rates (recipes/compare.sh), which the longer runs anneal with a cosine to the
# deadline; frozen base LM head over the 16k draft vocabulary (configs/cpu_budget.yaml). Hydra++ keeps its
# dropout of 0.2 for the several epochs it now sees.
for f in $FAMILIES; do
  case $f in
    eagle3)    train best-eagle3 --config configs/eagle3.yaml $B train.lr=2e-3 resume=auto ;;
    hydra_pp)  train best-hydra_pp --config configs/hydra_pp.yaml $B train.lr=2e-3 resume=auto ;;
    medusa)    train best-medusa --config configs/medusa.yaml $B train.lr=5e-3 resume=auto ;;
    hydra)     train best-hydra --config configs/hydra.yaml $B train.lr=5e-3 resume=auto ;;
    redrafter) train best-redrafter --config configs/redrafter.yaml $B train.lr=5e-3 resume=auto ;;
    ctc)       train best-ctc --config configs/ctc.yaml $B train.lr=2e-3 resume=auto ;;
    *) echo "unknown family $f (eagle3 hydra_pp medusa hydra redrafter ctc)"; exit 2 ;;
  esac
  case $f in medusa | hydra | hydra_pp) search "best-$f" ;; esac
done
[ "${TRAIN_ONLY:-0}" = 1 ] && exit 0
echo "=== compare $(date +%T)"
$S compare --config configs/compare_best.yaml --update-docs 2>&1 | tee runs/logs/compare-best.log | grep -v "run/s\]\|s/run\]"
