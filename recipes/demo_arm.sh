# Sourced by the demo's experiment recipes (demo_data_cuts.sh, demo_soft_loss.sh), after train_once.sh; needs $S.
# demo_arm <run> <overrides...>: the demo's recipe (configs/hydra.yaml + configs/demo.yaml) with the overrides and no
# wall-time cap, then its export decoded with configs/eval/demo.yaml's 4-node tree on $EVAL_PROMPTS MT-bench
# questions (no `generate` baseline: acceptance is what the arms compare). A finished training or eval is skipped.
THREADS=${THREADS:-0}   # torch threads of training and eval: 0 = torch's default; 1 beside another CPU job
EVAL_PROMPTS=${EVAL_PROMPTS:-24}
mkdir -p runs/logs

demo_arm() {
  local run=$1; shift
  train "$run" --config configs/hydra.yaml --config configs/demo.yaml train.max_minutes=0 \
    train.num_threads="$THREADS" "$@"
  local report="runs/$run/eval/mtbench-demo/report.md"
  [ -f "$report" ] && { echo "skip eval $run"; return; }
  echo "=== eval $run $(date +%T)"
  $S eval --draft "runs/$run/export" --config configs/eval/demo.yaml num_prompts="$EVAL_PROMPTS" \
    num_threads="$THREADS" hf_baseline=false > "runs/logs/eval-$run.log" 2>&1 \
    || echo "!!! eval $run failed (runs/logs/eval-$run.log)"
}
