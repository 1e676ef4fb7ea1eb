"""Tree buffers (static choices, dynamic prefix matching) against hand-checked values and slow twins."""

from __future__ import annotations

import pytest
import torch

from eval.engine.tree import (
    CHAIN_4,
    MEDUSA_63,
    STATIC_TREES,
    WIDE_2,
    StaticTree,
    Tree,
    ancestor_mask,
    chain_tree,
    prefix_match,
    tree_from_paths,
    tree_from_paths_reference,
)


def _mask_by_walking(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def _random_tree(n: int, gen: torch.Generator) -> tuple[list[int], list[int]]:
    parents, depths = [-1], [0]
    for i in range(1, n):
        p = int(torch.randint(0, i, (1,), generator=gen))
        parents.append(p)
        depths.append(depths[p] + 1)
    return parents, depths


def test_wide2_buffers_hand_checked():
    st = StaticTree(WIDE_2)
    # Sorted by (depth, ranks): 1=(0,) 2=(1,) 3=(0,0) 4=(0,1) 5=(1,0) 6=(1,1)
    assert st.parents.tolist() == [-1, 0, 0, 1, 1, 2, 2]
    assert st.depths.tolist() == [0, 1, 1, 2, 2, 2, 2]
    assert (st.depth, st.topk, st.num_nodes) == (2, 2, 7)
    expected_mask = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(st.mask, expected_mask)
    assert st.paths.tolist() == [[0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 2, 6]]
    tree = st.fill(7, torch.tensor([[10, 11], [20, 21]]))
    # A node's token depends only on (its depth, its own rank): Medusa's independent heads.
    assert tree.tokens.tolist() == [7, 10, 11, 20, 21, 20, 21]
    assert tree.children == [[1, 2], [3, 4], [5, 6], [], [], [], []]


def test_ragged_static_tree_pads_short_paths():
    st = StaticTree([(0,), (1,), (0, 0)])
    assert st.paths.tolist() == [[0, 2, -1], [0, 1, 3]]  # one row per leaf, leaves in index order
    assert StaticTree(CHAIN_4).paths.tolist() == [[0, 1, 2, 3, 4]]


def test_medusa63_shape_and_token_gather():
    st = StaticTree(MEDUSA_63)
    assert (st.num_nodes, st.depth, st.topk) == (64, 4, 10)
    topk = torch.arange(100, 140).reshape(4, 10)  # token = 100 + 10*(depth-1) + rank
    tree = st.fill(5, topk)
    for i, choice in enumerate(st.choices, start=1):
        assert int(tree.tokens[i]) == 100 + 10 * (len(choice) - 1) + choice[-1]
        assert int(tree.depths[i]) == len(choice)
        parent = int(tree.parents[i])
        assert (st.choices[parent - 1] if parent else ()) == choice[:-1]
    assert torch.equal(tree.mask, _mask_by_walking(tree.parents.tolist()))
    assert tree.mask.sum(1).tolist() == (tree.depths + 1).tolist()
    # Every leaf appears in exactly one path row and every node lies on some path.
    on_paths = set(tree.paths[tree.paths >= 0].tolist())
    assert on_paths == set(range(64))


@pytest.mark.parametrize("name", sorted(STATIC_TREES))
def test_shipped_trees_are_valid(name):
    st = StaticTree(STATIC_TREES[name])
    assert st.num_nodes == len(STATIC_TREES[name]) + 1
    assert bool((st.parents[1:] < torch.arange(1, st.num_nodes)).all())


def test_static_tree_rejects_bad_choices_and_short_topk():
    with pytest.raises(ValueError, match="no parent"):
        StaticTree([(0,), (1, 0)])
    with pytest.raises(ValueError, match="duplicates"):
        StaticTree([(0,), (0,)])
    with pytest.raises(ValueError, match="topk_tokens"):
        StaticTree(WIDE_2).fill(0, torch.zeros(2, 1, dtype=torch.long))


def test_tree_rejects_non_topological_and_bad_depths():
    with pytest.raises(ValueError, match="topological"):
        Tree(torch.tensor([1, 2, 3]), torch.tensor([-1, 2, 0]), torch.tensor([0, 2, 1]))
    with pytest.raises(ValueError, match="depth"):
        Tree(torch.tensor([1, 2]), torch.tensor([-1, 0]), torch.tensor([0, 2]))


def test_ancestor_mask_matches_walk_on_random_trees():
    gen = torch.Generator().manual_seed(0)
    for n in [1, 2, 5, 17, 40]:
        parents, depths = _random_tree(n, gen)
        got = ancestor_mask(torch.tensor(parents), max(depths))
        assert torch.equal(got, _mask_by_walking(parents))


def test_chain_tree():
    t = chain_tree(4, [5, 6])
    assert t.tokens.tolist() == [4, 5, 6] and t.parents.tolist() == [-1, 0, 1]
    assert t.paths.tolist() == [[0, 1, 2]]


def test_prefix_match_paper_example():
    beams = torch.tensor([[91, 92, 93, 95], [91, 92, 94, 96], [91, 92, 93, 97]])
    assert prefix_match(beams).tolist() == [[0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 0, 2]]
    # As draft paths after a root: 12 tokens compress to 7 drafts + the root (the paper's 9 incl. 91).
    tree = tree_from_paths(90, beams)
    assert tree.tokens.tolist() == [90, 91, 92, 93, 95, 94, 96, 97]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 2, 5, 3]
    assert tree.depths.tolist() == [0, 1, 2, 3, 4, 3, 4, 4]
    assert tree.paths.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 5, 6], [0, 1, 2, 3, 7]]


