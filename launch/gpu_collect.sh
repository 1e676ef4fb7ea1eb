#!/usr/bin/env bash
# Shrink a gpu_check.sh output folder to what the device tool brings back (at most 8 files of 16 MiB, 64 MiB in
# all, two folders deep): summary.txt (the run log + stage status), results.tar.gz (every log, JSON and junit
# file), and split export parts (*.part000 ...) left as they are. Run by gpu_check.sh at the end on the GPU
# machine; here: `tar xzf results.tar.gz` in the folder that came back, then join the parts.
#
#   launch/gpu_collect.sh OUT_DIR
set -euo pipefail
OUT_DIR=${1:?usage: launch/gpu_collect.sh OUT_DIR}
cd "$OUT_DIR"
{
  echo "== status (stage exit seconds) =="
  cat status.txt 2>/dev/null
  echo "== log =="
  cat gpu_check.log 2>/dev/null
  # The benchmark's one-line verdicts, so the summary alone tells the story.
  echo "== results =="
  grep -h -E "tok/s|passed|failed|FAILED|error|tokens/s|ZeRO|acceptance length|speedup|lossless|SmolLM2 ready" \
    ./*.txt 2>/dev/null | grep -v "^\[" | tail -80 || true  # no match is no error (set -e would stop the collect)
} > summary.txt.tmp
mapfile -t keep < <(find . -type f \( -name '*.part[0-9][0-9][0-9]' \) | sort)
mapfile -t pack < <(find . -type f ! -name 'summary.txt*' ! -name 'results.tar.gz' ! -name '*.part[0-9][0-9][0-9]' | sort)
if [ ${#pack[@]} -gt 0 ]; then
  tar czf results.tar.gz.tmp "${pack[@]}"
  rm -f "${pack[@]}"
  mv results.tar.gz.tmp results.tar.gz
fi
mv summary.txt.tmp summary.txt
find . -mindepth 1 -type d -empty -delete
n=$(find . -type f | wc -l)
echo "gpu_collect: $OUT_DIR holds $n file(s) ($(du -sh . | cut -f1)): summary.txt, results.tar.gz, ${#keep[@]} part(s)"
[ "$n" -le 8 ] || echo "gpu_collect: WARNING: more than 8 files; the device tool brings back 8"
