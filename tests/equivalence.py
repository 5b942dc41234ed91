"""Reference scores: one ordinary full forward pass per candidate, no packing, no cache, no mask."""

from __future__ import annotations

import torch

from pcd_engine import PCDEngine
from pcd_engine.packing import PassStats
from pcd_engine.precision import separate_logprobs
from pcd_engine.scoring import token_logprobs


def packed_and_separate(engine: PCDEngine, schema, text: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(packed, separate) per-token log-probs for every candidate of every decision."""
    plan = engine.plan(schema)
    prompt = [*plan.head, *engine.prompt.encode_text(text), *engine.prompt.tail]
    packed = engine.runner.run(prompt, plan.trees, PassStats(), engine.prefix_cache, len(plan.head))
    pairs = []
    for tree, logprobs in zip(plan.trees, packed, strict=True):
        for candidate, got in enumerate(token_logprobs(tree, logprobs)):
            pairs.append((got, separate_logprobs(engine.model, prompt, tree, candidate)))
    return pairs
