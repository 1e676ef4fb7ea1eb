"""`specdraft field`: a draft's greedy acceptance simulated on the stored base answers (eval/field/refs.py),
every family, hundreds of prompts, at the drafter's cost (docs/howto/evaluate.md, "The field benchmark").

Per prompt: the base's teacher-forced pass over prompt + stored answer (every hidden state, and the aux layers an
EAGLE-3 draft reads) comes from the field cache, built once per base, dtype and aux layers and reused by every draft
judged after; the unchanged decoder loop then runs the drafter against a ReplayBackend (eval/engine/backends/
replay.py), whose verification is a lookup in the stored answer. The per-step accepted lengths are decoding's.

Two paths, and every report names its own (`meta["path"]`, field_report.path_label): `exact`, one prompt at a time
through that decoder loop; `batched`, prompts stepped together where the family declares that path (its role module
`lockstep`, found like its drafter: eval/engine/drafters/registry.py, run_lockstep; EAGLE-3, Hydra, Medusa and the
block families DFlash, DSpark and Domino have one), whose agreement with the exact path is measured on a sample of
the run's own prompts re-decoded one at a time (`measure_agreement`, recorded in `meta["agreement"]`), not assumed.

Acceptance length here = mean over decode steps of (accepted drafts + 1), counted before end-of-turn / length
truncation (eval/engine/decoder.py): the drafter's measure. Speed still needs decoding (`specdraft eval`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from core.atomic import write_json_atomic
from core.jsonl import read_finished_rows

CACHE_FORMAT = 1
# Prompts stepped together for a draft whose family has a batched path (run_field; 0 = one at a time). Measured on
# the shipped EAGLE-3, 144 cached prompts, 1 thread (a box at load 3-4): chain-4 6.9 / 6.0 / 6.1 ms a step at widths
# 32 / 64 / 128, tree 8.9 / 6.9 at 32 / 64; wider batches make the LM head's product more efficient until the tail of
# the queue dominates.
LOCKSTEP_WIDTH = 64
# Prompts of a batched (lockstep) run re-decoded one at a time to measure its agreement with the exact path (0 = none).
AGREEMENT_SAMPLE = 8
# The default run (no --full / --num-prompts): each set's first DEFAULT_PER_SET prompts; a set whose prompts +
# answers average over twice the whole store's mean tokens a prompt (long-context) its first half as many. On the
# SmolLM2 store: 305 of 1,088 prompts, 22 % of the base-pass tokens (the field cache) over all 11 sets.
DEFAULT_PER_SET = 29
# Seconds of judging per stored answer token, as recorded on a 2-core AMD EPYC (AVX512-BF16), 1 thread, fp32, the
# shipped EAGLE-3, all 1,088 answers (215,866 tokens; drafts/smollm2-eagle3-store/field/*/field.json "seconds"):
# batched chain of 4 401 s, batched 16-node tree 667 s. The exact path, one prompt at a time: EXACT_SLOWDOWN x that
# (roughly: the shipped reports' 8-prompt agreement samples, 1,632 answer tokens re-decoded exactly in 52-56 s with
# their base passes, 1 thread, a loaded 2-core AMD EPYC: some 15-30 ms a token against 1.9-3.1 batched).
JUDGE_SECONDS_PER_TOKEN = {"chain": 401 / 215866, "tree": 667 / 215866}
EXACT_SLOWDOWN = 8.0


@dataclass
class SimRow:
    """One prompt's simulated decode."""

    id: str
    set: str
    accept_lengths: list[int]  # per step: accepted drafts + 1
    accepted_per_depth: list[int]  # [k]: steps with >= k+1 accepted drafts
    proposed_per_depth: list[int]  # [k]: steps whose tree reached depth k+1
    tree_nodes: int
    new_tokens: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def teacher_forced(backend, seq: torch.Tensor, aux_layers: tuple[int, ...]):
    """One forward of the base over seq [S] through `backend` (the decoder's own base code): (hidden [S, d], aux
    [S, k*d] or None, argmax [S] long: the base's greedy token after each position)."""
    backend.reset(seq.numel() + 1)
    backend.set_aux_layers(aux_layers)
    logits, hidden = backend.prefill(seq.to(backend.device))
    aux = backend.last_aux if aux_layers else None
    return hidden, aux, logits.argmax(dim=-1).cpu()


