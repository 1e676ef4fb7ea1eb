"""Typed eval config (`specdraft eval`); YAML deltas in configs/eval/, `key=value` overrides."""

from __future__ import annotations

from dataclasses import dataclass, field

from core.config_loader import ConfigError, load_typed
from eval.engine.decoder import ACCEPTANCE_RULES
from eval.engine.tree import STATIC_TREES


@dataclass
class EvalConfig:
    name: str = "mtbench"  # report directory: <run>/eval/<name>/
    dataset: str = "mtbench"  # mtbench | sharegpt (held-out) | a .jsonl of prompts
    num_prompts: int | None = None  # None = all (MT-bench: 80)
    both_turns: bool = False  # MT-bench: the second turn too (its history holds our own turn-1 answer)
    heldout_skip: int | None = None  # sharegpt: skip the first N conversations; None = what the draft trained on
    max_prompt_tokens: int | None = 1024  # longer prompts are skipped
    max_new_tokens: int = 256  # tokens generated per prompt
    backend: str = "auto"  # auto (fast where it supports the base, else hf) | fast (static KV) | hf (any causal LM)
    dtype: str = "fp32"  # base dtype: fp32 (exact losslessness check) | bf16 | auto
    device: str = "auto"  # auto = cuda if available else cpu
    acceptance: str = "greedy"  # greedy | typical | rejection
    temperature: float = 0.0  # 0 = greedy; > 0 needs acceptance=rejection (or typical)
    top_p: float = 1.0  # nucleus sampling of the base distribution (T > 0)
    typical_eps: float = 0.09  # typical acceptance: accept x if p(x) > min(eps, delta * exp(-H(p)))
    typical_delta: float = 0.3  # see typical_eps
    tree: str = "auto"  # auto = the export's tree, else the family default; or a name in eval.engine.tree.STATIC_TREES
    tree_choices: list[list[int]] | None = None  # explicit Medusa-style choices (wins over `tree`)
    ar_baseline: bool = True  # own AR decoding, same engine, same run (also the losslessness reference)
    hf_baseline: bool = True  # transformers generate (greedy), same run
    tie_prompts: int = 3  # bf16/fp16: prompts used to measure the tie tolerance (eval/harness/lossless.py); 0 = none
    # bf16/fp16 greedy: every prompt whose output differs from plain decoding is decoded again in fp32 (same draft,
    # tree, length, device), the losslessness verdict's judge (a rounding flip vs a real mismatch); false = judge by
    # the measured tolerance alone (e.g. no memory for an fp32 copy of a large base)
    redecode_fp32: bool = True
    warmup_tokens: int = 16  # one untimed warm-up generation of this length per method
    seed: int = 0  # prompt draw (num_prompts of a larger set) and sampling
    base_path: str = ""  # "" = the base named in the export's config.json (or method_base for --method)
    method_base: str = "smollm2"  # the base a learning-free method (--method ngram) runs on when base_path is ""
    run_dir: str = ""  # where a learning-free eval (--method) writes; "" = runs/<method>
    num_threads: int = 0  # CPU threads; 0 = torch's default
    # The drafter's own options, declared and typed by its family (models/families/<family>/drafter.py `Options`): a key
    # no family declares fails when the config loads, one the export's family lacks when the drafter is built; e.g.
    # extra.beam_width (ReDrafter), extra.eagle3_mode (EAGLE-3), extra.k / extra.w (N-gram), and drafts per step,
    # extra.num_speculative_tokens, in every family that has that knob (EAGLE-3's chain, DFlash, DSpark, Domino).
    extra: dict = field(default_factory=dict)
    prompt_lookup: bool = False  # --method ngram: also time transformers' prompt-lookup decoding (w tokens per step)
    sweep_k: list[int] = field(default_factory=list)  # --method ngram: a (k, w) grid instead of one run
    sweep_w: list[int] = field(default_factory=list)  # the grid's row lengths (sweep_k: its row counts)
    serve_tolerance: float = 0.03  # serve-check: max |engine - ours| acceptance per position before it fails
    serve_timeout: float = 1800.0  # serve-check: seconds per engine (a first run compiles the model)
    serve_enforce_eager: bool = False  # serve-check: skip vLLM's torch.compile (minutes saved, slower decoding)
    serve_ngram_w: int = 0  # serve-check: the engines' n-gram row length; 0 = the draft's chain depth
    serve_ngram_q: int = 2  # serve-check: longest n-gram query of that row
    serve_ngram_q_min: int = 1  # serve-check: shortest n-gram query
    # serve-check --engine llamacpp: the GGUF types llama.cpp serves. f32 base + f32 draft match our fp32 decoder
    # exactly; q4_1 is the packaged SmolLM2 file (its matmuls quantize activations: outputs differ from ours).
    serve_llamacpp_base_type: str = "f32"  # q4_1 | f32 | f16 | bf16 | q8_0
    serve_llamacpp_draft_type: str = "f32"  # f32 | f16 | bf16 | q8_0
    serve_llamacpp_threads: int = 1  # llama-server -t/-tb/-td; on a small shared CPU more threads spin and collapse
    # llama-server -nr: its extra CPU buffer types off (AMX tiles, weight repacking; they only serve quantized
    # weights). A native build on an AMX Xeon dies with SIGILL loading Q4_1 where the OS refuses AMX tiles.
    serve_llamacpp_no_repack: bool = True
    # "" = the template the draft was trained with (export's chat_template) or the tokenizer's own;
    # else chatml | llama3 | gemma | a .jinja file (bases that ship no chat template)
    chat_template: str = ""
    # eval / serve-check: apply the export's tuning.json (`specdraft tune`) when the config names no draft shape
    # (tree, tree_choices, the family's extra options); false = the export's default shape
    use_tuning: bool = True
    # eval: when no tuning.json choice applies here and the config names no shape, decode the shape a short probe
    # chooses (chains of 1-3 and the export's default against own AR, ~1 minute, cached per machine;
    # eval/tune/untuned_probe.py); false = the export's default shape
    untuned_probe: bool = True
    # an evaluation suite (configs/eval/suites/<name>.yaml; `specdraft eval --suite NAME`): every set of it in one
    # pass, one table and plot under <run>/eval/suite-<name>/; "" = one prompt set (dataset)
    suite: str = ""
    suite_sets: list[str] = field(default_factory=list)  # only these sets of the suite; [] = all
    suite_prompts: int | None = None  # prompts per set; None = the suite file's num_prompts


