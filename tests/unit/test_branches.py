"""Token trees: shared chain, trie of continuations, boundary merges, ancestors."""

from __future__ import annotations

import itertools

import pytest
import torch

from pcd_engine.branches import build_tree
from pcd_engine.errors import TokenizationError


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_shared_first_tokens_are_fed_once_and_leaves_are_not_fed():
    tree = build_tree(chars, "{", ['"ab"}', '"ac"}', '"b"}'])
    assert tree.chain == tuple(chars('{"'))
    # inner nodes: 'a' (shared by two candidates), 'b' of "ab, 'c' of "ac, 'b' of "b
    assert [chr(t) for t in tree.tokens[len(tree.chain) :]] == ["a", "b", '"', "c", '"', "b", '"']
    assert [tree.continuation(i) for i in range(3)] == [
        tuple(chars('ab"}')),
        tuple(chars('ac"}')),
        tuple(chars('b"}')),
    ]
    # every path starts at the chain's end and each step predicts from its parent
    for path in tree.paths:
        assert path[0][0] == tree.root
        for (pred, _), (nxt, _) in itertools.pairwise(path):
            assert tree.parents[nxt] == pred
    assert tree.children(tree.root) == {ord("a"): len(tree.chain), ord("b"): len(tree.chain) + 5}


def test_positions_and_ancestor_mask_follow_the_tree():
    tree = build_tree(chars, "{", ["xy}", "xz}", "w}"])
    assert tree.depths == (*range(len(tree.chain)), 1, 2, 2, 1)
    node_x, node_w = len(tree.chain), len(tree.tokens) - 1
    assert tree.ancestors[node_w].nonzero().flatten().tolist() == [0, node_w]
    assert tree.ancestors[node_x + 1].nonzero().flatten().tolist() == [0, node_x, node_x + 1]
    assert torch.equal(tree.ancestors, tree.ancestors.tril())


def test_joint_tokenization_handles_merges_across_the_boundary():
    def merging(text: str) -> list[int]:  # a tokenizer that merges ': t' into one token
        return [1000 if i == -1 else ord(c) for i, c in enumerate(text.replace(": t", "\x01"))]

    tree = build_tree(merging, '{"x": ', ["true}", "false}"])
    assert tree.chain == tuple(chars('{"x"'))
    assert tree.continuation(0)[0] == 1 and tree.continuation(1)[0] == ord(":")


def test_prefix_candidates_are_rejected():
    with pytest.raises(TokenizationError, match="prefix"):
        build_tree(chars, "{", ["1", "10"])
    with pytest.raises(ValueError, match="two candidates"):
        build_tree(chars, "{", ["1}"])
