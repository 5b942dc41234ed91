"""The packed input layout: token ids, position ids and the 4-D attention mask of a branch pass.

Pure functions of token ids and trees (no model, no device). One packed sequence is
`[prompt tokens][trees]` after `past_len` tokens already in the KV cache: a prompt token sees the past
and the prompt causally; a tree token sees the past, the whole prompt and its own ancestors in its
tree, nothing of other trees. Position ids restart at the prompt's end for every tree, so each branch
is computed exactly as if it followed the prompt alone.

The trees form a forest: a chain token that an earlier tree already fed after the same tokens
(`{"` before every field's name, `{"shipping": {"` before each of its nested fields) is fed once and
shared. It has the same tokens before it at the same positions, so its logits and its keys are the
ones each tree would have computed alone. `PackedInputs.at` says where a tree's token sits.

`pack_rows` lays out several prompts on one shared past as left-padded rows, so that every row's trees
sit at the same columns. (Packing several requests into one long sequence instead would make every
query attend over every other request's keys, all masked: attention work grows with the square of the
packed length.)

    >>> from pcd_engine.branches import build_tree
    >>> chars = lambda s: [ord(c) for c in s]
    >>> trees = [build_tree(chars, "{a", ["b", "c"]), build_tree(chars, "{d", ["e", "f"])]
    >>> packed = pack_inputs([7, 8], past_len=3, trees=trees)
    >>> packed.ids.tolist(), packed.positions.tolist(), packed.columns
    ([[7, 8, 123, 97, 100]], [[3, 4, 5, 6, 6]], [(2, 3), (2, 4)])
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from pcd_engine.branches import TokenTree


class PackedInputs(NamedTuple):
    ids: torch.Tensor  # (B, L) token ids
    positions: torch.Tensor  # (B, L) position ids
    allowed: torch.Tensor  # (B, 1, L, past + L) bool: True where a query may attend to a key
    columns: list[tuple[int, ...]]  # per tree, where each of its fed tokens sits (the same in every row)
    prompt_last: int  # where the prompt's last fed token sits (an empty chain's root)

    def at(self, tree: int, index: int) -> int:
        """Where fed token `index` of tree number `tree` sits; -1 is the prompt's last token."""
        return self.columns[tree][index] if index >= 0 else self.prompt_last


def forest(trees: Sequence[TokenTree]) -> tuple[list[int], list[tuple[int, ...]]]:
    """(the fed tokens' parents in the forest, -1 for the prompt; per tree its tokens' forest
    indices): chain tokens fed by an earlier tree after the same tokens are shared. Computed once per
    tuple of trees (a plan's trees are the same objects on every request and every padded row)."""
    return _forest(tuple(trees))


@functools.lru_cache(maxsize=256)
def _forest(trees: tuple[TokenTree, ...]) -> tuple[list[int], list[tuple[int, ...]]]:
    parents: list[int] = []
    chains: dict[tuple[int, int], int] = {}  # (parent, token) -> forest index, chain tokens only
    where = []
    for tree in trees:
        local: list[int] = []
        for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
            up = local[parent] if parent >= 0 else -1
            in_chain = i < len(tree.chain)
            if in_chain and (up, token) in chains:
                local.append(chains[(up, token)])
                continue
            if in_chain:
                chains[(up, token)] = len(parents)
            local.append(len(parents))
            parents.append(up)
        where.append(tuple(local))
    return parents, where


def fed_tokens(trees: Sequence[TokenTree]) -> int:
    """How many tree tokens a pass feeds (shared chain tokens once)."""
    return len(forest(trees)[0])


def microbatches(trees: Sequence[TokenTree], first_budget: int, budget: int) -> list[list[int]]:
    """Group tree indices in order; each group's token count fits the budget (one tree at least)."""
    groups: list[list[int]] = [[]]
    used, limit = 0, first_budget
    for i, tree in enumerate(trees):
        n = len(tree.tokens)
        if groups[-1] and used + n > limit:
            groups.append([])
            used, limit = 0, budget
        groups[-1].append(i)
        used += n
    return groups


def pack_inputs(prompt_ids: Sequence[int], past_len: int, trees: Sequence[TokenTree]) -> PackedInputs:
    """One row: the prompt's own tokens, then the trees' forest, after `past_len` cached tokens."""
    n_prompt = len(prompt_ids)
    prompt_end = past_len + n_prompt  # every tree position restarts here
    parents, where = forest(trees)
    ids, positions = (
        list(prompt_ids) + [0] * len(parents),
        list(range(past_len, prompt_end)) + [0] * len(parents),
    )
    for tree, local in zip(trees, where, strict=True):
        for token, depth, f in zip(tree.tokens, tree.depths, local, strict=True):
            ids[n_prompt + f], positions[n_prompt + f] = token, prompt_end + depth
    length = len(ids)
    allowed = torch.zeros(length, past_len + length, dtype=torch.bool)
    allowed[:n_prompt, :prompt_end] = torch.ones(n_prompt, prompt_end, dtype=torch.bool).tril(past_len)
    allowed[n_prompt:, :prompt_end] = True
    for tree, local in zip(trees, where, strict=True):
        rows = torch.tensor(local, dtype=torch.long) + n_prompt
        allowed[rows[:, None], rows[None, :] + past_len] = tree.ancestors
    columns = [tuple(n_prompt + f for f in local) for local in where]
    return PackedInputs(
        torch.tensor([ids]), torch.tensor([positions]), allowed[None, None], columns, n_prompt - 1
    )


def pack_rows(prompts: Sequence[Sequence[int]], past_len: int, trees: Sequence[TokenTree]) -> PackedInputs:
    """`pack_inputs` for several prompts on one shared past: left-padded rows whose trees share columns.
    A padding token sees only itself and no real token sees it."""
    packed = [pack_inputs(p, past_len, trees) for p in prompts]
    width = max(p.ids.shape[1] for p in packed)
    ids_out = torch.zeros(len(prompts), width, dtype=torch.long)
    positions_out = torch.full((len(prompts), width), past_len, dtype=torch.long)
    allowed = torch.zeros(len(prompts), 1, width, past_len + width, dtype=torch.bool)
    for row, (ids, positions, mask, _, _) in enumerate(packed):
        pad = width - ids.shape[1]
        ids_out[row, pad:], positions_out[row, pad:] = ids[0], positions[0]
        own = mask[0, 0]
        allowed[row, 0, pad:, :past_len] = own[:, :past_len]
        allowed[row, 0, pad:, past_len + pad :] = own[:, past_len:]
        allowed[row, 0, torch.arange(pad), past_len + torch.arange(pad)] = True
    shift = width - packed[0].ids.shape[1]
    columns = [tuple(c + shift for c in tree) for tree in packed[0].columns]
    return PackedInputs(ids_out, positions_out, allowed, columns, packed[0].prompt_last + shift)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form attention adds to its scores: 0 where allowed, the dtype's minimum elsewhere
    (built where `allowed` lives, so on the GPU only a boolean mask crosses from the CPU)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)
