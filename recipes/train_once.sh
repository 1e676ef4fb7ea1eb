# Sourced by the recipes in this folder (compare.sh, best.sh, eagle3_cpu.sh, ...; needs $S, the specdraft command).
# train <run> <args...>: `specdraft train ... run_name=<run>`, skipped once runs/<run>/export exists (resumable
# scripts); the log goes to runs/logs/<run>.log and a failure is reported without stopping the script.
train() {
  local run=$1; shift
  [ -f "runs/$run/export/config.json" ] && { echo "skip train $run"; return; }
  echo "=== train $run $(date +%T)"
  $S train "$@" run_name="$run" > "runs/logs/$run.log" 2>&1 || echo "!!! train $run failed (runs/logs/$run.log)"
}

search() {  # search <run>: greedy-grown trees up to 64 nodes; the throughput-best one is stored in the export
  grep -q '"tree_search"' "runs/$1/export/config.json" 2>/dev/null && { echo "skip tree-search $1"; return; }
  echo "=== tree-search $1 $(date +%T)"
  $S tree-search --draft "runs/$1/export" > "runs/logs/ts-$1.log" 2>&1 || echo "!!! tree-search $1 failed"
}
