"""A long-lived vLLM engine that continues batches of token-id prompts: run by `specdraft regenerate --engine vllm`
INSIDE .venv-vllm.

    <.venv-vllm>/bin/python eval/serving/vllm_generate_worker.py JOB.json

Standalone like vllm_runner.py: it imports only vllm and the standard library. JOB.json: {"base_dir", "dtype",
"max_model_len", "max_new_tokens", "temperature", "stop_token_ids"}. It prints `@@READY <vllm version>` once the
engine is built, then reads one JSON request per line on stdin, {"prompts": [[ids], ...], "seed": S, "limits":
[n, ...]} (limits optional: per-prompt caps on new tokens) or {"quit": true}, and answers each with one line
`@@RESULT {"outputs": [[new ids], ...]}`; every other line on stdout is vLLM's own log. The whole list of a
request goes to one `generate` call, which vLLM batches itself.
"""

from __future__ import annotations

import json
import sys

READY, RESULT = "@@READY", "@@RESULT"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: vllm_generate_worker.py JOB.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["base_dir"], dtype=job["dtype"], max_model_len=int(job["max_model_len"]),
              seed=0, enforce_eager=bool(job.get("enforce_eager", False)))
    print(f"{READY} {vllm.__version__}", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            break
        temperature = float(job["temperature"])
        # "limits": each prompt's own cap on new tokens (the token budget), at most the job's max_new_tokens
        cap = int(job["max_new_tokens"])
        limits = [min(cap, int(n)) for n in request.get("limits") or [cap] * len(request["prompts"])]
        # One seed per prompt (the batch's seed + its index): a resumed build samples what an uninterrupted one did.
        params = [SamplingParams(temperature=temperature, top_p=1.0, top_k=0 if temperature > 0 else -1,
                                 max_tokens=limits[i], stop_token_ids=list(job["stop_token_ids"]),
                                 seed=int(request["seed"]) + i if temperature > 0 else None, detokenize=False)
                  for i in range(len(request["prompts"]))]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["prompts"]], params, use_tqdm=False)
        print(f"{RESULT} {json.dumps({'outputs': [list(o.outputs[0].token_ids) for o in outputs]})}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
