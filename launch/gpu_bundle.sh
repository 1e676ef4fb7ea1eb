#!/usr/bin/env bash
# Wheel bundle for the GPU machine (docs/howto/gpu_kit.md, docs/howto/gpu_kit.md): everything specdraft needs there that the
# GPU image ('cuda', Python 3.12, torch 2.11+cu130, transformers 5.17, ...) lacks, downloaded here for
# CPython 3.12 / manylinux x86-64 into the git-ignored folder .whl/ (carry it with the device tool).
#
#   launch/gpu_bundle.sh                 # or: make gpu-bundle
#   GPU_BUNDLE_EXTRA="transformers==5.23.0" launch/gpu_bundle.sh   # also carry our transformers (~12 MB)
#
# What the image already has (KINDS.md's package list) is NOT downloaded: numpy, pyarrow, pandas, fsspec,
# xxhash, huggingface-hub, tokenizers, safetensors, accelerate, tqdm, pyyaml, requests, einops, msgpack,
# ninja, psutil, py-cpuinfo, matplotlib, pytest. wandb is not needed there (train with wandb.enabled=false;
# tracking never imports it then). Versions are the ones this repo's venv runs, so the GPU runs the code
# that the CPU tests checked. deepspeed is an sdist: gpu_check.sh installs it there with
# `--no-build-isolation --no-deps` and DS_BUILD_OPS=0 (no op is compiled at install; none is needed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
test -x "$PY" || PY=python3
OUT=.whl
mkdir -p "$OUT"

# name==version, one of each (two versions of one package stop the whole install there).
WHEELS=(
  hjson==3.1.0                 # deepspeed's config parser
  pydantic==2.14.3             # deepspeed's config models
  pydantic-core==2.50.4        # compiled: cp312 manylinux
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0    # pydantic 2.14 needs >= 4.16; shadows the image's (backward compatible)
  omegaconf==2.4.0             # core/config_loader.py (vendors its antlr4 runtime)
  gguf==0.19.0                 # transformers' GGUF loader (the SmolLM2 GGUF, when carried)
  datasets==5.2.0              # data/dataset.py for raw ShareGPT; the packed data path (data/packed.py) needs none
  dill==0.4.1
  multiprocess==0.70.19
  fsspec==2026.9.0             # datasets 5.2 caps fsspec at this version
)
read -r -a EXTRA <<< "${GPU_BUNDLE_EXTRA:-}"

PLATFORMS=()
for n in 39 35 34 31 28 27 24 17 14 12 5; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64
            --platform any)

# (grep: this box's pip.conf names local indexes that warn for every package they lack)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --abi none "${PLATFORMS[@]}" -d "$OUT" "${WHEELS[@]}" "${EXTRA[@]}" \
  2> >(grep -v 'is ignored: it is neither' >&2)
# The sdist, fetched as source on purpose (there is no deepspeed wheel on PyPI).
"$PY" -m pip download -q --no-deps --no-binary=:all: -d "$OUT" deepspeed==0.19.8 \
  2> >(grep -v 'is ignored: it is neither' >&2)

# One version of each distribution, or the install there fails: drop stale files from earlier pins.
want=" $(printf '%s\n' "${WHEELS[@]}" "${EXTRA[@]}" deepspeed==0.19.8 | tr 'A-Z.-' 'a-z__' | sed 's/==/-/' | tr '\n' ' ')"
for f in "$OUT"/*; do
  name=$(basename "$f" .tar.gz)
  id=$(echo "$name" | cut -d- -f1 | tr 'A-Z.-' 'a-z__')-$(echo "$name" | cut -d- -f2 | tr '.' '_')
  case "$want" in *" $id "*) ;; *) echo "removing stale $f"; rm -f "$f";; esac
done

echo "bundle in $OUT/:"
ls -l "$OUT" | awk 'NR > 1 {printf "  %8.1f KiB  %s\n", $5 / 1024, $9}'
total=$(du -cb "$OUT"/* | tail -1 | cut -f1)
echo "total: $(awk -v b="$total" 'BEGIN {printf "%.1f MiB", b / 1048576}') (the device tool carries 64 MiB per call," \
     "working tree and data included)"
# Its size into launch/gpu_carry_sizes.json: tests/test_gpu_carry.py sizes every call from there (commit it).
"$PY" launch/carry_sizes.py record "$OUT"
