"""The packed input layout: token ids, position ids and the 4-D attention mask of a branch pass.

Pure functions of token ids and trees (no model, no device). One packed sequence is
`[prompt tokens][tree 1][tree 2]...` after `past_len` tokens already in the KV cache: a prompt token
sees the past and the prompt causally; a tree token sees the past, the whole prompt and its own
ancestors in its tree, nothing of other trees. Position ids restart at the prompt's end for every
tree, so each branch is computed exactly as if it followed the prompt alone.

`pack_rows` lays out several prompts on one shared past as left-padded rows, so that every row's trees
sit at the same offsets. (Packing several requests into one long sequence instead would make every
query attend over every other request's keys, all masked: attention work grows with the square of the
packed length.)

>>> from pcd_engine.branches import build_tree
>>> tree = build_tree(lambda s: [ord(c) for c in s], "{", ["a", "b"])
>>> packed = pack_inputs([7, 8], past_len=3, trees=[tree])
>>> packed.ids.tolist(), packed.positions.tolist(), packed.offsets
([[7, 8, 123]], [[3, 4, 5]], [2])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from pcd_engine.branches import TokenTree


class PackedInputs(NamedTuple):
    ids: torch.Tensor  # (B, L) token ids
    positions: torch.Tensor  # (B, L) position ids
    allowed: torch.Tensor  # (B, 1, L, past + L) bool: True where a query may attend to a key
    offsets: list[int]  # where each tree starts in L (the same in every row)


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
    """One row: the prompt's own tokens, then every tree, after `past_len` cached tokens."""
    n_prompt = len(prompt_ids)
    prompt_end = past_len + n_prompt  # every tree position restarts here
    offsets, ids, positions = [], list(prompt_ids), list(range(past_len, prompt_end))
    for tree in trees:
        offsets.append(len(ids))
        ids.extend(tree.tokens)
        positions.extend(prompt_end + d for d in tree.depths)
    length = len(ids)
    allowed = torch.zeros(length, past_len + length, dtype=torch.bool)
    allowed[:n_prompt, :prompt_end] = torch.ones(n_prompt, prompt_end, dtype=torch.bool).tril(past_len)
    allowed[n_prompt:, :prompt_end] = True
    for tree, offset in zip(trees, offsets, strict=True):
        rows = slice(offset, offset + len(tree.tokens))
        cols = slice(past_len + offset, past_len + offset + len(tree.tokens))
        allowed[rows, cols] = tree.ancestors
    return PackedInputs(torch.tensor([ids]), torch.tensor([positions]), allowed[None, None], offsets)


def pack_rows(prompts: Sequence[Sequence[int]], past_len: int, trees: Sequence[TokenTree]) -> PackedInputs:
    """`pack_inputs` for several prompts on one shared past: left-padded rows whose trees share offsets.
    A padding token sees only itself and no real token sees it."""
    packed = [pack_inputs(p, past_len, trees) for p in prompts]
    width = max(p.ids.shape[1] for p in packed)
    ids_out = torch.zeros(len(prompts), width, dtype=torch.long)
    positions_out = torch.full((len(prompts), width), past_len, dtype=torch.long)
    allowed = torch.zeros(len(prompts), 1, width, past_len + width, dtype=torch.bool)
    for row, (ids, positions, mask, _) in enumerate(packed):
        pad = width - ids.shape[1]
        ids_out[row, pad:], positions_out[row, pad:] = ids[0], positions[0]
        own = mask[0, 0]
        allowed[row, 0, pad:, :past_len] = own[:, :past_len]
        allowed[row, 0, pad:, past_len + pad :] = own[:, past_len:]
        allowed[row, 0, torch.arange(pad), past_len + torch.arange(pad)] = True
    offsets = [o + width - packed[0].ids.shape[1] for o in packed[0].offsets]
    return PackedInputs(ids_out, positions_out, allowed, offsets)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form attention adds to its scores: 0 where allowed, the dtype's minimum elsewhere
    (built where `allowed` lives, so on the GPU only a boolean mask crosses from the CPU)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)
