"""Lower precision that keeps FP32 decisions: a load-time self-check and FP32 re-scoring.

`self_check` runs a fixed probe (a small schema's token trees after a short head and two texts)
through the engine's own packed path (cached head, padded rows, branch masks) and through ordinary
separate forward passes, one per candidate, in the model's dtype. The packed path is sound in that
dtype when every candidate's token log-probs agree within `TOLERANCE[dtype]` and every probe decision
is the same both ways. In FP32 the two agree to 1e-4 (tests/tiny/test_packing.py); in bf16/fp16 the same
sums are rounded in a different order, so the tolerance follows the format's precision (SmolLM2-135M
on the probe: 0.23 nats in bf16, 0.029 in fp16). A broken mask or cache path is off by whole
nats, or gives NaN.

`FP32Rescorer` keeps an FP32 copy of the weights with its own scorer (runner, prefix cache, priors).
`rescore` scores again on that copy every field of a request whose margin (chosen probability minus
the runner-up's) is below `margin`, and its result replaces the low-precision one, so that close calls
are decided as FP32 decides them. Its counter `rescored_fields` counts the fields it decided.

    >>> engine = PCDEngine.from_pretrained(path, dtype="bfloat16", fp32_rescore=True)  # doctest: +SKIP
    >>> engine.precision_check.passed, engine.precision_check.max_abs_diff  # doctest: +SKIP
    (True, 0.031)
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel

from pcd_engine.branches import TokenTree
from pcd_engine.cache import PrefixCache
from pcd_engine.decisions import decide_field
from pcd_engine.loading import native_bf16
from pcd_engine.plan import SchemaPlan
from pcd_engine.prompt import ChatPrompt
from pcd_engine.request import Request, elapsed_ms
from pcd_engine.rules import token_logprobs
from pcd_engine.runner import BranchRunner, Kept, PassStats
from pcd_engine.scorer import Scorer

# max |packed - separate| per token log-prob (nats) that a sound packed path stays within
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.5, torch.float16: 0.1}


class ProbeTicket(BaseModel):
    """The self-check's fixed schema: options that share first tokens, a bool, multi-token values."""

    topic: Literal["billing", "billing_dispute", "delivery"]
    sentiment: Literal["negative", "neutral", "positive"]
    urgent: bool


PROBE_HEAD = "Classify the customer message. Answer with one JSON object.\n"
PROBE_TEXTS = ("I was charged twice and nobody answers my emails. Fix it today!", "Thanks, all good.")


@dataclass(frozen=True)
class SelfCheck:
    dtype: str
    max_abs_diff: float  # worst |packed - separate| token log-prob on the probe (nats)
    tolerance: float
    decisions_agree: bool  # every probe decision (option rule) is the same both ways
    candidates: int

    @property
    def passed(self) -> bool:
        return self.decisions_agree and self.max_abs_diff <= self.tolerance


def separate_logprobs(model: Any, prompt: Sequence[int], tree: TokenTree, candidate: int) -> torch.Tensor:
    """A candidate's continuation token log-probs from one ordinary forward pass (no cache, no mask)."""
    continuation = list(tree.continuation(candidate))
    device = next(model.parameters()).device
    ids = torch.tensor([[*prompt, *tree.chain, *continuation]], device=device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
    start = len(prompt) + len(tree.chain) - 1
    rows = logits[start : start + len(continuation)]
    return torch.log_softmax(rows, dim=-1)[torch.arange(len(continuation)), torch.tensor(continuation)].cpu()


def self_check(runner: BranchRunner, prompt: ChatPrompt, plan: SchemaPlan) -> SelfCheck:
    """ProbeTicket's trees (`plan`, under the option rule) after the probe texts, through the packed
    path (a shared cached head, padded rows) and through separate passes, in the runner's dtype."""
    probe = dataclasses.replace(plan, head=tuple(prompt.encode_text(PROBE_HEAD)))  # a short fixed head
    prompts = [[*probe.head, *prompt.encode_text(text)] for text in PROBE_TEXTS]
    trees = probe.trees
    stats = [PassStats() for _ in prompts]
    packed = Scorer(runner, PrefixCache(), prompt).score(probe, prompts, stats)
    worst, agree, count = 0.0, True, 0
    for ids, per_tree in zip(prompts, packed, strict=True):
        for tree, logprobs in zip(trees, per_tree, strict=True):
            got = token_logprobs(tree, logprobs.cpu())
            want = [separate_logprobs(runner.model, ids, tree, c) for c in range(len(tree.paths))]
            worst = max(worst, *(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)))
            best = [int(torch.stack([t.sum() for t in side]).argmax()) for side in (got, want)]
            agree &= best[0] == best[1]  # the option rule's choice, packed and separate
            count += len(tree.paths)
    if not all(bool(torch.isfinite(t).all()) for row in packed for t in row):
        worst = float("inf")
    dtype = str(runner.dtype).removeprefix("torch.")
    return SelfCheck(dtype, worst, TOLERANCE.get(runner.dtype, 0.5), agree, count)


