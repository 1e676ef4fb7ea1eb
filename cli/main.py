"""`specdraft` command line: train, cache, eval, tree-search, compare, export, serve-check, tune, ship, self-distill,
demo, config-reference (docs/architecture.md)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from cli import CONFIGS
from cli.card import add_card_parser, cmd_card
from cli.field import (
    add_field_judge_parser,
    add_field_paired_parser,
    add_field_parsers,
    cmd_field,
    cmd_field_paired,
    cmd_field_refs,
)
from cli.ship import add_ship_parser, cmd_ship
from core.config_loader import ConfigError
from eval.tune.command import add_tune_parser, cmd_tune


def _add_config_args(p: argparse.ArgumentParser, default_help: str) -> None:
    p.add_argument("--config", action="append", default=[], metavar="YAML",
                   help=f"YAML delta over the typed defaults; repeat to stack ({default_help})")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides, e.g. train.lr=3e-4 run_name=x")


def _parser() -> argparse.ArgumentParser:
    from eval.serving.llamacpp_gguf import BASE_TYPES, CONVERT_TYPES  # GGUF types, one list
    from models.family import EXPORT_FORMATS

    parser = argparse.ArgumentParser(prog="specdraft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a draft (1 process; use launch/train_draft.py under deepspeed for N)")
    _add_config_args(p, "e.g. --config configs/medusa.yaml --config configs/smoke.yaml")

    p = sub.add_parser("cache", help="build the hidden-state cache of a training config (N ranks: "
                       "launch/build_cache.py under deepspeed)")
    p.add_argument("--verify", action="store_true", help="also check every shard's sha256 (not only its size) and "
                   "rebuild the bad ones (= data.hidden_cache_verify=true)")
    _add_config_args(p, "the same configs as `specdraft train`")

    p = sub.add_parser("eval", help="measure a draft (or --method ngram) with the speculative decoder")
    p.add_argument("--draft", help="an export directory (runs/<run>/export)")
    p.add_argument("--method", default=None, help="learning-free method instead of --draft (e.g. ngram)")
    p.add_argument("--suite", default=None, help="an evaluation suite (configs/eval/suites/NAME.yaml): all its sets")
    _add_config_args(p, "default configs/eval/mtbench.yaml")

    p = sub.add_parser("tree-search", help="data-driven static tree for a draft (Hydra §4), stored in its export")
    p.add_argument("--draft", required=True, help="an export directory (runs/<run>/export)")
    _add_config_args(p, "default configs/eval/tree_search.yaml")

    p = sub.add_parser("compare", help="all drafts of a compare config side by side on the same prompts -> tables "
                       "and plots in <out_dir>/results.md")
    p.add_argument("--results-only", action="store_true", help="only regenerate the tables from finished runs")
    p.add_argument("--update-docs", action="store_true",
                   help="write the tables into the config's checked-in results document (docs_md) instead")
    p.add_argument("--only", action="append", default=[], metavar="LABEL", help="only these drafts (repeat)")
    p.add_argument("--redo", action="append", default=[], metavar="LABEL",
                   help="run these drafts again although stored, beside freshly timed baselines (repeat)")
    _add_config_args(p, "default configs/compare.yaml")

    p = sub.add_parser("export", help="convert a run's export to another format")
    p.add_argument("--run", help="the run directory (runs/<run>)")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--base-type", default="f32", choices=BASE_TYPES,
                   help="--format gguf: the base's GGUF type (q4_1 = the packaged SmolLM2 file as is; f32 matches our "
                   "fp32 decoder exactly)")
    p.add_argument("--draft-type", default="f32", choices=CONVERT_TYPES,
                   help="--format gguf: the draft's GGUF type")
    p.add_argument("--method", default=None, help="--format vllm for a learning-free method (ngram), no --run")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="--method ngram: extra.w=4 extra.q=2")

    p = sub.add_parser("serve-check", help="serve a draft in vLLM (.venv-vllm) and/or llama.cpp beside our decoder "
                       "on the same prompts; fails when the acceptance differs")
    p.add_argument("--draft", help="an export directory (runs/<run>/export)")
    p.add_argument("--method", default=None, help="learning-free method instead of --draft (ngram)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="max |acceptance difference| per position (default 0.03, or the eval config's serve_tolerance)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per engine run (default 1800)")
    p.add_argument("--engine", default="auto", choices=["auto", "vllm", "llamacpp", "all"],
                   help="vllm (.venv-vllm, `make vllm`), llamacpp (llama-server, `make llamacpp`), all; auto: vllm "
                   "where installed, else llamacpp")
    _add_config_args(p, "default configs/eval/mtbench.yaml")

    add_tune_parser(sub)
    add_ship_parser(sub)

    for name, what, turns in (("regenerate", "regenerate the assistant turns of ShareGPT conversations with the base, "
                               "turn by turn (on-policy data)", 8),
                              ("self-distill", "the same as regenerate, first turns only by default (Medusa-2's "
                               "self-distillation)", 1)):
        p = sub.add_parser(name, help=what)
        p.add_argument("--base", default="smollm2", help="base model: smollm2, tiny, or an HF directory")
        p.add_argument("--source", default="sharegpt", help="sharegpt (packaged) or a ShareGPT .json/.jsonl path")
        p.add_argument("--max-records", type=int, default=800, help="the first N valid conversations (eval skips "
                       "them)")
        p.add_argument("--skip", type=int, default=0, help="start after this many valid conversations (a held-out "
                       "slice: --skip 800 --max-records 64)")
        p.add_argument("--out", default=None, help="output JSONL (default ~/.cache/specdraft/selfdistill/<key>.jsonl)")
        p.add_argument("--store", default=None, help="a lasting copy in the repository (e.g. "
                       "datasets/smollm2-onpolicy): the build starts from what it holds and writes back to it every "
                       "few minutes; train with data.source=<that directory>")
        p.add_argument("--max-minutes", type=float, default=None, help="time budget: no batch starts after it; what is "
                       "done is written (metadata complete: false) and the same command continues it")
        p.add_argument("--pack-only", action="store_true", help="only copy what the partial file holds into --store "
                       "(while a regeneration runs in another process), generate nothing")
        p.add_argument("--any-engine", action="store_true", help="extend a --store made by another engine (recorded "
                       "in its card's segments)")
        p.add_argument("--fast-rows", type=int, default=None, help="--engine fast: sequences decoded at once (its KV "
                       "cache rows; default --batch-size); with --batch-size larger, finished rows take the next "
                       "waiting conversation's turn, so answers of different lengths keep the batch full (GPU: "
                       "--batch-size 2048 --fast-rows 512)")
        p.add_argument("--hf-cache", default="dynamic", choices=["dynamic", "static"],
                       help="--engine hf: transformers' KV cache (static: preallocated, compiled on CUDA)")
        p.add_argument("--engine", default="auto", choices=["auto", "hf", "hf-cb", "fast", "vllm"],
                       help="vllm: vLLM's engine from .venv-vllm (`make vllm`); fast: our batched static-cache engine "
                       "(LLaMA-family bases; CUDA graphs on a GPU); hf: transformers generate here; hf-cb: "
                       "transformers' continuous batching (paged cache; --batch-size prompts per call); auto: vllm "
                       "when .venv-vllm exists, else fast on CUDA, else hf-cb")
        p.add_argument("--max-new-tokens", type=int, default=256, help="per answer; longer answers are cut, kept "
                       "and counted")
        p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
        p.add_argument("--max-turns", type=int, default=turns, help="user turns regenerated per conversation")
        p.add_argument("--max-prompt-tokens", type=int, default=1024, help="a longer first prompt skips the record")
        p.add_argument("--token-budget", type=int, default=512, help="stop a conversation once its rendered length "
                       "reaches this many tokens: the training length (data.max_length; 512 in the recipes), which "
                       "training never reads past; 0 = generate every turn in full")
        p.add_argument("--batch-size", type=int, default=16, help="conversations per engine call (vllm: try 256)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--dtype", default="auto", choices=["auto", "fast", "fp32", "bf16", "fp16"])
        p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")

    p = sub.add_parser("demo", help="the main job: train a Hydra draft on SmolLM2 + ShareGPT on this machine, evaluate")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides for the training recipe")

    p = sub.add_parser("config-reference", help="every config key with its type, default and meaning (Markdown), "
                       "generated from the typed configs")
    p.add_argument("--out", help="write to this file (docs/reference/config.md) instead of stdout")

    p = sub.add_parser("docs-families", help="the families tables of README.md and docs/families/README.md, "
                       "generated from the families' declarations (FamilyFacts)")
    p.add_argument("--check", action="store_true", help="only check: exit 1 when a page is out of date")
    add_field_parsers(sub)
    add_field_judge_parser(sub)
    add_field_paired_parser(sub)
    add_card_parser(sub)
    return parser


def _strip_launcher_args(argv: list[str]) -> list[str]:
    """The deepspeed launcher appends --local_rank=N; the rank comes from the environment instead."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a.startswith("--local_rank") or a.startswith("--local-rank"):
            skip = "=" not in a
            continue
        out.append(a)
    return out


