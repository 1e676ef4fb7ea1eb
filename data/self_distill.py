"""Self-distillation (Medusa-2 §2.3; docs/concepts.md#on-policy-data): replace ShareGPT's ChatGPT answers with
the base's own.

A draft head learns to predict what the *base* will say next; trained on ChatGPT's answers it learns a
different distribution, and acceptance suffers. So we keep the ShareGPT prompts and regenerate every
assistant turn with the frozen base (greedy or temperature T), batched with left padding, and write
the result as ShareGPT JSONL, so `data.source=<that file>` goes through the normal reader/renderer.

Files (default under $SPECDRAFT_CACHE or ~/.cache/specdraft, `selfdistill/<key>.jsonl`):
    <out>.partial    header line {"selfdistill_key"} + one line per source conversation, appended and
                     fsynced batch by batch (records, or {"skipped": reason} markers), so a killed build
                     resumes after the last line and the skip counts survive the restart
    <out>.meta.json  derived_from {source, max_records} (eval's held-out skip), params, counts
    <out>            clean records {"id", "conversations"}; written last by an atomic rename
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import GenerationConfig

from core.atomic import write_text_atomic
from data.sharegpt import PACKAGED_SOURCE, read_sharegpt, source_path

SELFDISTILL_VERSION = 1  # bump when generation or the record format changes what a file contains
_TO_SHAREGPT = {"system": "system", "user": "human", "assistant": "gpt"}
EMPTY, TOO_LONG = "empty_answer", "prompt_too_long"  # skip reasons (meta: skipped_empty, skipped_long)


def distill_key(base, source: str, max_records, max_new_tokens, temperature, max_turns, seed,
                max_prompt_tokens) -> str:
    """16 hex chars over what the answers depend on. Like data/hidden_cache.cache_key, the base's dtype
    is part of it (bf16 and fp32 greedy decodes differ); a path source counts with its size and mtime."""
    path = source_path(source).resolve()
    st = path.stat()
    material = [SELFDISTILL_VERSION, base.fingerprint, str(base.model.dtype), source, str(path), st.st_size,
                st.st_mtime_ns, max_records, max_new_tokens, float(temperature), max_turns, seed, max_prompt_tokens]
    return hashlib.sha256(json.dumps(material).encode()).hexdigest()[:16]


def sidecar(path: str | os.PathLike) -> Path:
    return Path(path).expanduser().with_name(Path(path).name + ".meta.json")


def train_data_entry(source: str, max_records: int | None) -> dict:
    """The export's `train_data`; for a self-distilled file also the ShareGPT slice its prompts came
    from (`derived_from`), so eval holds those conversations out (eval/runner.resolve_heldout_skip)."""
    entry = {"source": source, "max_records": max_records}
    meta = sidecar(source) if source != PACKAGED_SOURCE else None
    if meta is not None and meta.is_file():
        derived = json.loads(meta.read_text()).get("derived_from")
        if derived:
            entry["derived_from"] = derived
    return entry


def build_self_distilled(base, source: str = "sharegpt", max_records: int | None = 800, out=None,
                         max_new_tokens: int = 256, temperature: float = 0.0, max_turns: int = 1,
                         batch_size: int = 16, seed: int = 0, *, max_prompt_tokens: int = 1024,
                         cache_dir=None) -> Path:
    """Write (or reuse) the self-distilled ShareGPT JSONL of the first `max_records` valid conversations of
    `source`; return its path. `base` has .model/.tokenizer/.fingerprint/.name (models.base.load_base).
    Prompts longer than `max_prompt_tokens` are skipped (a 1024-token training window would hold no answer)."""
    if max_new_tokens < 1 or max_turns < 1 or batch_size < 1 or temperature < 0 or max_prompt_tokens < 1:
        raise ValueError(f"self-distill: need max_new_tokens, max_turns, batch_size, max_prompt_tokens >= 1 and "
                         f"temperature >= 0 (got {max_new_tokens}, {max_turns}, {batch_size}, {max_prompt_tokens},"
                         f" {temperature})")
    key = distill_key(base, source, max_records, max_new_tokens, temperature, max_turns, seed, max_prompt_tokens)
    if out is None:
        from core.paths import default_cache_dir  # late: data/ stays importable without the model code

        out = Path(cache_dir or default_cache_dir()).expanduser() / "selfdistill" / f"{key}.jsonl"
    out = Path(out).expanduser()
    meta_path, partial = sidecar(out), out.with_name(out.name + ".partial")
    if out.is_file():
        found = json.loads(meta_path.read_text()).get("key") if meta_path.is_file() else None
        if found not in (None, key):
            raise ValueError(f"{out} was self-distilled with other settings or another base (key {found}, "
                             f"these need {key}); delete it or pick another --out")
        print(f"self-distill: reusing {out}")
        return out

    conversations, _ = read_sharegpt(source, max_records)
    done, skipped, tokens = _resume(partial, key)  # source conversations already handled
    model, tok = base.model, base.tokenizer
    eos = sorted({*_as_list(getattr(model.generation_config, "eos_token_id", None)), *_as_list(tok.eos_token_id)})
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]  # pad = eos when the tokenizer has none
    gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                               do_sample=temperature > 0, **(dict(temperature=temperature, top_k=0, top_p=1.0)
                                                             if temperature > 0 else {}))
    prefix = "sharegpt" if source == PACKAGED_SOURCE else Path(source).stem
    bar = tqdm(total=len(conversations), initial=done, unit="rec", desc="self-distill", dynamic_ncols=True)
    new_tokens, t0 = 0, time.perf_counter()
    with open(partial, "a", encoding="utf-8") as f:
        for start in range(done, len(conversations), batch_size):
            batch = conversations[start:start + batch_size]
            # Sampling: the seed depends on the batch's first index only, so a resumed build draws the same.
            with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
                torch.manual_seed(seed * 1_000_003 + start)
                results = _distill_batch(model, tok, batch, gen_cfg, max_turns, max_prompt_tokens)
            lines = []
            for i, (messages, n_tok, reason) in enumerate(results, start=start):
                rec = {"id": f"{prefix}-{i}", "generated_tokens": n_tok}
                rec.update({"skipped": reason} if reason else {"conversations": [
                    {"from": _TO_SHAREGPT[m["role"]], "value": m["content"]} for m in messages]})
                lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
                skipped[reason] = skipped.get(reason, 0) + bool(reason)
                new_tokens += n_tok
            f.write("".join(lines))  # one write per batch, then fsync: a crash loses at most this batch
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(batch))
    bar.close()
    seconds = time.perf_counter() - t0
    tokens += new_tokens
    text, records = _finalize(partial)
    if records == 0:
        raise ValueError(f"self-distill: the base gave no usable answer for any of the {len(conversations)} "
                         f"conversations of {source!r} (empty: {skipped.get(EMPTY, 0)}, prompt too long: "
                         f"{skipped.get(TOO_LONG, 0)}); raise max_new_tokens / max_records")
    meta = {"derived_from": {"source": source, "max_records": max_records}, "key": key, "base": base.name,
            "base_fingerprint": base.fingerprint, "base_dtype": str(model.dtype).removeprefix("torch."),
            "max_new_tokens": max_new_tokens, "temperature": temperature, "max_turns": max_turns, "seed": seed,
            "max_prompt_tokens": max_prompt_tokens, "records": records, "skipped_empty": skipped.get(EMPTY, 0),
            "skipped_long": skipped.get(TOO_LONG, 0), "generated_tokens": tokens}
    write_text_atomic(meta_path, json.dumps(meta, indent=2) + "\n")  # before <out>: <out> present => meta present
    write_text_atomic(out, text)
    partial.unlink()
    print(f"self-distill: {records} records ({skipped.get(EMPTY, 0)} empty answers, {skipped.get(TOO_LONG, 0)} "
          f"prompts too long skipped); {new_tokens:,} tokens generated in {seconds:.1f} s "
          f"({new_tokens / max(seconds, 1e-9):.1f} tok/s) -> {out}")
    return out


@torch.no_grad()
def _distill_batch(model, tok, batch: list[list[dict]], gen_cfg, max_turns: int, max_prompt_tokens: int):
    """[(messages, generated tokens, skip reason or "")] per conversation. Turn j of every conversation that
    has one is generated in one batched call, conditioned on the base's own answers to turns < j."""
    plans = [_plan(conv, max_turns) for conv in batch]
    dialogs = [list(system) for system, _ in plans]
    n_tok, reason = [0] * len(batch), [""] * len(batch)
    for turn in range(max_turns):
        rows = [i for i, (_, users) in enumerate(plans) if not reason[i] and turn < len(users)
                and len(dialogs[i]) == len(plans[i][0]) + 2 * turn]  # still going: every earlier turn answered
        prompts = []
        for i in list(rows):
            ids = tok(tok.apply_chat_template(dialogs[i] + [{"role": "user", "content": plans[i][1][turn]}],
                                              tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"]
            if len(ids) > max_prompt_tokens:  # first turn: skip the record; later: keep the turns so far
                reason[i] = TOO_LONG if turn == 0 else ""
                rows.remove(i)
            else:
                prompts.append(ids)
        if not rows:
            break
        answers = _generate(model, tok, prompts, gen_cfg)
        for i, (text, n) in zip(rows, answers):
            n_tok[i] += n
            if not text:
                reason[i] = EMPTY
            else:
                dialogs[i] += [{"role": "user", "content": plans[i][1][turn]}, {"role": "assistant", "content": text}]
    return [(d, n, r or ("" if len(d) > len(p[0]) else EMPTY)) for d, n, r, p in zip(dialogs, n_tok, reason, plans)]


def _generate(model, tok, prompts: list[list[int]], gen_cfg) -> list[tuple[str, int]]:
    """Batched `generate` over token-id prompts, left padded: ids/attention [B, P] -> new tokens [B, <=N].
    Returns (decoded answer, special tokens skipped and stripped; tokens generated up to and with eos)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), gen_cfg.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding: every row's last prompt token sits at column P-1
        ids[b, width - len(p):] = torch.tensor(p)
        attn[b, width - len(p):] = 1
    out = model.generate(input_ids=ids.to(model.device), attention_mask=attn.to(model.device),
                         generation_config=gen_cfg)  # [B, P + N'], finished rows padded with pad_token_id
    results = []
    for row in out[:, width:].tolist():
        cut = next((k + 1 for k, t in enumerate(row) if t in gen_cfg.eos_token_id), len(row))
        results.append((tok.decode(row[:cut], skip_special_tokens=True).strip(), cut))
    return results


def _plan(conv: list[dict], max_turns: int) -> tuple[list[dict], list[str]]:
    """(leading system turns, the first `max_turns` user turns) of a read_sharegpt conversation; the
    ShareGPT assistant turns are dropped, the base answers instead."""
    system = []
    for m in conv:
        if m["role"] != "system":
            break
        system.append(m)
    return system, [m["content"] for m in conv if m["role"] == "user"][:max_turns]


def _resume(partial: Path, key: str) -> tuple[int, dict, int]:
    """(conversations done, skip counts, tokens) from a partial file; keeps only its complete lines."""
    if not partial.is_file():
        write_text_atomic(partial, json.dumps({"selfdistill_key": key}) + "\n")
        return 0, {}, 0
    raw = partial.read_bytes()
    good = raw[:raw.rfind(b"\n") + 1]  # a line cut by the crash is dropped and regenerated
    damaged = f"{partial} is damaged (%s); delete it to start the generation over"
    try:
        lines = good.decode("utf-8").splitlines()
        records = [json.loads(line) for line in lines]
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(damaged % f"{type(err).__name__}: {err}") from None
    found = records[0].get("selfdistill_key") if records and isinstance(records[0], dict) else None
    if found != key:
        raise ValueError(f"{partial} belongs to another self-distillation (key {found}; these settings and base need "
                         f"{key}); delete it, or pick another --out")
    if len(good) != len(raw):
        print(f"self-distill: {partial} ended in a line cut by a kill ({len(raw) - len(good)} bytes); dropped, that "
              "conversation is generated again", flush=True)
        with open(partial, "r+b") as f:
            f.truncate(len(good))
    skipped, tokens = {}, 0
    for rec in records[1:]:
        tokens += rec.get("generated_tokens", 0)
        if rec.get("skipped"):
            skipped[rec["skipped"]] = skipped.get(rec["skipped"], 0) + 1
    if len(lines) > 1:
        print(f"self-distill: resuming {partial} after {len(lines) - 1} conversations")
    return len(lines) - 1, skipped, tokens


def _finalize(partial: Path) -> tuple[str, int]:
    """The clean records of the partial file (header, skip markers and counters dropped) as JSONL text, and their
    count; the caller writes them to `<out>` once the metadata is on disk."""
    records = [rec for line in partial.read_text(encoding="utf-8").splitlines()[1:]
               if "conversations" in (rec := json.loads(line))]
    text = "".join(json.dumps({"id": r["id"], "conversations": r["conversations"]}, ensure_ascii=False) + "\n"
                   for r in records)
    return text, len(records)


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]
