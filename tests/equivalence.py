"""Reference scores: one ordinary full forward pass per candidate, no packing, no cache, no mask."""

from __future__ import annotations

import torch

from pcd_engine import PCDEngine
from pcd_engine.packing import PassStats
from pcd_engine.scoring import token_logprobs


def packed_and_separate(engine: PCDEngine, schema, text: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(packed, separate) per-token log-probs for every candidate of every decision."""
    plan = engine.plan(schema)
    prompt = [*plan.head, *engine.prompt.encode_text(text), *engine.prompt.tail]
    packed = engine.runner.run(prompt, plan.trees, PassStats(), engine.prefix_cache, len(plan.head))
    pairs = []
    for tree, logprobs in zip(plan.trees, packed, strict=True):
        for candidate, got in enumerate(token_logprobs(tree, logprobs)):
            continuation = list(tree.continuation(candidate))
            ids = torch.tensor([prompt + list(tree.chain) + continuation])
            with torch.inference_mode():
                full = torch.log_softmax(engine.model(input_ids=ids).logits[0].float(), dim=-1)
            start = len(prompt) + len(tree.chain) - 1
            want = full[start + torch.arange(len(continuation)), torch.tensor(continuation)]
            pairs.append((got, want))
    return pairs