def cmd_train(args) -> int:
    from cli.train_decode import make_decode_eval
    from train.config import load_train_config
    from train.distributed import finish_distributed
    from train.loop import TrainingInterrupted, train

    cfg = load_train_config(args.config, args.overrides)
    try:
        run_dir = train(cfg, decode_eval=make_decode_eval(cfg))  # None unless train.decode_eval_prompts > 0
    except TrainingInterrupted as exc:
        print(f"specdraft train: {exc}", file=sys.stderr)
        finish_distributed()
        return 143
    finish_distributed()  # leave the group before exit: gloo's destructor can abort a rank whose work is done
    print(f"run directory: {run_dir}")
    return 0


def cmd_cache(args) -> int:
    from train.cache_build import build_cache
    from train.config import load_train_config
    from train.distributed import finish_distributed

    overrides = [*args.overrides, *(["data.hidden_cache_verify=true"] if args.verify else [])]
    build_cache(load_train_config(args.config, overrides))  # rank 0 prints where it is
    finish_distributed()
    return 0


def cmd_export(args) -> int:
    from models.export.formats import FORMAT_WRITERS
    from models.export.load import load_export
    from models.export.specdraft import read_export_config
    from models.registry import FAMILIES, family_facts, llamacpp_families

    if args.format == "vllm" and args.method:
        return _export_vllm_method(args)
    if not args.run:
        raise ValueError("pass --run runs/<run> (or, with --format vllm, --method ngram)")
    src = Path(args.run) / "export"
    family = read_export_config(src).get("family", "?")
    formats = family_facts(family).export_formats
    if args.format == "gguf" and args.format not in formats:
        servable = ", ".join(f"{FAMILIES[n].title} ({n}, --spec-type {FAMILIES[n].llamacpp_spec_type})"
                             for n in llamacpp_families())
        raise ValueError(f"--format gguf: llama.cpp cannot serve a {family} draft; it serves {servable}. A {family} "
                         f"draft exports as {', '.join(formats)}")
    if args.format not in formats:
        table = "; ".join(f"{n}: {', '.join(f.export_formats)}" for n, f in FAMILIES.items())
        raise ValueError(f"--format {args.format}: a {family} draft exports as {', '.join(formats)} (formats by "
                         f"family: {table})")
    loaded = load_export(src)
    if args.format in ("vllm", "speculators"):  # tune's vLLM token count, only where it was measured
        import dataclasses

        from eval.choice.apply import vllm_export_config

        config, line = vllm_export_config(src, loaded.config)
        loaded = dataclasses.replace(loaded, config=config)
        if line:
            print(f"specdraft export: {line}")
    if args.format == "gguf":  # llama.cpp: base.gguf + draft.gguf through llama.cpp's own converter
        out = _export_gguf(loaded, Path(args.out), args.base_type, args.draft_type)
        if out is None:
            return 3
    else:
        out = FORMAT_WRITERS[args.format](loaded, Path(args.out))
    print(f"wrote {args.format} export to {out}")
    return 0