def simulate(drafter, prompt: list[int], answer: list[int], n: int, hidden: torch.Tensor, aux: torch.Tensor | None,
             aux_layers: tuple[int, ...], vocab_size: int, eos: list[int]):
    """The decoder's GenerationResult for `drafter` on one stored answer (n: the answer's decoded length), computed
    against a ReplayBackend; its tokens are the stored answer's first n by construction."""
    from eval.engine.backends.replay import ReplayBackend
    from eval.engine.decoder import speculative_generate

    seq = torch.tensor(list(prompt) + list(answer), dtype=torch.long)
    backend = ReplayBackend(seq, hidden, vocab_size, aux, aux_layers)
    res = speculative_generate(backend, drafter, torch.tensor(prompt), max_new_tokens=n, eos_ids=eos)
    if res.tokens != list(answer[: len(res.tokens)]):  # cannot happen: every committed token is a stored one
        raise RuntimeError("simulated decoding left the stored answer")
    return res


def sim_row(ref, res) -> SimRow:
    return SimRow(ref.id, ref.set, list(res.accepted_lengths), list(res.accept_counts), list(res.proposed_counts),
                  res.tree_nodes, len(res.tokens) - 1)


# -- the field cache: the base's teacher-forced pass over every stored answer ------------------------------------

def cache_dir(base, dtype: torch.dtype, backend_name: str, aux_layers: tuple[int, ...],
              root: Path | None = None) -> Path:
    from core.paths import default_cache_dir

    key = hashlib.sha256(json.dumps({"v": CACHE_FORMAT, "fp": base.fingerprint, "dtype": str(dtype),
                                     "backend": backend_name, "aux": list(aux_layers)},
                                    sort_keys=True).encode()).hexdigest()[:16]
    return Path(root or default_cache_dir()) / "field_cache" / key


def cache_file(directory: Path, ref) -> Path:
    """One prompt's file, named by its id and the hash of its tokens: a store rebuilt or grown reuses every
    unchanged prompt's pass, and a changed answer never reads a stale one."""
    digest = hashlib.sha256(json.dumps([ref.prompt, ref.answer]).encode()).hexdigest()[:12]
    return directory / f"{ref.id}-{digest}.safetensors"


def ensure_cache(refs: list, base, backend_name: str, aux_layers: tuple[int, ...], *,
                 root: Path | None = None, progress: bool = True) -> Path:
    """Build the missing per-prompt files of the field cache (resumable: one file per prompt, written atomically);
    returns the directory. Also records, per prompt, where this machine's teacher-forced argmax differs from the
    stored answer (near-exact ties between engines: the only way the simulation can part from decoding here)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from eval.engine.backends.choice import make_backend

    dtype = next(base.model.parameters()).dtype
    out = cache_dir(base, dtype, backend_name, aux_layers, root)
    out.mkdir(parents=True, exist_ok=True)
    todo = [r for r in refs if not cache_file(out, r).is_file()]
    if todo:
        backend = make_backend(backend_name, base.model)
        for r in tqdm(todo, desc="field cache: the base's pass over stored answers", unit="prompt",
                      dynamic_ncols=True, disable=not progress):
            seq = torch.tensor(r.prompt + r.answer, dtype=torch.long)
            with torch.inference_mode():
                hidden, aux, argmax = teacher_forced(backend, seq, aux_layers)
            t = len(r.prompt)
            differ = (argmax[t - 1: t - 1 + len(r.answer)] != torch.tensor(r.answer)).nonzero().flatten()
            tensors = {"hidden": hidden.contiguous().cpu(), "differs": differ.to(torch.int32)}
            if aux is not None:
                tensors["aux"] = aux.contiguous().cpu()
            tmp = out / f".{r.id}.{os.getpid()}.tmp"
            save_file(tensors, str(tmp))
            tmp.replace(cache_file(out, r))
        del backend
    write_json_atomic(out / "manifest.json", {"format": CACHE_FORMAT, "base_fingerprint": base.fingerprint,
                                              "dtype": str(dtype), "backend": backend_name,
                                              "aux_layers": list(aux_layers)})
    return out


def load_cached(directory: Path, ref, device) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    from safetensors.torch import load_file

    t = load_file(str(cache_file(directory, ref)))
    aux = t.get("aux")
    return t["hidden"].to(device), (aux.to(device) if aux is not None else None), t["differs"].tolist()


# -- judging a draft ---------------------------------------------------------------------------------------------

def first_per_set(refs: list, n: int) -> list:
    """The first n prompts of each set, in store order."""
    seen: dict[str, int] = {}
    out = []
    for r in refs:
        seen[r.set] = seen.get(r.set, 0) + 1
        if seen[r.set] <= n:
            out.append(r)
    return out


def shard(items: list, rank: int, world: int) -> list:
    """Every world-th item from rank: prompts shard over ranks like the training launcher's (RANK / WORLD_SIZE)."""
    return items[rank::world]


