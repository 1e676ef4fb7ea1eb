"""Building blocks of the draft-family tests: the bases they read, a draft vocabulary on a view, weights moved
off their init, and the batches their losses and decoders are fed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from data.targets import offset_labels
from models.base import last_hidden_and_aux
from models.draft import BaseView, DraftBatch
from models.tiny import TINY_VOCAB_SIZE, tiny_llama, tiny_llama_config


def tiny_view(seed: int = 0) -> BaseView:
    """The view of a fresh default tiny LLaMA (2 layers, d=64, vocab 320)."""
    return BaseView.from_model(tiny_llama(seed))


def four_layer_tiny_llama():
    """A tiny LLaMA with 4 layers, so that three distinct aux layers exist (EAGLE-3, DFlash); fp32, eval mode.
    Built right after torch.manual_seed(0), and the global RNG is left where the init leaves it (tests that draw
    from it afterwards, unseeded, see the numbers they always saw)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(num_layers=4)).eval()


def with_draft_vocab(view: BaseView, d2t: torch.Tensor | None) -> BaseView:
    """`view` with the draft vocabulary d2t (base ids of the draft's classes; None: the full vocabulary)."""
    return dataclasses.replace(view, draft_vocab=d2t)


def perturb(draft, std: float, seed: int | None = None):
    """Move every parameter off its init by N(0, std^2) noise, in place. seed=None: drawn from the global RNG in
    each parameter's own dtype and device (a draft on a CUDA / bf16 view); else from a CPU generator seeded with
    `seed`, independent of the global RNG. Returns the draft."""
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_((torch.randn_like(p) if gen is None else torch.randn(p.shape, generator=gen)) * std)
    return draft


def random_ids_and_hidden(view: BaseView, rows: int, length: int):
    """(ids [rows, length], all-ones loss mask, hidden [rows, length, d]): random ids and hidden states drawn
    from the global RNG, ids first. A test masks its user turns itself."""
    ids = torch.randint(3, view.vocab_size, (rows, length))
    mask = torch.ones(rows, length, dtype=torch.long)
    hidden = torch.randn(rows, length, view.hidden_size)
    return ids, mask, hidden


def random_batch_with_aux(base, draft, b: int = 2, t: int = 24, seed: int = 0) -> DraftBatch:
    """Random ids [b, t] (own generator), row 0 opening with a 5-token user turn (no targets into it), with the
    base's last hidden states and the draft's aux layers for them."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TINY_VOCAB_SIZE, (b, t), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # a user turn: no targets into it
    h, aux = last_hidden_and_aux(base, ids, None, draft.aux_layers)
    return DraftBatch(h, ids, mask, aux)


def greedy_continuation_batch(model, prompts, aux_layers, new_tokens: int) -> DraftBatch:
    """Each prompt plus `new_tokens` of the base's own greedy continuation, right-padded into one batch (every
    real token supervised), with h and the aux layers: what a draft memorises to be accepted in decoding."""
    with torch.inference_mode():
        seqs = [model.generate(p[None], max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0] for p in prompts]
    width = max(s.numel() for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, : s.numel()], mask[b, : s.numel()] = s, 1
    h, aux = last_hidden_and_aux(model, ids, None, aux_layers)
    return DraftBatch(h, ids, mask, aux)


def random_batch_in_draft_vocab(base, draft, d2t: torch.Tensor) -> DraftBatch:
    """Ids [2, 16] drawn from the draft vocabulary d2t but one (id 200 at row 1, position 6, which d2t must not
    hold), every token supervised, with the base's h and the draft's aux layers: each target is countable,
    and exactly one is a miss no draft can hit."""
    assert not bool((d2t == 200).any())
    gen = torch.Generator().manual_seed(0)
    ids = d2t[torch.randint(0, d2t.numel(), (2, 16), generator=gen)]
    ids[1, 6] = 200  # not in the map
    h, aux = last_hidden_and_aux(base, ids, None, draft.aux_layers)
    return DraftBatch(h, ids, torch.ones_like(ids), aux)


def teacher_loss_sum_by_hand(hidden, ids, mask, lm_head_weight, k: int, draft_logits) -> float:
    """Depth k's teacher loss (loss_sum) written out: over every position t with a valid depth-k target, the soft
    CE from softmax(lm_head(h_{t+k})), the base's own prediction of x_{t+1+k}, to the draft's logits
    draft_logits(k, b, t) [V]; summed."""
    total = 0.0
    valid = offset_labels(ids, mask, 1 + k) != -100
    for b, t in valid.nonzero().tolist():
        p_teacher = torch.softmax(hidden[b, t + k] @ lm_head_weight.T, -1)
        total += float(-(p_teacher * torch.log_softmax(draft_logits(k, b, t), -1)).sum())
    return total


def assert_unroll_equals_inference(draft, batch: DraftBatch, rows: tuple[int, ...] = (0, 4, 7)) -> None:
    """An EAGLE-3 draft's TTT unroll (3 steps) of a one-row batch equals drafting step by step with its own KV cache:
    for each row t, commit rows 0..t (step 0), then draft depths 2 and 3 from the data tokens and its own outputs."""
    ids, aux = batch.input_ids[0], batch.aux_hidden[0]
    with torch.no_grad():
        outs = draft.ttt_unroll(batch.aux_hidden, batch.input_ids, 3)  # 3 x [1, T-1, d]
        for t in rows:
            cache = draft.new_cache(4, "cpu", torch.float32)  # small: grows
            committed = draft.commit_rows(cache, aux[:t + 1], ids[1:t + 2])  # [t+1, d]
            torch.testing.assert_close(committed, outs[0][0, :t + 1], rtol=1e-5, atol=1e-5)
            hidden, tk, tv = committed[-1:], None, None
            for j in (1, 2):
                vis = torch.ones(1, 0 if tk is None else tk.shape[2], dtype=torch.bool)
                hidden, tk, tv = draft.draft_rows(cache, hidden, ids[t + 1 + j:t + 2 + j], torch.tensor([t + j]),
                                                  tk, tv, vis)
                torch.testing.assert_close(hidden[0], outs[j][0, t], rtol=1e-5, atol=1e-5)


def tiny_hydra_export(out_dir: Path) -> Path:
    """An untrained one-head Hydra draft on the tiny base, exported to out_dir/export: a draft for tests that need
    an export to evaluate (its acceptance is whatever chance gives; the decoding is still exact)."""
    from models.base import load_base
    from models.export.specdraft import export_specdraft
    from models.families.hydra.model import HydraDraft

    base = load_base("tiny")
    torch.manual_seed(0)
    draft = HydraDraft(1, 1, BaseView.from_model(base.model), share_lm_head=True).eval()
    return export_specdraft(draft, Path(out_dir) / "export", base.name, base.fingerprint)