def _export_gguf(loaded, out: Path, base_type: str, draft_type: str) -> Path | None:
    import tempfile

    from eval.serving.llamacpp_gguf import export_gguf
    from eval.serving.llamacpp_paths import LlamaCppError
    from eval.serving.serve_check import base_hf_dir

    with tempfile.TemporaryDirectory(prefix="specdraft-gguf-base-") as tmp:
        try:
            return export_gguf(loaded.base, loaded.draft, loaded.config, base_hf_dir(loaded.base, Path(tmp)), out,
                               base_type, draft_type)
        except LlamaCppError as exc:
            print(f"specdraft export: {exc}", file=sys.stderr)
            return None


def _export_vllm_method(args) -> int:
    """`specdraft export --format vllm --method ngram --out DIR [extra.w=N extra.q=M]`: vLLM's speculative_config."""
    from eval.harness.config import load_eval_config
    from models.registry import family_spec, learning_free_vllm_families

    if args.method not in learning_free_vllm_families():
        raise ValueError(f"--method {args.method!r}: the learning-free methods vLLM serves: "
                         f"{', '.join(learning_free_vllm_families())}")
    cfg = load_eval_config([str(CONFIGS / "eval" / f"{args.method}.yaml")], args.overrides)
    out = family_spec(args.method).writers["vllm"](cfg.extra, Path(args.out))  # a learning-free family's writer
    print(f"wrote vllm export to {out}")
    return 0