def _all_prefixes(paths: torch.Tensor, pad: int) -> set[tuple[int, ...]]:
    out = set()
    for row in paths.tolist():
        row = [t for t in row if t != pad]
        out.update(tuple(row[:k]) for k in range(1, len(row) + 1))
    return out


def _node_prefixes(tree: Tree) -> list[tuple[int, ...]]:
    return [tuple(tree.tokens[tree.path_to(i)][1:].tolist()) for i in range(tree.num_nodes)]


def test_dynamic_tree_matches_trie_on_random_ragged_beams():
    gen = torch.Generator().manual_seed(1)
    for trial in range(60):
        p = int(torch.randint(1, 9, (1,), generator=gen))
        length = int(torch.randint(0, 6, (1,), generator=gen))
        vocab = 2 + trial % 3  # tiny vocabularies force lots of shared prefixes
        paths = torch.randint(0, vocab, (p, length), generator=gen)
        lengths = torch.randint(0, length + 1, (p,), generator=gen)
        paths[torch.arange(length)[None, :] >= lengths[:, None]] = -1
        fast = tree_from_paths(7, paths)
        slow = tree_from_paths_reference(7, paths)
        assert fast.tokens.tolist() == slow.tokens.tolist()
        assert fast.parents.tolist() == slow.parents.tolist()
        assert fast.depths.tolist() == slow.depths.tolist()
        assert torch.equal(fast.mask, _mask_by_walking(fast.parents.tolist()))
        # Deduplicated: every node is a distinct prefix, and every input prefix has a node.
        prefixes = _node_prefixes(fast)
        assert len(set(prefixes)) == len(prefixes)
        assert set(prefixes) - {()} == _all_prefixes(paths, -1)


def test_dynamic_tree_keeps_first_occurrence_draft_probs():
    paths = torch.tensor([[3, 4], [3, 5]])
    q = torch.rand(2, 2, 6, generator=torch.Generator().manual_seed(0))
    tree = tree_from_paths(1, paths, draft_probs=q)
    assert tree.tokens.tolist() == [1, 3, 4, 5]
    assert torch.equal(tree.draft_probs[1], q[0, 0])  # shared node 3: row from beam 0
    assert torch.equal(tree.draft_probs[2], q[0, 1])
    assert torch.equal(tree.draft_probs[3], q[1, 1])


def test_dynamic_tree_rejects_bad_padding():
    with pytest.raises(ValueError, match="padded at the end"):
        tree_from_paths(0, torch.tensor([[-1, 3]]))
    with pytest.raises(ValueError, match="negative"):
        tree_from_paths(0, torch.tensor([[1, 3]]), pad=0)