def uses_lockstep(drafter, lockstep: int) -> bool:
    """Whether run_field steps `drafter` in lockstep: its family declares a batched path (its role module
    `lockstep`: run_lockstep, eval/engine/drafters/registry.py) and the width is >= 1; every other family (or
    lockstep=0) takes the per-prompt path."""
    from eval.engine.drafters.registry import lockstep_runner

    return lockstep >= 1 and lockstep_runner(drafter) is not None


def default_subset(refs: list, per_set: int = DEFAULT_PER_SET) -> list:
    """The default run's prompts, in store order: each set's first `per_set`, and the first ceil(per_set / 2) of a
    set whose prompts + stored answers average over twice the mean tokens a prompt of `refs` (its base pass costs
    about that much more). Deterministic: the same store gives the same prompts on every machine."""
    def tokens(r) -> int:
        return len(r.prompt) + len(r.answer)

    mean = sum(map(tokens, refs)) / max(1, len(refs))
    sets: dict[str, list] = {}
    for r in refs:
        sets.setdefault(r.set, []).append(r)
    quota = {s: per_set if sum(map(tokens, rs)) / len(rs) <= 2 * mean else -(-per_set // 2) for s, rs in sets.items()}
    seen: dict[str, int] = {}
    out = []
    for r in refs:
        seen[r.set] = seen.get(r.set, 0) + 1
        if seen[r.set] <= quota[r.set]:
            out.append(r)
    return out


def differing_steps(a: list[int], b: list[int]) -> int:
    """Steps of run `a` (accepted lengths) with no twin in run `b`: a step is (where it starts in the answer, how
    many tokens it accepted), so after a flip the two runs count as agreeing again once their steps line up."""
    def steps(lengths):
        out, at = set(), 0
        for n in lengths:
            out.add((at, n))
            at += n
        return out

    return len(steps(a) - steps(b))


ROW_FIELDS = ("accept_lengths", "accepted_per_depth", "proposed_per_depth", "tree_nodes", "new_tokens")


def agreement_sample(refs: list, n: int) -> list:
    """n of `refs` spread evenly over them (first and last included; all of them when n >= len(refs))."""
    if n <= 0 or not refs:
        return []
    if n >= len(refs):
        return list(refs)
    picked = sorted({round(k * (len(refs) - 1) / (n - 1)) for k in range(n)}) if n > 1 else [0]
    return [refs[i] for i in picked]


def exact_rows(drafter, refs: list, base, *, backend_name: str, cache_root: Path | None = None,
               max_new_tokens: int | None = None, progress: bool = False) -> dict[str, dict]:
    """id -> row of each of `refs` simulated one prompt at a time through the decoder loop (the exact path), in
    memory: what a batched run's rows are checked against."""
    from data.self_distill import end_of_turn_ids

    aux_layers = tuple(getattr(drafter, "aux_layers", None) or ())
    directory = ensure_cache(refs, base, backend_name, aux_layers, root=cache_root, progress=progress)
    eos = end_of_turn_ids(base)
    vocab = int(base.model.config.vocab_size)
    device = next(base.model.parameters()).device
    out = {}
    for r in refs:
        n = min(r.n, max_new_tokens or r.n)
        hidden, aux, differs = load_cached(directory, r, device)
        with torch.inference_mode():
            res = simulate(drafter, r.prompt, r.answer, n, hidden, aux, aux_layers, vocab, eos)
        out[r.id] = {**sim_row(r, res).to_dict(), "tf_differs": [d for d in differs if d < n]}
    return out


def compare_rows(batched: dict[str, dict], exact: dict[str, dict]) -> dict:
    """How far a batched run's rows agree with the exact path's on the same prompts: steps identical (of the exact
    path's), rows identical in every field (ROW_FIELDS), and per set the largest |AL difference| over its sampled
    prompts."""
    from eval.field.report import by_set

    ids = [i for i in exact if i in batched]
    steps = sum(len(exact[i]["accept_lengths"]) for i in ids)
    differ = sum(differing_steps(exact[i]["accept_lengths"], batched[i]["accept_lengths"]) for i in ids)
    same_rows = sum(all(batched[i][f] == exact[i][f] for f in ROW_FIELDS) for i in ids)

    def al(rows: list[dict]) -> float:
        n = sum(len(r["accept_lengths"]) for r in rows)
        return sum(sum(r["accept_lengths"]) for r in rows) / n if n else 1.0

    diffs = {s: abs(al([batched[r["id"]] for r in rs]) - al(rs)) for s, rs in by_set([exact[i] for i in ids]).items()}
    worst = max(diffs, key=diffs.get) if diffs else None
    return {"prompts": ids, "steps": steps, "identical_steps": steps - differ, "rows": len(ids),
            "identical_rows": same_rows, "max_set_al_diff": diffs[worst] if worst else 0.0,
            "max_set_al_diff_set": worst, "set_al_diff": diffs}


def measure_agreement(drafter, rows: list[dict], refs: list, base, *, backend_name: str, sample: int,
                      cache_root: Path | None = None, max_new_tokens: int | None = None) -> dict | None:
    """A batched run's measured agreement: `sample` of its prompts (agreement_sample over `refs`, the run's own)
    re-decoded one at a time and compared row for row with what the batched path wrote (compare_rows); None when
    sample is 0."""
    picked = agreement_sample(refs, sample)
    if not picked:
        return None
    t0 = time.perf_counter()
    exact = exact_rows(drafter, picked, base, backend_name=backend_name, cache_root=cache_root,
                       max_new_tokens=max_new_tokens)
    out = compare_rows({r["id"]: r for r in rows}, exact)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def cache_rate(base, backend_name: str, aux_layers: tuple[int, ...], tokens: int = 256) -> float:
    """The base's teacher-forced pass in tokens per second on this machine, now: one pass of `tokens` after a
    short warm-up (a second or two for SmolLM2 on 2 cores)."""
    from eval.engine.backends.choice import make_backend

    backend = make_backend(backend_name, base.model)
    vocab = int(base.model.config.vocab_size)
    seq = torch.arange(tokens, dtype=torch.long) % max(2, vocab - 1) + 1
    with torch.inference_mode():
        teacher_forced(backend, seq[:32], aux_layers)
        t0 = time.perf_counter()
        teacher_forced(backend, seq, aux_layers)
        seconds = time.perf_counter() - t0
    return tokens / max(seconds, 1e-6)


def judge_rate(drafter, lockstep: int) -> float:
    """Seconds of judging per stored answer token (JUDGE_SECONDS_PER_TOKEN, as recorded): chain or tree,
    batched or exact."""
    chain = getattr(drafter, "mode", None) == "chain" or getattr(drafter, "parallel", False)
    rate = JUDGE_SECONDS_PER_TOKEN["chain" if chain else "tree"]
    return rate if uses_lockstep(drafter, lockstep) else rate * EXACT_SLOWDOWN


def estimate_cost(refs: list, done_ids: set, cached, tokens_per_s: float | None, judge_s_per_token: float,
                  max_new_tokens: int | None = None) -> dict:
    """What a run over `refs` costs: prompts to judge (no row yet), base passes to cache (those of them without a
    cache file: cached(ref) -> bool), their tokens, and minutes (cache at `tokens_per_s`, judging at
    `judge_s_per_token` per answer token)."""
    todo = [r for r in refs if r.id not in done_ids]
    build = [r for r in todo if not cached(r)]
    tokens = sum(len(r.prompt) + len(r.answer) for r in build)
    answer = sum(min(r.n, max_new_tokens or r.n) for r in todo)
    cache_min = tokens / tokens_per_s / 60 if build and tokens_per_s else 0.0
    judge_min = answer * judge_s_per_token / 60
    return {"prompts": len(refs), "to_judge": len(todo), "to_cache": len(build), "cache_tokens": tokens,
            "cache_minutes": cache_min, "judge_minutes": judge_min, "minutes": cache_min + judge_min}


def describe_cost(name: str, c: dict) -> str:
    cache = (f"the base's pass to cache for {c['to_cache']} ({c['cache_tokens']:,} tokens, ~{c['cache_minutes']:.1f} "
             "min)" if c["to_cache"] else "cache ready")
    return (f"{name}: {c['prompts']} prompts, {c['to_judge']} to judge (~{c['judge_minutes']:.1f} min), {cache}: "
            f"~{c['minutes']:.1f} min")


def run_field(drafter, refs: list, base, *, backend_name: str, out_dir: Path, rank: int = 0,
              world: int = 1, progress: bool = True, cache_root: Path | None = None,
              max_new_tokens: int | None = None, lockstep: int = LOCKSTEP_WIDTH) -> list[dict]:
    """Simulate `drafter` on this rank's share of `refs`; rows go to out_dir/rows-<rank>.jsonl as each prompt
    ends (a rerun continues after the last one written). Returns this rank's rows.

    lockstep: for a drafter whose family declares a batched path (run_lockstep: EAGLE-3's, Hydra's, Medusa's, the block
    families'), that
    many prompts advance together, the draft's weight-heavy ops batched over them (agreement with the per-prompt path
    is tested, not bitwise); 0, or any other family: one prompt at a time through the unchanged decoder loop
    (`simulate`), the reference."""
    from tqdm import tqdm

    from data.self_distill import end_of_turn_ids

    aux_layers = tuple(getattr(drafter, "aux_layers", None) or ())
    mine = shard(refs, rank, world)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"rows-{rank}.jsonl"
    rows = {row["id"]: row for row in read_finished_rows(path)}
    todo = [r for r in mine if r.id not in rows]
    # the base's pass only where a row is still to simulate: a finished or resumed report needs no cache
    directory = ensure_cache(todo, base, backend_name, aux_layers, root=cache_root, progress=progress)
    eos = end_of_turn_ids(base)
    vocab = int(base.model.config.vocab_size)
    device = next(base.model.parameters()).device

    def length(r) -> int:
        return min(r.n, max_new_tokens or r.n)  # a shorter length: the answer's first tokens, as decoding would

    with path.open("a") as f, tqdm(total=len(todo), desc="field: simulated decoding", unit="prompt",
                                   dynamic_ncols=True, disable=not progress) as bar:
        def finished(r, res, differs, redone: bool = False) -> None:
            row = {**sim_row(r, res).to_dict(), "tf_differs": [d for d in differs if d < length(r)]}
            if redone:  # a batched prompt that met a near tie, simulated on the exact path instead
                row["exact_redo"] = True
            f.write(json.dumps(row) + "\n")
            f.flush()
            rows[r.id] = row
            bar.update()

        if uses_lockstep(drafter, lockstep):
            from eval.engine.drafters.registry import lockstep_runner

            run_lockstep = lockstep_runner(drafter)

            def load(r):  # the base's rows the draft reads: its aux layers (EAGLE-3), else the hidden states
                hidden, aux, differs = load_cached(directory, r, device)
                return (aux if aux_layers else hidden), differs

            def redo(r):
                hidden, aux, differs = load_cached(directory, r, device)
                with torch.inference_mode():
                    res = simulate(drafter, r.prompt, r.answer, length(r), hidden, aux, aux_layers, vocab, eos)
                finished(r, res, differs, redone=True)

            run_lockstep(drafter, todo, load, length, eos, lambda r, slot: finished(r, slot, slot.differs),
                         width=lockstep, redo=redo)
        else:
            for r in todo:
                hidden, aux, differs = load_cached(directory, r, device)
                with torch.inference_mode():
                    res = simulate(drafter, r.prompt, r.answer, length(r), hidden, aux, aux_layers, vocab, eos)
                finished(r, res, differs)
    return [rows[r.id] for r in mine]


def judge_export(export_dir: Path, refs_dir: Path, cfg, *, sets: list[str] | None = None,
                 num_prompts: int | None = None, out_dir: Path | None = None, label: str = "",
                 lockstep: int = LOCKSTEP_WIDTH, subset: str = "all", agreement: int = AGREEMENT_SAMPLE,
                 mixed_dtype: bool = False, announce=None) -> tuple[dict, Path]:
    """`specdraft field --draft EXPORT`: load the draft (cfg: an EvalConfig, its dtype, backend and the draft's
    shape: tree, extra), simulate it on the stored answers, write field.json / field.md / field.png. Prompts: each
    set's first `num_prompts` when given, else `subset` ("all", or "default": default_subset). lockstep: run_field's
    (a batched family's prompts stepped that many at a time; 0 = the exact path); after a batched run, `agreement`
    of its prompts are re-decoded one at a time and the agreement recorded (meta["agreement"]; 0 = not measured).
    A dtype other than the stored answers' is refused unless `mixed_dtype` (then marked: meta["dtype_mark"]).
    announce(line): told what the run will cost before it starts. Returns (report, out_dir)."""
    from core.hardware import resolve_device
    from eval.choice.apply import tuned_eval_config
    from eval.engine.backends.choice import choose_backend
    from eval.engine.drafters.registry import build_drafter
    from eval.field.refs import dtype_mark, read_refs
    from eval.field.report import field_report, read_rows, write_field_report
    from models.export.load import load_export

    t0 = time.perf_counter()
    loaded = load_export(export_dir, base_path=cfg.base_path, dtype=cfg.dtype, device=resolve_device(cfg.device),
                         chat_template=cfg.chat_template)
    dtype = str(next(loaded.base.model.parameters()).dtype).removeprefix("torch.")
    card, stored = read_refs(refs_dir, loaded.base.fingerprint, sets, dtype=dtype, mixed_dtype=mixed_dtype)
    if num_prompts:
        refs, chosen = first_per_set(stored, num_prompts), f"each set's first {num_prompts}"
    elif subset == "default":
        refs = default_subset(stored)
        chosen = (f"the default subset: each set's first {DEFAULT_PER_SET} (a set of prompts over twice the mean "
                  f"length: {-(-DEFAULT_PER_SET // 2)}); --full judges all {len(stored)}")
    else:
        refs, chosen = stored, "all"
    cfg, tuned = tuned_eval_config(cfg, export_dir, loaded.family)
    drafter, info = build_drafter(loaded.draft, loaded.config, cfg)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    shape = _shape_name(info, cfg)
    short = cfg.max_new_tokens < card["max_new_tokens"]
    out_dir = Path(out_dir or Path(export_dir).parent / "field" /
                   f"{dtype}-{shape}{f'-{cfg.max_new_tokens}tok' if short else ''}")
    backend_name, _ = choose_backend(cfg.backend, loaded.base.model)
    batched = uses_lockstep(drafter, lockstep)
    if announce is not None:
        _announce_cost(announce, drafter, refs, stored, loaded.base, backend_name, out_dir, rank, world, lockstep,
                       cfg.max_new_tokens, chosen)
    before = {row["id"] for p in out_dir.glob("rows-*.jsonl") for row in read_finished_rows(p, repair=False)}
    rows = run_field(drafter, refs, loaded.base, backend_name=backend_name, out_dir=out_dir, rank=rank,
                     world=world, max_new_tokens=cfg.max_new_tokens, lockstep=lockstep)
    if world > 1:  # the last rank to finish writes the report from every rank's rows
        wanted = {r.id for r in refs}  # a directory reused with other sets or counts holds other rows too
        rows = [r for r in read_rows(out_dir) if r["id"] in wanted]
        if len({r["id"] for r in rows}) < len(refs):
            return {"partial": True, "rank": rank}, out_dir
    seconds = round(time.perf_counter() - t0, 1)
    if all(r.id in before for r in refs) and (out_dir / "field.json").is_file():  # nothing simulated now: the
        seconds = json.loads((out_dir / "field.json").read_text())["meta"].get("seconds", seconds)  # run that did
    measured = (measure_agreement(drafter, rows, refs, loaded.base, backend_name=backend_name, sample=agreement,
                                  max_new_tokens=cfg.max_new_tokens) if batched else None)
    meta = {"draft": label or str(export_dir), "family": loaded.family, "shape": shape, "dtype": dtype,
            "backend": backend_name, "refs": str(refs_dir), "refs_sha256": card["data_sha256"],
            "refs_dtype": card.get("dtype", "float32"), "dtype_mark": dtype_mark(card, dtype),
            "base": card["base"], "tuning": tuned, "seconds": seconds,
            "threads": torch.get_num_threads(), "simulated": True,
            "path": "batched" if batched else "exact", "lockstep": lockstep if batched else 0,
            "near_tie_redone": sum(bool(r.get("exact_redo")) for r in rows) if batched else 0,
            "agreement": measured, "prompts_chosen": chosen, "stored_prompts": len(stored),
            "max_new_tokens": min(cfg.max_new_tokens, card["max_new_tokens"]), **_drafter_info(info)}
    report = field_report(rows, meta)
    write_field_report(out_dir, report)
    return report, out_dir


def _announce_cost(announce, drafter, refs, stored, base, backend_name, out_dir, rank, world, lockstep,
                   max_new_tokens, chosen) -> None:
    """Before a run: what it will cost (prompts, the base passes still to cache, estimated minutes) and what the
    full run over every stored answer costs."""
    aux_layers = tuple(getattr(drafter, "aux_layers", None) or ())
    dtype = next(base.model.parameters()).dtype
    directory = cache_dir(base, dtype, backend_name, aux_layers)
    done = {row["id"] for p in Path(out_dir).glob("rows-*.jsonl") for row in read_finished_rows(p, repair=False)}

    def cached(r) -> bool:
        return cache_file(directory, r).is_file()

    mine, every = shard(refs, rank, world), shard(stored, rank, world)
    need_rate = any(r.id not in done and not cached(r) for r in every)
    rate = cache_rate(base, backend_name, aux_layers) if need_rate else None
    per_token = judge_rate(drafter, lockstep)
    this = estimate_cost(mine, done, cached, rate, per_token, max_new_tokens)
    full = estimate_cost(every, done, cached, rate, per_token, max_new_tokens)
    how = (f"base pass measured now at {rate:,.0f} tokens/s; " if rate else "") + \
        f"judging at the rate recorded for the {'batched' if uses_lockstep(drafter, lockstep) else 'exact'} path " \
        f"on a 2-core AMD EPYC ({per_token * 1000:.1f} ms per answer token)"
    announce(f"field: {chosen}")
    announce(describe_cost("this run", this) + " (estimate)")
    announce(describe_cost("the full run (--full)", full) + f" (estimate; {how})")


def _drafter_info(info: dict) -> dict:
    return {k: v for k, v in info.items() if isinstance(v, (str, int, float, bool, list)) and k != "tuning"}


def _shape_name(info: dict, cfg) -> str:
    extra = cfg.extra or {}
    if extra.get("eagle3_mode") == "chain" or extra.get("num_speculative_tokens"):
        return f"chain{extra.get('num_speculative_tokens', '')}"
    if cfg.tree_choices:
        return f"tree{len(cfg.tree_choices) + 1}"
    if cfg.tree != "auto":
        return cfg.tree
    return str(info.get("tree") or info.get("mode") or "default").replace(" ", "")