def cmd_serve_check(args) -> int:
    from eval.serving.serve_check import run_serve_check_cli

    return run_serve_check_cli(args)


def cmd_eval(args) -> int:
    from eval.harness.runner import run_eval_cli
    from eval.tune.untuned_probe import probe_untuned_shape

    return run_eval_cli(args, shape_probe=probe_untuned_shape)


def cmd_tree_search(args) -> int:
    from eval.harness.tree_search_cli import run_tree_search_cli

    return run_tree_search_cli(args)


def cmd_config_reference(args) -> int:
    from cli.config_reference import run

    return run(args.out)


def cmd_docs_families(args) -> int:
    from cli.docs_families import run

    return run(args.check)


def cmd_compare(args) -> int:
    from eval.field.compare import judge_rows
    from eval.harness.compare import run_compare_cli
    from eval.serving.compare_vllm import vllm_columns

    return run_compare_cli(args, engine_columns=vllm_columns, field_rows=judge_rows)


def cmd_regenerate(args) -> int:
    from core.hardware import resolve_device
    from core.paths import default_cache_dir
    from data.self_distill import HFGenerator, build_self_distilled, end_of_turn_ids
    from eval.serving.serve_check import ServeCheckError, vllm_python
    from models.base import load_base

    engine_name = args.engine
    device = resolve_device(args.device)
    if engine_name == "auto":
        from eval.serving.vllm_generate import auto_engine

        try:
            py = vllm_python()
        except ServeCheckError:
            py = None
        engine_name, why = auto_engine(device.type, py)
        print(f"regenerate: --engine auto: {engine_name} ({why})", flush=True)
    base = load_base(args.base, dtype=args.dtype, device=device)
    context = int(getattr(base.model.config, "max_position_embeddings", 0) or 0)
    if context and args.max_prompt_tokens + args.max_new_tokens > context:
        fits = context - args.max_new_tokens
        if fits < 16:
            raise ValueError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in {base.name}'s "
                             f"{context}-token context; lower it")
        print(f"regenerate: {base.name} reads at most {context} tokens: prompts longer than {fits} tokens are "
              f"skipped (--max-prompt-tokens {args.max_prompt_tokens} lowered)", flush=True)
        args.max_prompt_tokens = fits
    settings = dict(max_records=args.max_records, skip=args.skip, out=args.out, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, max_turns=args.max_turns, batch_size=args.batch_size,
                    seed=args.seed, max_prompt_tokens=args.max_prompt_tokens, token_budget=args.token_budget,
                    any_engine=args.any_engine, pack_only=args.pack_only,
                    max_seconds=None if args.max_minutes is None else 60 * args.max_minutes)
    if args.store:
        settings.update(store=args.store, store_info=_store_commands(args))
    if engine_name == "hf":
        tok, eos = base.tokenizer, end_of_turn_ids(base)
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
        engine = HFGenerator(base.model, eos, pad, args.max_new_tokens, args.temperature, cache=args.hf_cache)
        out = build_self_distilled(base, args.source, **settings, engine=engine)
    elif engine_name == "hf-cb":
        from data.cb_generate import HFCBGenerator

        engine = HFCBGenerator(base.model, end_of_turn_ids(base), args.max_new_tokens, args.temperature)
        out = build_self_distilled(base, args.source, **settings, engine=engine)
    elif engine_name == "fast":
        from eval.engine.batch_generate import BatchOutOfMemory, FastBatchGenerator

        engine = FastBatchGenerator(base.model, end_of_turn_ids(base), args.max_new_tokens, args.temperature,
                                    batch_size=args.fast_rows or args.batch_size)
        try:
            out = build_self_distilled(base, args.source, **settings, engine=engine)
        except BatchOutOfMemory as exc:  # one line with the flag to change; what was generated is kept
            raise ValueError(f"{exc}: rerun with --fast-rows {exc.retry_rows} (what was generated is kept and "
                             "resumes)") from None
    else:
        from eval.serving.vllm_generate import VllmGenerator

        workdir = default_cache_dir() / "selfdistill" / "vllm-work"
        # A kill (SIGTERM) must take the engine's processes with it: as an exception it reaches the `with` below,
        # which kills the engine's process group; the build resumes where it stopped.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            with VllmGenerator(base, workdir, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               stop_token_ids=end_of_turn_ids(base),
                               max_model_len=args.max_prompt_tokens + args.max_new_tokens) as engine:
                out = build_self_distilled(base, args.source, **settings, engine=engine)
        except ServeCheckError as exc:  # the engine's own last log lines, in one message
            raise ValueError(str(exc)) from None
    print(out)
    return 0


