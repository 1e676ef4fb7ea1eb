"""The block draft families (models/block_draft.py: BlockDraft) as their tests build them: one small factory per
family, so that tests/test_block_families.py checks what they share on each of them with the same drafts their own
modules (tests/test_dflash.py, test_dspark.py, test_domino.py) check the rest on."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from conftest import fit_draft

from data.targets import offset_labels
from helpers.decoding import DECODE_NEW_TOKENS
from helpers.drafts import greedy_continuation_batch, perturb, random_batch_with_aux, with_draft_vocab
from models.families.dflash.model import DFlashDraft
from models.families.domino.drafter import DominoDrafter
from models.families.domino.model import DominoDraft
from models.families.dspark.drafter import DSparkDrafter
from models.families.dspark.model import DSparkDraft
from train.config import LossSection

D2T = torch.tensor([7, 3, 100, 250, 64, 9, 11, 12, 13, 200, 201, 5])  # hand-made base ids, not sorted


@dataclass(frozen=True)
class BlockFamily:
    """A block family as its tests build it, and the facts its tests expect of it."""

    draft_cls: type  # its BlockDraft subclass
    small: dict = field(default_factory=dict)  # its own constructor arguments in the small random draft
    memorise: dict = field(default_factory=dict)  # ... in the draft that memorises (and the recipe's smoke run)
    drafter_cls: type | None = None  # its chain drafter; None: it drafts trees (DFlash: tests/test_dflash_decoding.py)
    root_drafts: bool = True  # slot 0, the root, drafts depth 1 too (BlockDraft.first_slot 0)
    learned_mask: bool = False  # the mask slots' input is trained (else it is the base's row, frozen)

    @property
    def name(self) -> str:
        return self.draft_cls.facts.name

    def draft(self, view, seed: int = 0, d2t=None, block_size: int = 4, std: float = 0.2, **own):
        """A 2-layer draft on `view` (with the draft vocabulary d2t), every weight moved off its init by seeded
        N(0, std²) noise (the zero-initialised heads too); `own`: its own arguments over `small`. A frozen mask
        embedding stays the base's row (vLLM reads no other)."""
        torch.manual_seed(seed)
        draft = self.draft_cls(with_draft_vocab(view, d2t), num_layers=2, block_size=block_size, num_anchors=64,
                               **{**self.small, **own})
        perturb(draft, std, seed=seed)
        if not draft.learned_mask:
            with torch.no_grad():
                draft.mask_embedding.copy_(view.embed_weight[draft.mask_token_id])
        return draft.eval()

    def loss_kw(self, **kw) -> dict:
        """LossSection keyword arguments: a key of the family's loss options goes into them (loss.<name>.*), the
        rest (teacher_weight, chunk_size, ...) stays the section's."""
        options = self.draft_cls.facts.loss_options
        own = {f.name for f in dataclasses.fields(options)}
        return {**{k: v for k, v in kw.items() if k not in own},
                self.name: options(**{k: v for k, v in kw.items() if k in own})}

    def loss(self, **kw) -> LossSection:
        """loss_kw's LossSection, chunks of 64 rows unless `kw` says."""
        return LossSection(**{"chunk_size": 64, **self.loss_kw(**kw)})

    def trained(self, model, view, prompts):
        """A draft that memorised the base's own greedy continuations of `prompts` (blocks of 4, decay weights)."""
        torch.manual_seed(0)
        draft = self.draft_cls(view, num_layers=2, block_size=4, num_anchors=64, **self.memorise)
        batch = greedy_continuation_batch(model, prompts, draft.aux_layers, DECODE_NEW_TOKENS + 6)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # many tiny ops: one thread is far faster on a busy 2-core box
        try:
            fit_draft(draft, [batch], view, self.loss(position_weights="decay"), steps=30, lr=2e-2)
        finally:
            torch.set_num_threads(threads)
        return draft.eval()


DFLASH = BlockFamily(DFlashDraft, root_drafts=False, learned_mask=True)
DSPARK = BlockFamily(DSparkDraft, {"markov_rank": 8}, {"markov_rank": 16}, DSparkDrafter)
DOMINO = BlockFamily(DominoDraft, {"gru_hidden": 6, "correction_dim": 5, "prefix_len": 1},
                     {"gru_hidden": 16, "correction_dim": 16}, DominoDrafter)
FAMILIES = {f.name: f for f in (DFLASH, DSPARK, DOMINO)}
CHAIN_FAMILIES = [name for name, f in FAMILIES.items() if f.drafter_cls is not None]


def context_cache(model, draft, t: int = 10):
    """The draft's context cache after committing a random t-token context (the base's aux states for it; seeded, so
    two drafts with the same aux layers see the same context)."""
    aux = random_batch_with_aux(model, draft, b=1, t=t).aux_hidden[0]
    cache = draft.new_cache(16, "cpu", torch.float32)
    draft.commit_context(cache, aux)
    return cache


def scored_blocks(draft, batch):
    """The blocks eval mode scores, for a loss written out by hand: (b, t, out, labels) for every anchor t of row b
    with a valid depth-1 target, out [K, d] the drafted slots' layer outputs (row k-1 drafts depth k) and labels [K]
    their targets x_{t+1+k} (-100: none)."""
    ids, mask = batch.input_ids, batch.loss_mask
    for b in range(ids.shape[0]):
        labels = torch.stack([offset_labels(ids[b:b + 1], mask[b:b + 1], 1 + k)[0]
                              for k in range(1, draft.num_heads + 1)], -1)  # [T, K]
        anchors = (labels[:, 0] != -100).nonzero().flatten()
        out = draft.block_outputs(batch.aux_hidden[b:b + 1], ids[b:b + 1], anchors[None])[0, :, draft.first_slot:]
        for a, t in enumerate(anchors.tolist()):
            yield b, t, out[a], labels[t]
