"""The field benchmark on the real base (slow), the shipped EAGLE-3 in fp32, on the first 2 stored answers of every
set (22 prompts over 11 sets), for the chain of 4 and the dynamic 16-node tree:

1. decoding (the real base, the decoder loop) equals the one-prompt-at-a-time simulation on the stored answers step
   for step: the same tokens, accepted lengths, per-depth accepted / proposed counts, tree nodes, and the same
   drafted tree (tokens, parents, depths) at every step. A prompt whose decode leaves its stored answer FAILS:
   the simulation would then judge a continuation decoding does not produce here;
2. the batched path (lockstep, models/families/eagle3/lockstep.py, the default width) equals the one-at-a-time path on
   the full stored answers, row for row and tree for tree (each tree as the set of token paths it proposes): any step
   that differs fails, with the count printed. A prompt that meets a near tie is redone on the exact path, as
   `specdraft field` does (models/families/eagle3/lockstep.py: TIE_EPS); the test prints which.

Both were shown to fail with a defect put back (a perturbed lockstep draft; a stored answer changed by one token)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SHIPPED = Path("drafts/smollm2-eagle3-store/export")
REFS = Path("datasets/smollm2-field-refs")
NEW = 48  # tokens decoded per prompt in (1) (the simulation takes the same length)
PER_SET = 2
FIELDS = ("accepted_lengths", "accept_counts", "proposed_counts", "tree_nodes", "tokens")
SHAPES = {"chain4": ["extra.eagle3_mode=chain", "extra.num_speculative_tokens=4"], "tree": []}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shipped():
    """(loaded export in fp32, the picked stored answers, end-of-turn ids, backend name), one thread."""
    from data.self_distill import end_of_turn_ids
    from eval.engine.backends.choice import choose_backend
    from eval.field.refs import read_refs
    from eval.field.simulation import first_per_set
    from models.export.load import load_export

    torch.set_num_threads(1)
    loaded = load_export(SHIPPED, dtype="fp32")
    card, refs = read_refs(REFS, loaded.base.fingerprint, dtype="float32")
    picked = first_per_set(refs, PER_SET)
    assert len(picked) >= 16 and len({r.set for r in picked}) == len(card["counts"])
    backend_name, _ = choose_backend("auto", loaded.base.model)
    return loaded, picked, end_of_turn_ids(loaded.base), backend_name


def _drafter(loaded, shape: str):
    from eval.engine.drafters.registry import build_drafter
    from eval.harness.config import load_eval_config

    drafter, _ = build_drafter(loaded.draft, loaded.config, load_eval_config([], [*SHAPES[shape], "use_tuning=false"]))
    return drafter


def canonical(tokens: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    """A drafted tree as what it proposes: the sorted token paths from the root to each node (the order the nodes
    are laid out in, which the verifier ignores, left out)."""
    paths: list[tuple[int, ...]] = []
    for t, p in zip(tokens, parents):
        paths.append((*paths[p], t) if p >= 0 else (t,))
    return sorted(paths)


def _recording(drafter) -> list:
    """Every tree drafter.propose returns from now on, canonical()."""
    trees, original = [], type(drafter).propose

    def spy(state):
        tree = original(drafter, state)
        trees.append(canonical(tree.tokens.tolist(), tree.parents.tolist()))
        return tree

    drafter.propose = spy
    return trees


def _rows(res, trees) -> dict:
    return {**{f: getattr(res, f) for f in FIELDS}, "trees": list(trees)}


def _parted(got: list[int], want: list[int]) -> str:
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"decoded {got[k:k + 4]} where the stored answer has {want[k:k + 4]} at answer token {k}"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_decoding_equals_the_simulation_step_for_step(shipped, shape):
    from eval.engine.backends.choice import make_backend
    from eval.engine.decoder import speculative_generate
    from eval.field.simulation import simulate, teacher_forced

    loaded, picked, eos, backend_name = shipped
    drafter = _drafter(loaded, shape)
    backend = make_backend(backend_name, loaded.base.model)
    aux_layers = tuple(drafter.aux_layers)
    vocab = loaded.base.model.config.vocab_size
    steps = 0
    try:
        for r in picked:
            n = min(NEW, r.n)
            trees = _recording(drafter)
            with torch.inference_mode():
                got = speculative_generate(backend, drafter, torch.tensor(r.prompt), max_new_tokens=n, eos_ids=eos)
            decoded = _rows(got, trees)
            assert got.tokens == r.answer[: len(got.tokens)] and len(got.tokens) == n, \
                f"{r.id} parted: {_parted(got.tokens, r.answer)}; the simulation judges the stored continuation"
            trees.clear()
            with torch.inference_mode():
                hidden, aux, _ = teacher_forced(backend, torch.tensor(r.prompt + r.answer), aux_layers)
                sim = simulate(drafter, r.prompt, r.answer, n, hidden, aux, aux_layers, vocab, eos)
            simulated = _rows(sim, trees)
            for f in [*FIELDS, "trees"]:
                assert simulated[f] == decoded[f], (r.id, f)
            steps += len(got.accepted_lengths)
    finally:
        drafter.__dict__.pop("propose", None)
    assert steps > 5 * len(picked)  # each prompt decoded several steps


@pytest.mark.parametrize("shape", list(SHAPES))
def test_lockstep_equals_one_at_a_time_on_real_answers(shipped, shape, monkeypatch, tmp_path):
    import eval.field.simulation as field
    from eval.field.simulation import LOCKSTEP_WIDTH, ROW_FIELDS, ensure_cache, load_cached, run_field, sim_row
    from models.families.eagle3.lockstep import LockstepEagle3

    loaded, picked, eos, backend_name = shipped
    drafter = _drafter(loaded, shape)
    aux_layers = tuple(drafter.aux_layers)
    vocab = loaded.base.model.config.vocab_size
    device = next(loaded.base.model.parameters()).device
    directory = ensure_cache(picked, loaded.base, backend_name, aux_layers, progress=False)
    real_simulate = field.simulate
    exact = {}
    for r in picked:  # the exact path: one prompt at a time through the decoder loop, every drafted tree recorded
        trees = _recording(drafter)
        try:
            hidden, aux, _ = load_cached(directory, r, device)
            with torch.inference_mode():
                res = real_simulate(drafter, r.prompt, r.answer, r.n, hidden, aux, aux_layers, vocab, eos)
        finally:
            drafter.__dict__.pop("propose", None)
        exact[r.id] = {**{f: sim_row(r, res).to_dict()[f] for f in ROW_FIELDS}, "trees": trees}

    # the batched path as `specdraft field` runs it (run_field, the default width; a prompt that meets a near tie
    # is redone on the exact path), every tree recorded: lockstep's, and the exact path's for a redone prompt
    batched_trees: dict[str, list] = {}
    original = LockstepEagle3._verify_and_book
    by_prompt = {tuple(r.prompt): r.id for r in picked}

    def book(self, slot, p):
        batched_trees.setdefault(slot.ref.id, []).append(canonical(list(p.tokens), list(p.parents)))
        original(self, slot, p)

    def redo(drafter_, prompt, *args, **kwargs):
        trees = _recording(drafter_)
        try:
            res = real_simulate(drafter_, prompt, *args, **kwargs)
        finally:
            drafter_.__dict__.pop("propose", None)
        batched_trees[by_prompt[tuple(prompt)]] = trees
        return res

    monkeypatch.setattr(LockstepEagle3, "_verify_and_book", book)
    monkeypatch.setattr(field, "simulate", redo)
    rows = run_field(drafter, picked, loaded.base, backend_name=backend_name, out_dir=tmp_path / "batched",
                     progress=False, lockstep=LOCKSTEP_WIDTH)
    batched = {row["id"]: {**{f: row[f] for f in ROW_FIELDS}, "trees": batched_trees.get(row["id"], [])}
               for row in rows}
    assert sorted(batched) == sorted(exact)
    steps = sum(len(v["accept_lengths"]) for v in exact.values())
    differ = sum(sum(a != b for a, b in zip(exact[i]["trees"], batched[i]["trees"]))
                 + abs(len(exact[i]["trees"]) - len(batched[i]["trees"])) for i in exact)
    parted = sorted(i for i in exact if exact[i] != batched[i])
    redone = [row["id"] for row in rows if row.get("exact_redo")]
    print(f"\n{shape}: {differ} of {steps} steps' trees differ; prompts parted: {parted or 'none'}; redone exactly "
          f"after a near tie: {redone or 'none'}")
    assert steps > 10 * len(picked)  # full answers: many steps each
    assert not parted, {i: next(f for f in [*ROW_FIELDS, "trees"] if exact[i][f] != batched[i][f]) for i in parted}
