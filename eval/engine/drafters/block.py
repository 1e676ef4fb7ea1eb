"""What every block family's drafter (DFlash, DSpark, Domino: models/block_draft.py BlockDraft) does the same way:
hold the draft's context cache and, at the start of each propose, append the positions the base committed since the
last call (their aux states) to it. The family's drafter then drafts its block from the cache and the root."""

from __future__ import annotations

from eval.engine.drafters.drafter import DecodeState, Drafter


class BlockDrafter(Drafter):
    def __init__(self, draft):
        """draft: a BlockDraft subclass (its facts name it in messages)."""
        self.draft = draft.eval()
        self.aux_layers = list(draft.aux_layers)  # the decoder has the backend capture these layers
        param = next(draft.parameters())
        self._device, self._dtype = param.device, param.dtype
        self._cache = None

    def reset(self) -> None:
        self._cache = None

    def _commit(self, state: DecodeState) -> None:
        """Append the committed positions' aux states (state.new_aux [n, k*d]) to the draft's context cache, made on
        the first call with room for twice the prompt (it grows by doubling); always, so the cache holds every
        committed position."""
        if state.new_aux is None:
            raise ValueError(f"the {self.draft.facts.title} drafter needs the base's aux hidden states "
                             "(DecodeState.new_aux); run it through eval.engine.decoder.speculative_generate, which "
                             "asks the backend for them")
        aux = state.new_aux.to(self._device, self._dtype)  # [n, k*d]
        if self._cache is None:
            self._cache = self.draft.new_cache(max(256, 2 * aux.shape[0]), self._device, self._dtype)
        self.draft.commit_context(self._cache, aux)
