"""What an EAGLE-3 draft's acceptance would buy in llama.cpp on bases people run on CPUs: per-step costs of
random-weight LLaMA bases of the 1B and 8B shapes and of an EAGLE-3 draft of their shape (no acceptance is
claimed from random weights), then the speedup a given per-position acceptance would give there.

    python bench/llamacpp_scaling.py [--shapes llama-1b,llama-8b] [--threads 2] [--rates 0.45,0.2,0.1,0.05]

Costs, from llama-server's own timings, batch 1, greedy, one untimed warm-up per server, -nr:
  AR step       predicted_ms / (predicted_n - 1), plain decoding
  verify(w)     prompt_ms of w new tokens appended to a cached context (a verify step of width w)
  step(n)       with --spec-synth-rates 0,...,0 (nothing accepted, so every step drafts n and verifies n+1):
                predicted_ms / (predicted_n - 1); draft(n) = step(n) - verify(n+1)
Projection: tokens per step E(n) = 1 + p_1 + ... + p_n from a draft's measured per-position acceptance p_k (the
share of steps whose first k drafts were all accepted, what `specdraft eval` reports; a greedy chain's first k
drafts do not depend on its length, so a chain of 4's rates serve every n <= 4), speedup(n) = E(n) * AR step /
step(n). A step that accepts more tokens costs the same here: llama.cpp drafts n and verifies n+1 whatever is
accepted.
The base files are written once (bench/llamacpp_random_gguf.py in .venv-llamacpp) under
~/.cache/specdraft/llamacpp/random/. Writes runs/bench-llamacpp-scaling/results.json through bench/harness.py
(Results: each shape's row on disk as each of its costs is measured, with the error of a shape that fails) and
prints Markdown. The costs are llama-server's own timings (its compute, without the HTTP round trip), not a clock
of this process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bench.harness import Results  # noqa: E402
from core.paths import default_cache_dir  # noqa: E402
from eval.serving.llamacpp_gguf import serve_args  # noqa: E402
from eval.serving.llamacpp_paths import converter_python, llamacpp_source  # noqa: E402
from eval.serving.llamacpp_server import LlamaServer, runtime_args, verify_costs  # noqa: E402


def random_ggufs(shape: str, base_type: str) -> tuple[Path, Path]:
    out = default_cache_dir() / "llamacpp" / "random"
    vocab = llamacpp_source() / "models" / "ggml-vocab-llama-bpe.gguf"
    subprocess.run([str(converter_python()), str(Path(__file__).with_name("llamacpp_random_gguf.py")),
                    "--shape", shape, "--out-dir", str(out), "--base-type", base_type, "--vocab", str(vocab)],
                   check=True)
    return out / f"{shape}-base-{base_type}.gguf", out / f"{shape}-eagle3-f16.gguf"


CTX = 4096  # llama-server's context: the prompt, the new tokens and the drafts fit


def step_ms(args: list[str], prompts: list[list[int]], new_tokens: int, log: Path) -> float:
    """Mean ms per generated token after the first (one step per token when nothing is accepted)."""
    with LlamaServer(args, log, timeout=1800) as srv:
        srv.complete(prompts[0], 4)  # warm-up
        ms, n = 0.0, 0
        for p in prompts:
            t = srv.complete(p, new_tokens)["timings"]
            ms += t["predicted_ms"]
            n += t["predicted_n"] - 1
    return ms / n


def tokens_per_step(rates: list[float], n: int) -> float:
    """1 + p_1 + ... + p_n: tokens per step of a chain of n, from per-position acceptance p_k (P(drafts 1..k all
    accepted))."""
    if any(b > a for a, b in zip(rates, rates[1:])):
        raise ValueError(f"per-position acceptance {rates} grows with depth: give P(drafts 1..k all accepted), "
                         "which cannot; conditional rates multiply up to it")
    return 1.0 + sum(rates[:n])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama-1b,llama-8b")
    p.add_argument("--base-type", default="q8_0")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-max", default="1,2,3,4")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--rates", default="", help="per-position acceptance to project, e.g. 0.45,0.35,0.3 "
                   "(conditional: position k given 1..k-1 accepted); several sets split by ';'")
    p.add_argument("--out", default="runs/bench-llamacpp-scaling/results.json")
    p.add_argument("--tables-only", action="store_true", help="no measuring: print --out's tables, projected at "
                   "--rates (a draft measured later)")
    a = p.parse_args()
    out = Path(a.out)
    if a.tables_only:
        res = json.loads(out.read_text())
        res["rates"] = [[float(x) for x in s.split(",")] for s in a.rates.split(";") if s.strip()] or res["rates"]
        print(tables(res))
        return
    logs = out.parent / "logs"
    rng = np.random.default_rng(0)
    # ids of ordinary tokens (the first 100k of Llama-3's vocabulary); random weights make any text as costly
    prompts = [rng.integers(1000, 100_000, a.prompt_len).tolist() for _ in range(a.prompts)]
    n_maxes = [int(x) for x in a.n_max.split(",")]
    results = Results(out, {"threads": a.threads, "base_type": a.base_type, "prompt_len": a.prompt_len,
                            "new_tokens": a.new_tokens, "shapes": {}})
    for shape in a.shapes.split(","):
        base, draft = random_ggufs(shape, a.base_type)
        with results.arm("shapes", shape) as r:
            r.update(base=str(base), draft=str(draft))
            print(f"{shape}: AR", flush=True)
            plain = runtime_args(["-m", str(base)], a.threads, CTX)
            r["ar_ms"] = step_ms(plain, prompts, a.new_tokens, logs / f"{shape}-ar.log")
            results.save()
            print(f"{shape}: verify", flush=True)
            r["verify_ms"] = verify_costs(plain, prompts[:1], [1, *[n + 1 for n in n_maxes]],
                                          logs / f"{shape}-verify.log", timeout=1800)
            r["step_ms"] = {}
            for n in n_maxes:
                print(f"{shape}: EAGLE-3 step, n-max {n}", flush=True)
                spec = [*serve_args(str(base), str(draft), "eagle3", n), "--spec-synth-rates", ",".join(["0"] * n)]
                r["step_ms"][n] = step_ms(runtime_args(spec, a.threads, CTX), prompts, a.new_tokens,
                                          logs / f"{shape}-step{n}.log")
                results.save()
    results.put("rates", [[float(x) for x in s.split(",")] for s in a.rates.split(";") if s.strip()])
    print(tables(results.data))


def tables(res: dict) -> str:
    lines = [f"threads {res['threads']}, base {res['base_type']}, draft f16", "",
             "| base shape | AR step, ms | verify(w), ms | n-max | draft(n), ms | step(n), ms | "
             "break-even tokens/step |", "|---|---|---|---|---|---|---|"]
    for shape, r in res["shapes"].items():
        v = {int(k): x for k, x in r["verify_ms"].items()}
        vs = ", ".join(f"w={w}: {v[w]:.1f}" for w in sorted(v))
        for n, s in r["step_ms"].items():
            ver = v.get(int(n) + 1)
            draft = f"{s - ver:.1f}" if ver else "-"
            lines.append(f"| {shape} | {r['ar_ms']:.1f} | {vs} | {n} | {draft} | {s:.1f} | {s / r['ar_ms']:.2f} |")
    for rates in res.get("rates", []):
        lines += ["", f"projected speedup vs llama.cpp AR at per-position acceptance {rates}:", "",
                  "| base shape | " + " | ".join(f"n-max {n}" for n in next(iter(res['shapes'].values()))['step_ms'])
                  + " |", "|---|" + "---|" * len(next(iter(res['shapes'].values()))['step_ms'])]
        for shape, r in res["shapes"].items():
            cells = [f"{tokens_per_step(rates, int(n)) * r['ar_ms'] / s:.2f}x" for n, s in r["step_ms"].items()]
            lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
