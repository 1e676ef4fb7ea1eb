"""A toy Markov base for checking rejection sampling through draft trees against the exact distribution (the
EAGLE-3 and DFlash decoding tests; tests/test_redrafter_decoding.py explains the TV bound)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from eval.engine.backends.backend import Backend
from eval.engine.decoder import speculative_generate
from eval.engine.drafters.drafter import Drafter
from models.draft import BaseView

V = 5
BOS = 4  # prompt token: its row forces t1 = 0, so (t2, t3) is the first tree step's output


class BigramAuxBackend(Backend):
    """Toy base: p(next | ..., a) = softmax(table[a]); hidden / aux states are fixed per token."""

    def __init__(self, table, hidden, aux):
        self.table, self.hidden, self.aux = table, hidden, aux
        self.vocab_size, self.hidden_size = table.shape[0], hidden.shape[1]
        self.device = torch.device("cpu")
        self._len = 0

    def set_aux_layers(self, ids) -> None:
        self.aux_layers = tuple(ids)

    def reset(self, max_len):
        self._len = 0

    @property
    def cache_len(self):
        return self._len

    def prefill(self, input_ids):
        self._len = int(input_ids.numel())
        self.last_aux = self.aux[input_ids]
        return self.table[input_ids], self.hidden[input_ids]

    def forward_tree(self, tokens, depths, tree_mask):
        self.last_aux = self.aux[tokens]
        return self.table[tokens], self.hidden[tokens]

    def commit(self, keep):
        self._len += int(keep.numel())


def rejection_sampling_tv(make_drafter: Callable[[BaseView], Drafter], samples: int, seed: int) -> float:
    """Sample 3 tokens with rejection sampling through the trees of make_drafter(view) (view: a V-token tiny
    LLaMA's, d=16, the draft's shapes) on a bigram base; TV distance of the pair (t2, t3) from the exact base
    distribution."""
    from transformers import LlamaForCausalLM

    from models.tiny import tiny_llama_config

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(V, V, generator=gen) * 1.2
    logits[:, BOS] = -1e9
    logits[BOS] = -1e9
    logits[BOS, 0] = 0.0  # after the prompt: t1 = 0 surely
    torch.manual_seed(1)
    toy = LlamaForCausalLM(tiny_llama_config(vocab_size=V, hidden_size=16, num_heads=2, num_kv_heads=1)).eval()
    drafter = make_drafter(BaseView.from_model(toy))
    be = BigramAuxBackend(logits, torch.randn(V, 16, generator=gen), torch.randn(V, 32, generator=gen))
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    nodes = 0
    for _ in range(samples):
        out = speculative_generate(be, drafter, [BOS], max_new_tokens=3, eos_ids=None, acceptance="rejection",
                                   temperature=1.0, generator=gen)
        assert out.tokens[0] == 0
        counts[out.tokens[1], out.tokens[2]] += 1
        nodes += out.tree_nodes
    assert nodes > 2 * samples  # real trees were verified, not just roots
    p = logits.softmax(-1)
    exact = p[0][:, None] * p
    return 0.5 * float((counts / samples - exact).abs().sum())
