"""One vLLM engine over a list of token-id prompts: run by `specdraft serve-check` INSIDE .venv-vllm.

    <.venv-vllm>/bin/python eval/serving/vllm_runner.py JOB.json
    <.venv-vllm>/bin/python eval/serving/vllm_runner.py --serve JOB.json   # `specdraft tune`: see serve()

Standalone on purpose: it imports only vllm and the standard library (never specdraft, whose torch and
transformers pins differ from vLLM's), and is run by path with the vLLM venv's python. The engine spawns
its core process, hence the `__main__` guard.

JOB.json: {"label", "base_dir", "dtype" ("float32" | "bfloat16" | "float16"), "prompts": [{"id", "input_ids"}],
"max_new_tokens", "warmup_tokens", "stop_token_ids", "speculative_config" (dict or null), "max_model_len",
"seed", "enforce_eager" (skip torch.compile: minutes saved on a first run, slower decoding), "engine_args"
(further LLM(...) keyword arguments the draft's export asks for in its engine_args.json, or null), "out",
optionally "paired_ar" (the vLLM AR run a draft's speed is measured against; copied into the result, so the result
and its pairing are written at once) and "max_num_seqs" (requests the engine runs at once; default 1)}.
Writes to "out" a JSON result: per prompt the generated token ids and decode seconds, the spec-decode counters
of the timed prompts only (warm-up subtracted), or {"error": "load", "message"} when the engine cannot be
built (exit code 3). Progress lines start with "[serve-check]" (the parent shows them).
"""

from __future__ import annotations

import json
import sys
import time
import traceback

SPEC_METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")


def progress(msg: str) -> None:
    print(f"[serve-check] {msg}", flush=True)


def spec_counters(llm) -> dict:
    """Cumulative spec-decode counters, summed over label sets: {name: int or [int per position]}."""
    out: dict = {}
    for m in llm.get_metrics():
        if m.name not in SPEC_METRICS:
            continue
        if hasattr(m, "values"):  # Vector: accepted tokens per draft position
            prev = out.get(m.name, [0] * len(m.values))
            out[m.name] = [a + b for a, b in zip(prev, m.values)]
        else:
            out[m.name] = out.get(m.name, 0) + int(m.value)
    return out


def counter_delta(after: dict, before: dict) -> dict:
    out = {}
    for name, value in after.items():
        if isinstance(value, list):
            prev = before.get(name) or [0] * len(value)
            out[name] = [a - b for a, b in zip(value, prev)]
        else:
            out[name] = value - before.get(name, 0)
    return out


def decode_seconds(output, wall: float) -> tuple[float, str]:
    """Decode time of one request, prefill excluded like our decoder: last minus first token timestamp (engine
    core clock, set when stats are logged); the wall time of the whole call as a fallback."""
    m = getattr(output, "metrics", None)
    first, last = getattr(m, "first_token_ts", 0.0) or 0.0, getattr(m, "last_token_ts", 0.0) or 0.0
    if last > first > 0:
        return last - first, "engine_timestamps"
    return wall, "wall_clock"


def build(job: dict):
    """The job's engine, or {"error": "load", ...} when vLLM cannot build it."""
    from vllm import LLM

    progress(f"{job['label']}: building the vLLM engine on {job['base_dir']} (dtype {job['dtype']}, "
             f"speculative_config {json.dumps(job.get('speculative_config'))})")
    try:
        return LLM(model=job["base_dir"], dtype=job["dtype"], speculative_config=job.get("speculative_config"),
                   disable_log_stats=False, max_model_len=int(job["max_model_len"]), seed=int(job.get("seed", 0)),
                   max_num_seqs=int(job.get("max_num_seqs") or 1), enable_prefix_caching=False,
                   enforce_eager=bool(job.get("enforce_eager", False)),
                   **(job.get("engine_args") or {}))  # what the draft's export needs (engine_args.json)
    except Exception as exc:  # whatever vLLM raises, the user needs its reason
        return {"error": "load", "message": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-4000:]}


def _params(job: dict, n: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=list(job.get("stop_token_ids") or []),
                          detokenize=False)


def warm_up(llm, job: dict) -> None:
    """One-off costs (allocation, kernel selection) stay out of the timings."""
    from vllm.inputs import TokensPrompt

    if int(job.get("warmup_tokens", 0)) > 0:
        progress(f"{job['label']}: warm-up")
        llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][0]["input_ids"])],
                     _params(job, int(job["warmup_tokens"])), use_tqdm=False)


def run(job: dict) -> dict:
    llm = build(job)
    if isinstance(llm, dict):
        return llm
    warm_up(llm, job)
    return generate(llm, job)


