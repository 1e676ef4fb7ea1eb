#!/usr/bin/env bash
# Train a draft on N local devices (GPUs, or CPU ranks on a machine without GPUs).
#   launch/train.sh 2 --config configs/medusa.yaml train.lr=5e-4
# Multi-node: add --hostfile launch/hostfile.example (see DeepSpeed's docs) or use launch/slurm.sbatch.
set -euo pipefail
NUM=${1:?usage: launch/train.sh NUM_DEVICES [--config YAML ...] [key=value ...]}
shift
cd "$(dirname "$0")/.."
exec deepspeed --num_gpus "$NUM" launch/train_draft.py "$@"
