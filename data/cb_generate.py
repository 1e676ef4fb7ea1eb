"""`HFCBGenerator`: transformers' continuous batching (`model.generate_batch`'s engine: a paged KV cache, requests
admitted and retired step by step) as a regeneration engine, `specdraft regenerate --engine hf-cb`.

The library's own batched engine, beside `HFGenerator` (padded `generate`) and our `FastBatchGenerator`
(eval/engine/batch_generate.py): the same `Generator` protocol, so build_self_distilled drives any of them.
No padding: each prompt is one request with its own length and its own max_new_tokens (the per-row limit), so
greedy answers in fp32 are `generate`'s tokens (tests/test_cb_generate.py).

Sizing on the CPU. Left to itself, the library sizes the paged cache from free *device* memory; on a CPU that is
the machine's RAM, and resetting the [M, N + M] attention-bias mask of that capacity (M = max_batch_tokens, N =
cache tokens) took 15 s of a 17 s call on a tiny model. The CPU also has no paged / flash attention kernel: a
forward is one SDPA over the whole batch with a block-diagonal mask, [q tokens, the batch's cached tokens], so a
decode step of R rows of L cached tokens costs R x (R x L) scores: R rows at once should stay modest. So on the
CPU: at most CPU_ROWS requests per forward, a cache that holds those (num_blocks: the CPU_ROWS largest requests of
the call, prompt + limit, in pages), M capped at CPU_MAX_BATCH_TOKENS; the requests beyond wait for a finished
one's pages. On CUDA all three stay the library's choice (memory-derived, paged kernels).
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import GenerationConfig

PAGE_SIZE = 64  # tokens per cache page on the CPU (the library's default, 256, wastes most of a short answer's page)
CPU_MAX_BATCH_TOKENS = 256  # M on the CPU: query tokens per forward (prefill chunks); the mask is [M, N + M]
CPU_ROWS = 32  # requests decoding at once on the CPU (default of max_requests there; see the module docstring)


def _page_size_key(config_class) -> str:
    """The config's name for the tokens of one cache block: `page_size` in newer transformers (5.24; it still takes
    `block_size`, with a deprecation warning), `block_size` in older ones (5.17, the GPU image's, has no
    `page_size`). In both, `num_blocks` counts blocks of that many tokens of every layer."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    return "page_size" if "page_size" in fields else "block_size"


class HFCBGenerator:
    """Greedy or sampled continuous-batching generation on the base as loaded (its device and dtype).

    max_requests: requests decoding at once (None: CPU_ROWS on the CPU, the library's choice on CUDA);
    max_batch_tokens: query tokens per forward (None: CPU_MAX_BATCH_TOKENS on the CPU, the library's on CUDA).
    One call = one manager: every prompt of the call is queued at once and the library keeps its batch full as
    answers end."""

    name = "hf-cb"

    def __init__(self, model, eos: list[int], max_new_tokens: int, temperature: float,
                 max_requests: int | None = None, max_batch_tokens: int | None = None):
        import transformers

        self.model, self.eos, self.max_new_tokens = model, list(eos), max_new_tokens
        self.max_requests, self.max_batch_tokens = max_requests, max_batch_tokens
        self.version = f"transformers {transformers.__version__} {str(model.dtype)[6:]} continuous-batching"
        self.gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=self.eos,
                                        pad_token_id=self.eos[0], do_sample=temperature > 0,
                                        **(dict(temperature=temperature, top_k=0, top_p=1.0)
                                           if temperature > 0 else {}))

    def _cb_config(self, lengths: list[int], caps: list[int], seed: int):
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        kw = dict(seed=seed, max_requests_per_batch=self.max_requests)
        if self.model.device.type == "cpu":  # see the module docstring: a cache for CPU_ROWS requests of this call
            rows = self.max_requests or CPU_ROWS
            pages = sorted((-(-(n + c) // PAGE_SIZE) for n, c in zip(lengths, caps)), reverse=True)
            kw.update({_page_size_key(ContinuousBatchingConfig): PAGE_SIZE}, max_requests_per_batch=rows,
                      max_batch_tokens=self.max_batch_tokens or CPU_MAX_BATCH_TOKENS, num_blocks=sum(pages[:rows]) + 1)
        elif self.max_batch_tokens:
            kw["max_batch_tokens"] = self.max_batch_tokens
        return ContinuousBatchingConfig(**kw)

    @torch.no_grad()
    def __call__(self, prompts: list[list[int]], seed: int, limits: list[int] | None = None) -> list[list[int]]:
        if limits is not None and (len(limits) != len(prompts) or min(limits, default=0) < 0):
            raise ValueError(f"HFCBGenerator: limits must be {len(prompts)} numbers >= 0, got {limits}")
        caps = [self.max_new_tokens if limits is None else min(n, self.max_new_tokens) for n in (limits or prompts)]
        live = [i for i, c in enumerate(caps) if c > 0]  # a zero budget asks for nothing: no request
        answers: list[list[int]] = [[] for _ in prompts]
        if not live:
            return answers
        cb = self._cb_config([len(prompts[i]) for i in live], [caps[i] for i in live], seed)
        with self.model.continuous_batching_context_manager(generation_config=self.gen_cfg,
                                                            continuous_batching_config=cb, block=True,
                                                            timeout=30) as manager:
            for i in live:
                manager.add_request(prompts[i], request_id=str(i), max_new_tokens=caps[i], eos_token_id=self.eos)
            waiting = {str(i) for i in live}
            while waiting:
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError(f"hf-cb: transformers' continuous-batching thread stopped with "
                                           f"{len(waiting)} of {len(live)} requests unfinished")
                    continue
                if not result.is_finished() or result.request_id not in waiting:
                    continue
                if result.error is not None:
                    raise RuntimeError(f"hf-cb: request {result.request_id} failed: {result.error}")
                waiting.discard(result.request_id)
                answers[int(result.request_id)] = list(result.generated_tokens)
        eos = set(self.eos)  # the answer ends with (and keeps) its first end-of-turn token, as HFGenerator's does
        return [row[:next((k + 1 for k, t in enumerate(row) if t in eos), len(row))][:c]
                for row, c in zip(answers, caps)]