def warn_if_emulated(dtype: torch.dtype, device: torch.device) -> None:
    """A warning where bf16 weights run on a device without native bf16 matrix products."""
    if dtype == torch.bfloat16 and not native_bf16(device):
        warnings.warn(
            f"this {device.type} has no native bf16 matrix products (AVX512-BF16 or AMX on a CPU): "
            "bf16 is computed through float32 here, slower than float32 itself",
            stacklevel=3,
        )


def describe(dtype: torch.dtype, rescorer: FP32Rescorer | None) -> str:
    """How an engine computes its scores: the dtype, and FP32 re-scoring below a margin if any."""
    name = str(dtype).removeprefix("torch.")
    return name if rescorer is None else f"{name}, fp32 re-scoring below {rescorer.margin:g}"


class FP32Rescorer:
    """Scores close calls again on an FP32 copy of the weights (its own runner and prefix cache)."""

    def __init__(
        self, model: Any, margin: float, max_tokens_per_forward: int, cache: bool, prompt: ChatPrompt
    ) -> None:
        if not 0.0 < margin <= 1.0:
            raise ValueError(f"rescore_margin must be in (0, 1], got {margin}")
        if next(model.parameters()).dtype != torch.float32:
            raise ValueError("the re-scoring model must hold float32 weights")
        self.runner = BranchRunner(model, max_tokens_per_forward)
        self.scorer = Scorer(self.runner, PrefixCache() if cache else None, prompt)
        self.margin = margin
        self.rescored_fields = 0

    def needs(self, margin: float | None) -> bool:
        return margin is not None and margin < self.margin

    def rescore(self, plan: SchemaPlan, request: Request) -> None:
        """Score again in FP32 every decision of the request whose margin is below the threshold."""
        began = time.perf_counter()
        scored = plan.scored_decisions
        low = [k for k, dp in enumerate(scored) if self.needs(request.fields[dp.decision.path].margin)]
        if not low:
            return
        stats = PassStats()
        kept: list[Kept] | None = [] if plan.shortlisted else None  # for the shortlists' second pass
        (logprobs,) = self.scorer.score(plan, [request.prompt.ids], [stats], only=low, kept=kept)
        priors = None
        if any(scored[k].rule.corrects_prior for k in low):
            priors = self.scorer.priors(plan, stats)
        fields = {}
        for k, lp in zip(low, logprobs, strict=True):
            dp = scored[k]
            prior = priors[k] if priors is not None else None
            fields[dp.decision.path] = decide_field(dp, lp, prior, dp.rule)
        self.scorer.finish_shortlists(plan, [request.prompt.ids], [fields], [stats], priors, kept, among=low)
        for path, result in fields.items():
            request.fields[path] = dataclasses.replace(result, rescored=True)
        self.rescored_fields += len(low)
        request.rescored += len(low)
        request.stats.forward_calls += stats.forward_calls
        request.timings["rescore"] = elapsed_ms(began)
