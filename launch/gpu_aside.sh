#!/usr/bin/env bash
# Move what the GPU calls must not carry out of the working tree, and back (docs/howto/gpu_kit.md).
#
#   launch/gpu_aside.sh aside    # before the window's calls: drafts/ -> .gpu-aside/drafts (git-ignored), and
#                                #   docs/lab/img/ -> .gpu-aside/docs/lab/img, and the field-families reports
#   launch/gpu_aside.sh back     # after them: back into the tree
#
# Why: the device tool copies the working tree into every call, 64 MiB in all with what the call carries, and the
# payoff's first call carries 57 MiB of wheels, metadata and half the GGUF; the shipped drafts (drafts/<name>/,
# up to 32 MiB each, tracked so a fresh clone can use them) would push it over, and the lab notes' plots (3 MiB)
# and the field-families reports (~0.4 MiB a family, growing) would leave it no room. No call reads them.
# The list of paths is `leave_aside` in launch/gpu_calls.json.
set -euo pipefail
cd "$(dirname "$0")/.."
paths=$(python3 -c "import json; print(' '.join(json.load(open('launch/gpu_calls.json')).get('leave_aside', [])))")
case ${1:-} in
  aside)
    mkdir -p .gpu-aside
    for p in $paths; do
      [ -e "$p" ] || continue
      [ -e ".gpu-aside/$p" ] && { echo "gpu_aside: .gpu-aside/$p exists already: run \`$0 back\` first" >&2; exit 1; }
      mkdir -p ".gpu-aside/$(dirname "$p")" && mv "$p" ".gpu-aside/$p" && echo "gpu_aside: $p -> .gpu-aside/$p"
    done ;;
  back)
    for p in $paths; do
      [ -e ".gpu-aside/$p" ] || continue
      [ -e "$p" ] && { echo "gpu_aside: $p exists in the tree and in .gpu-aside: merge by hand" >&2; exit 1; }
      mkdir -p "$(dirname "$p")" && mv ".gpu-aside/$p" "$p" && echo "gpu_aside: .gpu-aside/$p -> $p"
    done ;;
  *) echo "usage: $0 aside|back" >&2; exit 2 ;;
esac
