"""`specdraft field`: a draft's exact greedy acceptance on the stored base answers (eval/harness/field_refs.py), every
family, hundreds of prompts, at the drafter's cost (docs/howto/evaluate.md, "The field benchmark").

Per prompt: the base's teacher-forced pass over prompt + stored answer (every hidden state, and the aux layers an
EAGLE-3 draft reads) comes from the field cache, built once per base, dtype and aux layers and reused by every draft
judged after; the unchanged decoder loop then runs the drafter against a ReplayBackend (eval/engine/backends/
replay.py), whose verification is a lookup in the stored answer. The per-step accepted lengths are decoding's.

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
# Prompts stepped together for an EAGLE-3 draft (run_field; 0 = one at a time). Measured on the shipped draft, 144
# cached prompts, 1 thread (a box at load 3-4): chain-4 6.9 / 6.0 / 6.1 ms a step at widths 32 / 64 / 128, tree
# 8.9 / 6.9 at 32 / 64; wider batches make the LM head's product more efficient until the tail of the queue dominates.
LOCKSTEP_WIDTH = 64


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
    """Whether run_field steps `drafter` in lockstep (eval/harness/field_lockstep.py): an EAGLE-3 drafter and a
    width >= 1; every other family (or lockstep=0) takes the per-prompt path."""
    from eval.engine.drafters.eagle3 import Eagle3Drafter

    return lockstep >= 1 and isinstance(drafter, Eagle3Drafter)


def run_field(drafter, refs: list, base, *, backend_name: str, out_dir: Path, rank: int = 0,
              world: int = 1, progress: bool = True, cache_root: Path | None = None,
              max_new_tokens: int | None = None, lockstep: int = LOCKSTEP_WIDTH) -> list[dict]:
    """Simulate `drafter` on this rank's share of `refs`; rows go to out_dir/rows-<rank>.jsonl as each prompt
    ends (a rerun continues after the last one written). Returns this rank's rows.

    lockstep: for an EAGLE-3 drafter, that many prompts advance together, the draft's weight-heavy ops batched over
    them (eval/harness/field_lockstep.py; agreement with the per-prompt path is tested, not bitwise); 0, or any other
    family: one prompt at a time through the unchanged decoder loop (`simulate`), the reference."""
    from tqdm import tqdm

    from data.self_distill import end_of_turn_ids

    aux_layers = tuple(getattr(drafter, "aux_layers", None) or ())
    mine = shard(refs, rank, world)
    directory = ensure_cache(mine, base, backend_name, aux_layers, root=cache_root, progress=progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"rows-{rank}.jsonl"
    rows = {row["id"]: row for row in read_finished_rows(path)}
    eos = end_of_turn_ids(base)
    vocab = int(base.model.config.vocab_size)
    device = next(base.model.parameters()).device
    todo = [r for r in mine if r.id not in rows]

    def length(r) -> int:
        return min(r.n, max_new_tokens or r.n)  # a shorter length: the answer's first tokens, as decoding would

    with path.open("a") as f, tqdm(total=len(todo), desc="field: simulated decoding", unit="prompt",
                                   dynamic_ncols=True, disable=not progress) as bar:
        def finished(r, res, differs) -> None:
            row = {**sim_row(r, res).to_dict(), "tf_differs": [d for d in differs if d < length(r)]}
            f.write(json.dumps(row) + "\n")
            f.flush()
            rows[r.id] = row
            bar.update()

        if uses_lockstep(drafter, lockstep):
            from eval.harness.field_lockstep import run_lockstep

            def load(r):
                _, aux, differs = load_cached(directory, r, device)
                return aux, differs

            run_lockstep(drafter, todo, load, length, eos, lambda r, slot: finished(r, slot, slot.differs),
                         width=lockstep)
        else:
            for r in todo:
                hidden, aux, differs = load_cached(directory, r, device)
                with torch.inference_mode():
                    res = simulate(drafter, r.prompt, r.answer, length(r), hidden, aux, aux_layers, vocab, eos)
                finished(r, res, differs)
    return [rows[r.id] for r in mine]


def judge_export(export_dir: Path, refs_dir: Path, cfg, *, sets: list[str] | None = None,
                 num_prompts: int | None = None, out_dir: Path | None = None, label: str = "",
                 lockstep: int = LOCKSTEP_WIDTH) -> tuple[dict, Path]:
    """`specdraft field --draft EXPORT`: load the draft (cfg: an EvalConfig, its dtype, backend and the draft's
    shape: tree, extra), simulate it on the stored answers (each set's first `num_prompts` when given), write
    field.json / field.md / field.png. lockstep: run_field's (an EAGLE-3 draft's prompts stepped that many at a
    time; 0 = the per-prompt path). Returns (report, out_dir)."""
    from core.hardware import resolve_device
    from eval.engine.backends.choice import choose_backend
    from eval.engine.drafters.registry import build_drafter
    from eval.harness.field_refs import read_refs
    from eval.harness.field_report import field_report, read_rows, write_field_report
    from eval.tune.choice import tuned_eval_config
    from models.export.load import load_export

    t0 = time.perf_counter()
    loaded = load_export(export_dir, base_path=cfg.base_path, dtype=cfg.dtype, device=resolve_device(cfg.device),
                         chat_template=cfg.chat_template)
    card, refs = read_refs(refs_dir, loaded.base.fingerprint, sets)
    if num_prompts:
        refs = first_per_set(refs, num_prompts)
    cfg, tuned = tuned_eval_config(cfg, export_dir, loaded.family)
    drafter, info = build_drafter(loaded.draft, loaded.config, cfg)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dtype = str(next(loaded.base.model.parameters()).dtype).removeprefix("torch.")
    shape = _shape_name(info, cfg)
    short = cfg.max_new_tokens < card["max_new_tokens"]
    out_dir = Path(out_dir or Path(export_dir).parent / "field" /
                   f"{dtype}-{shape}{f'-{cfg.max_new_tokens}tok' if short else ''}")
    backend_name, _ = choose_backend(cfg.backend, loaded.base.model)
    rows = run_field(drafter, refs, loaded.base, backend_name=backend_name, out_dir=out_dir, rank=rank,
                     world=world, max_new_tokens=cfg.max_new_tokens, lockstep=lockstep)
    if world > 1:  # the last rank to finish writes the report from every rank's rows
        wanted = {r.id for r in refs}  # a directory reused with other sets or counts holds other rows too
        rows = [r for r in read_rows(out_dir) if r["id"] in wanted]
        if len({r["id"] for r in rows}) < len(refs):
            return {"partial": True, "rank": rank}, out_dir
    meta = {"draft": label or str(export_dir), "family": loaded.family, "shape": shape, "dtype": dtype,
            "backend": backend_name, "refs": str(refs_dir), "refs_sha256": card["data_sha256"],
            "base": card["base"], "tuning": tuned, "seconds": round(time.perf_counter() - t0, 1),
            "threads": torch.get_num_threads(), "simulated": True,
            "lockstep": lockstep if uses_lockstep(drafter, lockstep) else 0,
            "max_new_tokens": min(cfg.max_new_tokens, card["max_new_tokens"]), **_drafter_info(info)}
    report = field_report(rows, meta)
    write_field_report(out_dir, report)
    return report, out_dir


def _drafter_info(info: dict) -> dict:
    return {k: v for k, v in info.items() if isinstance(v, (str, int, float, bool, list)) and k != "tuning"}


def _shape_name(info: dict, cfg) -> str:
    extra = cfg.extra or {}
    if extra.get("eagle3_mode") == "chain" or extra.get("chain_length"):
        return f"chain{extra.get('chain_length', '')}"
    if cfg.tree_choices:
        return f"tree{len(cfg.tree_choices) + 1}"
    if cfg.tree != "auto":
        return cfg.tree
    return str(info.get("tree") or info.get("mode") or "default").replace(" ", "")