def validate_eval(cfg: EvalConfig) -> EvalConfig:
    def fail(key, value, fix):
        raise ConfigError(f"invalid value {key}={value!r}: {fix}")

    if cfg.backend not in ("auto", "fast", "hf"):
        fail("backend", cfg.backend, "use auto (fast where supported, else hf), fast or hf")
    if cfg.acceptance not in ACCEPTANCE_RULES:
        fail("acceptance", cfg.acceptance, f"use one of {', '.join(ACCEPTANCE_RULES)}")
    if cfg.temperature < 0:
        fail("temperature", cfg.temperature, "use 0 (greedy) or a positive temperature")
    if cfg.acceptance == "greedy" and cfg.temperature > 0:
        fail("temperature", cfg.temperature, "greedy acceptance needs temperature=0; use acceptance=rejection")
    if not 0 < cfg.top_p <= 1:
        fail("top_p", cfg.top_p, "use a value in (0, 1]")
    if cfg.max_new_tokens < 1:
        fail("max_new_tokens", cfg.max_new_tokens, "generate at least 1 token")
    if cfg.num_prompts is not None and cfg.num_prompts < 1:
        fail("num_prompts", cfg.num_prompts, "use None (all) or at least 1")
    if cfg.tree not in ("auto", *STATIC_TREES):
        fail("tree", cfg.tree, f"use auto or one of {', '.join(STATIC_TREES)}")
    if cfg.heldout_skip is not None and cfg.heldout_skip < 0:
        fail("heldout_skip", cfg.heldout_skip, "use None (from the export) or a count of conversations >= 0")
    if cfg.tie_prompts < 0:
        fail("tie_prompts", cfg.tie_prompts, "use 0 (no tie tolerance: any difference is a mismatch) or a count")
    if cfg.dtype not in ("fp32", "bf16", "fp16", "auto", "fast"):
        fail("dtype", cfg.dtype, "use fp32, bf16, fp16, auto (fp32 on CPU) or fast (bf16 where the hardware "
             "runs it fast, else fp32)")
    if any(k < 1 for k in cfg.sweep_k) or any(w < 1 for w in cfg.sweep_w):
        fail("sweep_k/sweep_w", (cfg.sweep_k, cfg.sweep_w), "give lists of positive row counts / row lengths")
    if cfg.serve_tolerance < 0 or cfg.serve_timeout <= 0:
        fail("serve_tolerance/serve_timeout", (cfg.serve_tolerance, cfg.serve_timeout),
             "use a tolerance >= 0 and a timeout > 0 seconds")
    if cfg.serve_ngram_w < 0 or cfg.serve_ngram_q < 1 or not 1 <= cfg.serve_ngram_q_min <= cfg.serve_ngram_q:
        fail("serve_ngram_w/q/q_min", (cfg.serve_ngram_w, cfg.serve_ngram_q, cfg.serve_ngram_q_min),
             "use w >= 0 (0 = the draft's depth) and 1 <= q_min <= q")
    if cfg.serve_llamacpp_base_type not in ("q4_1", "f32", "f16", "bf16", "q8_0"):
        fail("serve_llamacpp_base_type", cfg.serve_llamacpp_base_type, "use q4_1 (the packaged SmolLM2 GGUF), f32, "
             "f16, bf16 or q8_0")
    if cfg.serve_llamacpp_draft_type not in ("f32", "f16", "bf16", "q8_0"):
        fail("serve_llamacpp_draft_type", cfg.serve_llamacpp_draft_type, "use f32, f16, bf16 or q8_0")
    if cfg.serve_llamacpp_threads < 1:
        fail("serve_llamacpp_threads", cfg.serve_llamacpp_threads, "use at least 1 thread")
    if cfg.suite_prompts is not None and cfg.suite_prompts < 1:
        fail("suite_prompts", cfg.suite_prompts, "use None (the suite's own count) or at least 1 prompt per set")
    if not isinstance(cfg.extra, dict):
        fail("extra", cfg.extra, "give a mapping of the drafter's options, e.g. {beam_width: 8}")
    cfg.extra = typed_extra(cfg.extra)
    return cfg


def typed_extra(extra: dict) -> dict:
    """`extra` typed by the families' declared options (models/families/<family>/drafter.py `Options`): an undeclared
    key or a value of the wrong type is a ConfigError now, not after the export and its base have loaded."""
    from eval.engine.drafters.options import OptionsError, check_extra
    from eval.engine.drafters.registry import DRAFTERS

    try:
        return check_extra(extra, {name: spec.options for name, spec in DRAFTERS.items()})
    except OptionsError as exc:
        raise ConfigError(str(exc)) from None


def load_eval_config(config_paths: list[str] | None = None, overrides: list[str] | None = None) -> EvalConfig:
    return validate_eval(load_typed(EvalConfig, config_paths, overrides))