def _store_commands(args) -> dict:
    """The data card's 'made_with' / 'extend_with': this command as typed, and the same with a larger
    --max-records (on any machine: the store seeds the build), less --out: a file of the machine that ran it (the
    store is the lasting copy), whose path a card in the repository must not carry."""
    import shlex

    argv, it = [], iter(a for a in sys.argv[1:] if a != "--pack-only")
    for a in it:
        if a == "--out":
            next(it, None)
        elif not a.startswith("--out="):
            argv.append(a)
    typed = "specdraft " + shlex.join(argv)
    grow = list(argv)
    if "--max-records" in grow:
        grow[grow.index("--max-records") + 1] = "N"
    else:
        grow += ["--max-records", "N"]
    return {"made_with": typed, "extend_with": "specdraft " + shlex.join(grow) + "   # N > the card's conversations",
            "store_path": args.store}


def _exit_on_sigterm(signum, frame):
    raise SystemExit(143)


def cmd_demo(args) -> int:
    from cli.demo import run_demo
    from train.loop import TrainingInterrupted

    try:
        return run_demo(args.overrides)
    except TrainingInterrupted as exc:
        print(f"specdraft demo: {exc}", file=sys.stderr)
        return 143


def main(argv: list[str] | None = None) -> int:
    argv = _strip_launcher_args(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    handler = {"train": cmd_train, "eval": cmd_eval, "export": cmd_export, "demo": cmd_demo,
               "self-distill": cmd_regenerate, "regenerate": cmd_regenerate, "cache": cmd_cache,
               "serve-check": cmd_serve_check, "tune": cmd_tune, "ship": cmd_ship,
               "tree-search": cmd_tree_search, "compare": cmd_compare,
               "config-reference": cmd_config_reference, "docs-families": cmd_docs_families,
               "field-refs": cmd_field_refs, "field": cmd_field, "field-paired": cmd_field_paired,
               "card": cmd_card}[args.command]
    try:
        return handler(args)
    except ConfigError as exc:
        print(f"specdraft {args.command}: config error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # bad input or a damaged file: the message says which and how to fix it
        print(f"specdraft {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