def generate(llm, job: dict, concurrency: int = 1) -> dict:
    """Every prompt of the job once on a built engine: tokens, decode seconds, the spec-decode counters of just
    these prompts. concurrency > 1: see generate_batched."""
    from vllm.inputs import TokensPrompt

    if concurrency > 1:
        return generate_batched(llm, job, concurrency)
    label, prompts = job["label"], job["prompts"]
    before = spec_counters(llm)
    results, clocks = [], set()
    for i, p in enumerate(prompts):
        progress(f"{label}: prompt {i + 1}/{len(prompts)} {p['id']}")
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p["input_ids"])], _params(job, int(job["max_new_tokens"])),
                           use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        secs, clock = decode_seconds(out, wall)
        clocks.add(clock)
        results.append({"id": p["id"], "tokens": list(out.outputs[0].token_ids), "decode_seconds": secs,
                        "wall_seconds": wall})
    spec = counter_delta(spec_counters(llm), before)
    import vllm

    return {"label": label, "vllm_version": vllm.__version__, "results": results, "spec_decode": spec,
            "timing": "+".join(sorted(clocks)), "speculative_config": job.get("speculative_config"),
            **({"paired_ar": job["paired_ar"]} if job.get("paired_ar") else {})}


def generate_batched(llm, job: dict, concurrency: int) -> dict:
    """The prompts in groups of `concurrency` requests sent together (one `generate` call: the engine, built with
    max_num_seqs >= concurrency, decodes them as one batch); the groups wrap around the prompt list, so every
    group has exactly `concurrency` requests and every prompt runs at least once. Per group "decode_seconds" is
    the span from the group's first first-token to its last token (engine clock): throughput, the prefill's
    tokens excluded. Rows carry their tokens; the seconds are the groups'."""
    from vllm.inputs import TokensPrompt

    label, prompts = job["label"], job["prompts"]
    n = len(prompts)
    before = spec_counters(llm)
    rows, groups, clocks = [], [], set()
    for g, start in enumerate(range(0, n, concurrency)):
        batch = [prompts[(start + j) % n] for j in range(concurrency)]
        progress(f"{label}: group {g + 1} of {concurrency} requests")
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p["input_ids"]) for p in batch],
                            _params(job, int(job["max_new_tokens"])), use_tqdm=False)
        wall = time.perf_counter() - t0
        stamps = [(getattr(o.metrics, "first_token_ts", 0.0) or 0.0, getattr(o.metrics, "last_token_ts", 0.0) or 0.0)
                  for o in outs if getattr(o, "metrics", None) is not None]
        first, last = (min(f for f, _ in stamps), max(x for _, x in stamps)) if len(stamps) == len(outs) else (0, 0)
        secs, clock = (last - first, "engine_timestamps") if last > first > 0 else (wall, "wall_clock")
        clocks.add(clock)
        groups.append({"ids": [p["id"] for p in batch], "decode_seconds": secs, "wall_seconds": wall})
        rows += [{"id": p["id"], "tokens": list(o.outputs[0].token_ids)} for p, o in zip(batch, outs)]
    spec = counter_delta(spec_counters(llm), before)
    import vllm

    return {"label": label, "vllm_version": vllm.__version__, "results": rows, "groups": groups,
            "concurrency": concurrency, "spec_decode": spec, "timing": "+".join(sorted(clocks)),
            "speculative_config": job.get("speculative_config")}


def serve(job: dict) -> int:
    """`--serve`: build and warm the engine once, print "[tune] ready", then for every line "RUN <path>" on stdin
    run the prompts again, write the result to <path> and print "[tune] done <path>" (`specdraft tune` keeps an AR
    engine and a speculative one open side by side this way); "RUN <path> <c>" sends the prompts c at a time
    (generate_batched). Ends at EOF or "QUIT"."""
    llm = build(job)
    if isinstance(llm, dict):
        with open(job["out"], "w") as f:
            json.dump(llm, f)
        return 3
    warm_up(llm, job)
    print("[tune] ready", flush=True)
    for line in sys.stdin:
        cmd, _, rest = line.strip().partition(" ")
        if cmd != "RUN":
            break
        path, _, concurrency = rest.partition(" ")
        with open(path, "w") as f:
            json.dump(generate(llm, job, int(concurrency or 1)), f)
        print(f"[tune] done {path}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"] and len(argv) == 2:
        with open(argv[1]) as f:
            return serve(json.load(f))
    if len(argv) != 1:
        print("usage: vllm_runner.py JOB.json | vllm_runner.py --serve JOB.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    result = run(job)
    with open(job["out"], "w") as f:
        json.dump(result, f)
    return 3 if result.get("error") else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
