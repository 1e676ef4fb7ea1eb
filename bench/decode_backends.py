"""Greedy autoregressive decoding speed of the base: transformers `generate` vs our backends.

    .venv/bin/python bench/decode_backends.py [--base smollm2|random] [--new-tokens 128]
        [--prompt-len 100] [--reps 2] [--threads N] [--hf-loop] [--fast-global-threads]

Methods (same process, same prompt, fp32 on CPU by default, warm-up first, repetitions interleaved
so that load from other processes hits all methods alike; the median repetition is reported):
  generate  transformers `model.generate(do_sample=False)`, no eos (exactly --new-tokens tokens);
            its prefill is a separate `generate(max_new_tokens=1)` call, as in eval/harness/hf_baseline.py
  fast      FastBackend (default settings: on CPU it computes with 1 intra-op thread, see its
            `cpu_threads`) driven by the minimal greedy loop below (prefill, then per token one
            1-node forward_tree + commit)
  fast-glob (--fast-global-threads) the same with cpu_threads=None, i.e. torch's --threads setting
  hf-loop   (--hf-loop) the same loop over HFBackend (transformers forward + DynamicCache)
`--threads 1` makes every method single-threaded: the like-for-like kernel comparison. With torch's
default (2 on the 2-core box) `generate` pays for fork/join on a shared CPU, which `fast` avoids.
All three must produce the same tokens (greedy, fp32); the script says so if they do not.

--base smollm2 loads the real SmolLM2-135M-Instruct via models.base.load_base; if that fails (package
not installed, no converted cache yet) it falls back to a randomly initialised LLaMA of SmolLM2's
exact config, which times the same (docs/howto/gpu_kit.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bench.harness import Stopwatch, Timing, clock_sync, ratio  # noqa: E402
from eval.engine.backends.backend import Backend  # noqa: E402
from eval.engine.backends.fast import FastBackend  # noqa: E402
from eval.engine.backends.hf import HFBackend  # noqa: E402

# SmolLM2-135M(-Instruct) config.json, architecture fields.
SMOLLM2_CONFIG = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_act="silu",
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
    attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)

PROMPT_TEXT = (
    "I am planning a two-week trip through northern Italy in late September. I will arrive in Milan, "
    "want to see Lake Como, Verona, Venice and the Dolomites, and I would rather travel by train than "
    "rent a car. I like hiking, small museums and local food markets, but I do not enjoy crowded "
    "tourist spots. Could you propose a day-by-day itinerary with train connections, say where to "
    "stay each night, and explain which places are worth booking in advance?"
)


def load_model(base: str, device: torch.device) -> tuple[torch.nn.Module, object | None, str]:
    """(model, tokenizer or None, description)."""
    if base == "smollm2":
        try:
            from models.base import load_base

            loaded = load_base("smollm2", dtype="fp32", device=device)
            return loaded.model, loaded.tokenizer, "SmolLM2-135M-Instruct (real weights, fp32)"
        except Exception as exc:  # any failure: fall back, but say why
            print(f"[bench] could not load the real SmolLM2 ({type(exc).__name__}: {exc}); "
                  "falling back to a random model of the same config", file=sys.stderr)
    config = LlamaConfig(**SMOLLM2_CONFIG)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device).eval().requires_grad_(False)
    return model, None, "random LLaMA with SmolLM2-135M's config (fp32)"


def make_prompt(tokenizer, prompt_len: int, vocab: int) -> torch.Tensor:
    if tokenizer is None:
        return torch.randint(3, vocab, (prompt_len,), generator=torch.Generator().manual_seed(0))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT_TEXT}],
                                        add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return torch.tensor(ids, dtype=torch.long)


@torch.inference_mode()
def run_generate(model, prompt: torch.Tensor, new_tokens: int) -> tuple[list[int], float, float]:
    """(tokens, prefill_s, total_s) of greedy `generate` with no eos, so it runs exactly new_tokens."""
    ids = prompt[None].to(model.device)
    mask = torch.ones_like(ids)
    saved = model.generation_config  # hide the checkpoint's defaults (eos, penalties) for the call
    model.generation_config = GenerationConfig()
    try:
        times = []
        for n in (1, new_tokens):
            cfg = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=n, eos_token_id=None,
                                   pad_token_id=0, use_cache=True)
            watch = Stopwatch(clock_sync(model.device))
            out = model.generate(ids, attention_mask=mask, generation_config=cfg)
            times.append(watch.wall())
    finally:
        model.generation_config = saved
    return out[0, ids.shape[1]:].tolist(), times[0], times[1]


@torch.inference_mode()
def run_loop(backend: Backend, prompt: torch.Tensor, new_tokens: int) -> tuple[list[int], float, float]:
    """The minimal greedy AR loop on a backend: (tokens, prefill_s, total_s)."""
    dev = backend.device
    root = torch.zeros(1, dtype=torch.long, device=dev)  # depth 0, and "keep node 0"
    self_only = torch.ones(1, 1, dtype=torch.bool, device=dev)
    watch = Stopwatch(clock_sync(dev))
    backend.reset(prompt.numel() + new_tokens)
    logits, _ = backend.prefill(prompt.to(dev))
    token = logits[-1].argmax().view(1)
    prefill = watch.wall()
    out = [token]
    for _ in range(new_tokens - 1):  # the prefill already chose the first new token
        logits, _ = backend.forward_tree(token, root, self_only)
        backend.commit(root)
        token = logits[-1].argmax().view(1)
        out.append(token)
    total = watch.wall()
    return torch.cat(out).tolist(), prefill, total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", choices=["smollm2", "random"], default="smollm2")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=100, help="random base only (the real one uses a "
                    "fixed chat prompt of about this length)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hf-loop", action="store_true", help="also time the loop over HFBackend")
    ap.add_argument("--fast-global-threads", action="store_true",
                    help="also time fast with cpu_threads=None (torch's thread setting)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    wall = Stopwatch()

    model, tokenizer, desc = load_model(args.base, device)
    prompt = make_prompt(tokenizer, args.prompt_len, model.config.vocab_size)
    fast = FastBackend(model, max_len=prompt.numel() + args.new_tokens)
    methods = {
        "generate": lambda n: run_generate(model, prompt, n),
        "fast": lambda n: run_loop(fast, prompt, n),
    }
    if args.fast_global_threads:
        fast_glob = FastBackend(model, max_len=prompt.numel() + args.new_tokens, cpu_threads=None)
        methods["fast-glob"] = lambda n: run_loop(fast_glob, prompt, n)
    if args.hf_loop:
        hf = HFBackend(model)
        methods["hf-loop"] = lambda n: run_loop(hf, prompt, n)
    print(f"base: {desc}; device {device}, threads {torch.get_num_threads()}; prompt {prompt.numel()} "
          f"tokens, {args.new_tokens} new tokens, {args.reps} reps (median)")

    for run in methods.values():  # warm-up: allocator, kernel selection, lazy init, compile
        run(8)
    results: dict[str, list[tuple[list[int], float, float]]] = {name: [] for name in methods}
    for _ in range(args.reps):
        for name, run in methods.items():  # interleaved, so background load hits all alike
            results[name].append(run(args.new_tokens))

    n = args.new_tokens
    rows = {}
    for name, runs in results.items():
        total = Timing([r[2] for r in runs]).median
        prefill = Timing([r[1] for r in runs]).median
        # Decode speed excludes the prefill and its first token, as the decoder's report does.
        decode = Timing([(r[2] - r[1]) / (n - 1) for r in runs]).median
        rows[name] = (n / total, 1.0 / decode, prefill)
    ref_e2e, ref_dec = rows["generate"][0], rows["generate"][1]
    print(f"{'method':<10}{'tok/s e2e':>11}{'tok/s decode':>14}{'ms/token':>10}{'prefill ms':>12}"
          f"{'x generate (e2e)':>18}{'x generate (decode)':>21}")
    for name, (e2e, dec, prefill) in rows.items():
        print(f"{name:<10}{e2e:>11.1f}{dec:>14.1f}{1e3 / dec:>10.1f}{prefill * 1e3:>12.1f}"
              f"{ratio(e2e, ref_e2e):>18.2f}{ratio(dec, ref_dec):>21.2f}")
    spreads = {name: [round(n / r[2], 1) for r in runs] for name, runs in results.items()}
    print(f"per-rep e2e tok/s: {spreads}")

    reference = results["generate"][0][0]
    for name, runs in results.items():
        same = sum(t == u for t, u in zip(runs[0][0], reference))
        note = "identical" if runs[0][0] == reference else f"{same}/{n} tokens equal (first diff = fp ties?)"
        print(f"tokens {name} vs generate: {note}")
    print(f"bench wall time {wall.wall():.1f} s")


if __name__ == "__main__":
    main()
