"""HFBackend: prefill and tree-verified logits equal plain sequential forwards; commit leaves exactly the
K/V that recomputing the committed sequence from scratch gives. On every tiny architecture, and on
Mistral / Gemma-3 with 4- and 8-token windows, which the prompt + tree cross (a window longer than the
test sequence would leave the sliding-window mask and trimming unused)."""

from __future__ import annotations

import pytest
import torch

from eval.engine.backends.hf import HFBackend
from eval.engine.tree import TREE_16, StaticTree
from models.tiny import TINY_ARCHS, tiny_llama, tiny_model

TOL = 1e-5  # fp32 tiny models; measured differences are ~1e-7

# (arch, sliding window): the default tiny models plus small windows that prompt + tree cross, and a
# Qwen2 whose second layer slides (max_window_layers=1): a mixed cache on a non-Gemma decoder.
ARCH_CASES = [(a, None) for a in TINY_ARCHS] + [("mistral", 4), ("mistral", 8), ("gemma3", 8), ("qwen2", 4)]
ARCH_IDS = [a if w is None else f"{a}-w{w}" for a, w in ARCH_CASES]


def _model(arch: str = "llama", window: int | None = None):
    if arch == "llama":
        return tiny_llama(0)
    extra = {} if window is None else {"sliding_window": window}
    if arch == "qwen2" and window is not None:
        extra.update(use_sliding_window=True, max_window_layers=1)
    return tiny_model(arch, seed=0, diverse=True, **extra)


def test_mixed_qwen2_case_really_mixes_layer_types():
    assert _model("qwen2", 4).config.layer_types == ["full_attention", "sliding_attention"]


@pytest.mark.parametrize("kind", ["linear_attention", "chunked_attention"])
def test_unsupported_cache_layers_are_named(kind):
    model = _model("qwen2")
    model.config.layer_types = ["full_attention", kind]
    model.config.attention_chunk_size = 8  # what a chunked-attention config (Llama 4) carries
    with pytest.raises(ValueError, match=f"has {kind} layers.*{kind}: (a recurrent state|chunked)"):
        HFBackend(model, check_logits=False)


def _prompt(n: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def _sequential_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize(("arch", "window"), ARCH_CASES, ids=ARCH_IDS)
def test_prefill_matches_model_forward(arch, window):
    model = _model(arch, window)
    be = HFBackend(model)
    be.reset(32)
    prompt = _prompt()
    logits, hidden = be.prefill(prompt)
    with torch.inference_mode():
        want = model(input_ids=prompt[None]).logits[0].float()
        want_h = model.model(input_ids=prompt[None]).last_hidden_state[0]
    assert logits.dtype == torch.float32 and logits.shape == (9, be.vocab_size)
    assert torch.allclose(logits, want, atol=TOL) and torch.allclose(hidden, want_h, atol=TOL)
    assert be.cache_len == 9


@pytest.mark.parametrize(("arch", "window"), ARCH_CASES, ids=ARCH_IDS)
def test_tree_logits_equal_sequential_logits(arch, window):
    model = _model(arch, window)
    be = HFBackend(model)
    prompt = _prompt()
    drafts = torch.randint(3, 320, (4, 4), generator=torch.Generator().manual_seed(1))
    tree = StaticTree(TREE_16).fill(17, drafts)
    be.reset(64)
    be.prefill(prompt)
    logits, hidden = be.forward_tree(tree.tokens, tree.depths, tree.mask)
    assert logits.shape == (16, be.vocab_size) and hidden.shape == (16, be.hidden_size)
    for i in range(tree.num_nodes):
        ids = prompt.tolist() + tree.tokens[tree.path_to(i)].tolist()
        assert torch.allclose(logits[i], _sequential_logits(model, ids), atol=TOL), i


def _committed_kv_from_scratch(model, ids: list[int]):
    be = HFBackend(model, check_logits=False)
    be.reset(len(ids))
    be.prefill(torch.tensor(ids))
    return be.committed_kv()


@pytest.mark.parametrize(("arch", "window"), ARCH_CASES, ids=ARCH_IDS)
def test_commit_compacts_kv_like_recomputing_from_scratch(arch, window):
    model = _model(arch, window)
    be = HFBackend(model)
    prompt = _prompt()
    gen = torch.Generator().manual_seed(2)
    st = StaticTree(TREE_16)
    be.reset(80)
    be.prefill(prompt)
    committed = prompt.tolist()
    root = 11
    # Steps with paths that skip over sibling branches, so commit must really gather; enough of them
    # that the committed sequence (9 + 4 + 2 + 4 = 19) passes the tiny windows several times.
    for path in ([0, 2, 8, 14], [0, 3], [0, 1, 6, 13]):
        tree = st.fill(root, torch.randint(3, 320, (4, 4), generator=gen))
        assert all(int(tree.parents[b]) == a for a, b in zip(path[:-1], path[1:]))
        logits, _ = be.forward_tree(tree.tokens, tree.depths, tree.mask)
        be.commit(torch.tensor(path))
        committed += tree.tokens[path].tolist()
        root = int(logits[path[-1]].argmax())
        assert be.cache_len == len(committed)
        for (k, v), (k0, v0) in zip(be.committed_kv(), _committed_kv_from_scratch(model, committed)):
            assert k.shape == k0.shape
            assert torch.allclose(k, k0, atol=TOL) and torch.allclose(v, v0, atol=TOL)
    # And the next verification after compaction still sees exactly the committed sequence.
    tree = st.fill(root, torch.randint(3, 320, (4, 4), generator=gen))
    logits, _ = be.forward_tree(tree.tokens, tree.depths, tree.mask)
    want = _sequential_logits(model, committed + tree.tokens[tree.path_to(5)].tolist())
    assert torch.allclose(logits[5], want, atol=TOL)


def test_misuse_is_reported():
    be = HFBackend(_model())
    with pytest.raises(RuntimeError, match="reset"):
        be.prefill(_prompt())
    be.reset(12)
    be.prefill(_prompt())
    one = torch.tensor([5])
    be.forward_tree(one, torch.tensor([0]), torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="commit"):
        be.forward_tree(one, torch.tensor([0]), torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="commit indices"):
        be.commit(torch.tensor([1]))
    be.commit(torch.tensor([0]))
    big = StaticTree(TREE_16).fill(5, torch.zeros(4, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="max_len"):
        be.forward_tree(big.tokens, big.depths, big.mask)
