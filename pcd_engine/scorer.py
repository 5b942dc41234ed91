"""Scorer: a plan's token trees scored after one or many prompts, the schema's head computed once.

It owns what scoring reuses across requests on one model: the runner, the prefix cache (the KV of each
schema's prompt head) and the content-free priors. A single prompt reuses the longest cached prefix
and, on a miss, computes the head alone and stores it. A batch fetches (or computes) the head once and
runs padded rows on it; a request too long for the token budget runs alone, in microbatches.

The priors are the log of the mean probability the trees get for content-free texts ("N/A", "",
"[MASK]"; Zhao et al. 2021), computed once per plan and cached; `decisions.py` subtracts them.

    >>> scorer = Scorer(BranchRunner(model), PrefixCache(), ChatPrompt(tokenizer))  # doctest: +SKIP
    >>> per_prompt = scorer.score(plan, [prompt.ids], [PassStats()])  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch

from pcd_engine import shortlist
from pcd_engine.bounded_cache import BoundedCache
from pcd_engine.branches import TokenTree, path_scores, rows_in, sub_tree
from pcd_engine.cache import PrefixCache
from pcd_engine.continuation import Continuation, KeptCall, continuation_of
from pcd_engine.hidden import HiddenCapture
from pcd_engine.plan import DecisionPlan, SchemaPlan
from pcd_engine.prompt import ChatPrompt
from pcd_engine.results import FieldResult
from pcd_engine.runner import BranchRunner, Kept, PassStats

CONTENT_FREE_TEXTS = ("N/A", "", "[MASK]")


class Scorer:
    def __init__(
        self,
        runner: BranchRunner,
        prefix_cache: PrefixCache | None,
        prompt: ChatPrompt,
        max_priors: int = 256,
    ) -> None:
        self.runner = runner
        self.prefix_cache = prefix_cache
        self.prompt = prompt
        # per plan (kept with it: an id is only unique while its plan lives), bounded like the plans
        self.priors_cache: BoundedCache[tuple[int, tuple[bool, ...]], tuple[SchemaPlan, list[torch.Tensor]]]
        self.priors_cache = BoundedCache(max_priors)

    def score(
        self,
        plan: SchemaPlan,
        prompts: Sequence[Sequence[int]],
        stats: Sequence[PassStats],
        *,
        only: Sequence[int] | None = None,
        normalized: Sequence[bool] | None = None,
        capture: Sequence[HiddenCapture] | None = None,
        kept: list[Kept] | None = None,
    ) -> list[list[torch.Tensor]]:
        """Per prompt, per tree of the plan (or the trees numbered `only`), the runner's scored
        columns. Every prompt starts with the plan's head; `normalized` overrides the plan's. With
        `capture` (one per prompt), the same calls read each prompt's hidden states into it. `kept`
        receives, per prompt, its call kept for the shortlists' second pass (`finish_shortlists`)."""
        picked = range(len(plan.trees)) if only is None else only
        trees = [plan.trees[k] for k in picked]
        normalized = [plan.normalized[k] for k in picked] if normalized is None else list(normalized)
        if not trees:
            if kept is not None:
                kept.extend(None for _ in prompts)
            return [[] for _ in prompts]
        head_len = len(plan.head)
        if len(prompts) == 1:  # one call even without a prefix cache (a batch computes the head apart)
            return [self._alone(prompts[0], trees, stats[0], head_len, normalized, _at(capture, 0), kept)]
        fits = [self.runner.fits(len(p) - head_len, trees) for p in prompts]
        together = [i for i, ok in enumerate(fits) if ok]
        out, calls = {}, {}
        for i, (p, ok) in enumerate(zip(prompts, fits, strict=True)):
            if not ok:  # a prompt too long for the budget runs alone, its trees in microbatches
                own: list[Kept] = []
                out[i] = self._alone(p, trees, stats[i], head_len, normalized, _at(capture, i), own)
                calls[i] = own[0]
        if together:
            kv = self._shared_head(prompts[together[0]][:head_len], [stats[i] for i in together])
            rows = [prompts[i] for i in together]
            captured = [capture[i] for i in together] if capture is not None else None
            shared: list[Kept] = []
            scored = self.runner.run_rows(
                rows, trees, [stats[i] for i in together], kv, head_len, normalized, captured, shared
            )
            out.update(zip(together, scored, strict=True))
            calls.update(zip(together, shared, strict=True))
        if kept is not None:
            kept.extend(calls[i] for i in range(len(prompts)))
        return [out[i] for i in range(len(prompts))]

    def priors(
        self, plan: SchemaPlan, stats: PassStats, normalized: Sequence[bool] | None = None
    ) -> list[torch.Tensor]:
        """Per tree, the content-free prior in the same units as the scores (`normalized`: log-probs
        or logits per tree), over `plan.prior_trees` (a shortlisted decision's whole tree); the
        first call per plan runs the texts on `stats`' behalf."""
        key = (id(plan), tuple(plan.normalized if normalized is None else normalized))
        cached = self.priors_cache.get(key)
        if cached is not None and cached[0] is plan:
            return cached[1]
        runs = []
        for text in CONTENT_FREE_TEXTS:
            ids = self.prompt.with_head(plan.head, text).ids
            runs.append(self._alone(ids, plan.prior_trees, stats, len(plan.head), key[1]))
        count = torch.log(torch.tensor(float(len(runs))))
        priors = [
            torch.logsumexp(torch.stack(per_tree), dim=0) - count for per_tree in zip(*runs, strict=True)
        ]
        self.priors_cache.put(key, (plan, priors), replace=True)
        return priors

    def score_trees(
        self, plan: SchemaPlan, prompt_ids: Sequence[int], trees: Sequence[TokenTree], stats: PassStats
    ) -> list[torch.Tensor]:
        """Log-probs (normalised) of other trees than the plan's after one of its prompts (a
        shortlist's second pass), on the cached head."""
        return self._alone(prompt_ids, trees, stats, len(plan.head), [True] * len(trees))

    def finish_shortlists(
        self,
        plan: SchemaPlan,
        prompts: Sequence[Sequence[int]],
        fields: Sequence[dict[str, FieldResult]],
        stats: Sequence[PassStats],
        priors: Sequence[torch.Tensor] | None,
        kept: Sequence[Kept] | None = None,
        among: Collection[int] | None = None,
        rankings: Sequence[Sequence[dict[str, FieldResult]]] = (),
    ) -> list[dict[str, dict[int, float]]]:
        """The shortlists' second pass (shortlist.py) for requests scored by `score`: per request, its
        shortlisted decisions (those numbered `among` in `plan.scored_decisions`, default all) scored
        exactly on their best values; `fields` (first-pass results, one dict per request) are replaced
        in place. With `kept` (from `score`), requests of one first call continue it in one call and
        feed only the tokens past the cut (continuation.py); a request without one feeds its text and
        the values' whole continuations again, alone. `priors` are per whole tree (`priors`).

        The values scored are the best of each field by the first of `rankings` (each one dict per
        request, for example the first-pass results through a calibration; default `fields`). The
        others' best values are scored too, in the same call: returned per request, per field, the
        exact score of every value scored, from which `shortlist.completed` answers each ranking as
        if it had been the only one."""
        todo = [
            (k, dp)
            for k, dp in enumerate(plan.scored_decisions)
            if dp.whole is not None and (among is None or k in among)
        ]
        if not todo:
            return [{} for _ in fields]
        ranked = list(rankings) or [fields]
        picks = [
            [
                sorted({c for by in ranked for c in shortlist.best(by[i][dp.decision.path], dp.keep)})
                for _, dp in todo
            ]
            for i in range(len(fields))
        ]
        scored: dict[int, list[list[float]]] = {}
        alone, calls = _by_call(kept if kept is not None else [None] * len(prompts), range(len(prompts)))
        for i in alone:
            scored[i] = self._whole_again(plan, prompts[i], todo, picks[i], stats[i], priors)
        for call, requests in calls:
            scored.update(self._continued(call, requests, todo, picks, fields, stats, priors))
        exact: list[dict[str, dict[int, float]]] = []
        for i, own in enumerate(fields):
            exact.append({})
            for (_, dp), pick, scores in zip(todo, picks[i], scored[i], strict=True):
                path = dp.decision.path
                exact[i][path] = dict(zip(pick, scores, strict=True))
                own[path] = shortlist.completed(
                    own[path], exact[i][path], ranked[0][i][path], dp.keep, dp.rule_name
                )
        return exact

    def finish_gates(
        self,
        plan: SchemaPlan,
        prompts: Sequence[Sequence[int]],
        stats: Sequence[PassStats],
        kept: Sequence[Kept],
        wanted: Sequence[Sequence[int]],
        capture: Sequence[HiddenCapture] | None = None,
    ) -> list[dict[int, torch.Tensor]]:
        """The gated pass (gates.py) for requests scored by `score(..., only=plan.first_trees)`: per
        request, the scored columns of the trees numbered `wanted[i]`, fed after its prompt. Requests
        of one kept first call are fed in one call on its KV (each row feeds the union of their
        trees); a request without one feeds its text again with its trees, alone. With `capture`
        (the first call's, one per request), the same calls read these trees' fork states into it."""
        out: list[dict[int, torch.Tensor]] = [{} for _ in prompts]
        alone, calls = _by_call(kept, [i for i in range(len(prompts)) if wanted[i]])
        for i in alone:
            trees = [plan.trees[k] for k in wanted[i]]
            normalized = [plan.normalized[k] for k in wanted[i]]
            into = _at(capture, i)
            own = HiddenCapture(into.text_start, into.text_end) if into is not None else None
            runs = self._alone(prompts[i], trees, stats[i], len(plan.head), normalized, own)
            out[i] = dict(zip(wanted[i], runs, strict=True))
            if into is not None and own is not None:  # forks by the plan's tree numbers
                into.forks.update((k, own.forks[j]) for j, k in enumerate(wanted[i]))
        for call, requests in calls:
            union = sorted({k for i in requests.values() for k in wanted[i]})
            owners = _owners(call, requests, stats)
            trees, normalized = [plan.trees[k] for k in union], [plan.normalized[k] for k in union]
            rows = None
            if capture is not None:  # a row of no request reads into a capture nobody keeps
                spare = HiddenCapture(0, 0)
                rows = [
                    (capture[requests[r]] if r in requests else spare, None, union) for r in range(call.rows)
                ]
            after = self.runner.run_after(call, trees, normalized, owners, rows)
            for row, i in requests.items():
                out[i] = {k: scores for k, scores in zip(union, after[row], strict=True) if k in wanted[i]}
        return out

    def _continued(
        self,
        call: KeptCall,
        requests: dict[int, int],
        todo: Sequence[tuple[int, DecisionPlan]],
        picks: Sequence[Sequence[Sequence[int]]],
        fields: Sequence[dict[str, FieldResult]],
        stats: Sequence[PassStats],
        priors: Sequence[torch.Tensor] | None,
    ) -> dict[int, list[list[float]]]:
        """Exact scores of the picked values of the requests on rows `requests` of one kept call: the
        first pass's score plus the log-probs past the cut (minus their prior), in one call."""
        per_row: list[list[tuple[TokenTree, Continuation]]] = [[] for _ in range(call.rows)]
        for row, i in requests.items():
            for (_, dp), pick in zip(todo, picks[i], strict=True):
                assert dp.tree is not None and dp.whole is not None
                for c in pick:
                    cont = continuation_of(dp.tree, dp.whole, c)
                    if cont is not None:
                        per_row[row].append((dp.tree, cont))
        owners = _owners(call, requests, stats)
        runs = self.runner.continue_call(call, per_row, owners) if any(per_row) else None
        out: dict[int, list[list[float]]] = {}
        for row, i in requests.items():
            tails = iter(runs[row] if runs is not None else ())
            out[i] = []
            for (k, dp), pick in zip(todo, picks[i], strict=True):
                assert dp.tree is not None and dp.whole is not None
                first = list(fields[i][dp.decision.path].log_scores.values())
                scores = []
                for c in pick:
                    cut = len(dp.tree.paths[c])
                    if cut == len(dp.whole.paths[c]):  # cut nowhere: the first pass scored it whole
                        scores.append(first[c])
                        continue
                    tail = next(tails)  # in the order `per_row` was built
                    if dp.rule.corrects_prior and priors is not None:
                        tail = tail - path_scores(dp.whole, priors[k], c)[cut:]
                    scores.append(first[c] + float(tail.double().sum()))
                out[i].append(scores)
        return out

    def _whole_again(
        self,
        plan: SchemaPlan,
        prompt_ids: Sequence[int],
        todo: Sequence[tuple[int, DecisionPlan]],
        picks: Sequence[Sequence[int]],
        stats: PassStats,
        priors: Sequence[torch.Tensor] | None,
    ) -> list[list[float]]:
        """Exact scores of one request's picked values from their whole sub-trees, fed after its
        prompt again (its first call was not kept)."""
        trees = [sub_tree(dp.whole, pick) for (_, dp), pick in zip(todo, picks, strict=True) if dp.whole]
        runs = self.score_trees(plan, prompt_ids, trees, stats)
        out = []
        for (k, dp), tree, logprobs in zip(todo, trees, runs, strict=True):
            assert dp.whole is not None
            if dp.rule.corrects_prior and priors is not None:
                rows, columns = rows_in(tree, dp.whole)
                logprobs = logprobs - priors[k][rows][:, columns]
            out.append(list(dp.rule.score(tree, logprobs).log_scores))
        return out

    def head_kv(self, prompt_ids: Sequence[int], head_len: int, stats: PassStats) -> tuple[Any, int]:
        """(private KV, length) of the longest cached prefix of the prompt; on a miss, the first
        `head_len` tokens are computed and stored for later requests. (None, 0) without a cache."""
        if self.prefix_cache is None:
            return None, 0
        kv, past = self.prefix_cache.lookup(prompt_ids)
        stats.reused_tokens = past
        stats.cache_hit = past > 0 and past >= head_len
        if past < head_len:  # first request of this schema: compute and keep the head alone
            kv, past = self.runner.prefill_head(prompt_ids[:head_len], stats), head_len
            self.prefix_cache.store(prompt_ids[:head_len], kv)
        return kv, past

    def generation_kv(self, prompt_ids: Sequence[int], head_len: int, stats: PassStats) -> Any:
        """`head_kv` for generation: cropped so that at least one prompt token is left to feed."""
        kv, past = self.head_kv(prompt_ids, head_len, stats)
        if kv is not None and past >= len(prompt_ids):
            kv.crop(-(past - len(prompt_ids) + 1))
        return kv

    def _alone(
        self,
        prompt_ids: Sequence[int],
        trees: Sequence[TokenTree],
        stats: PassStats,
        head_len: int,
        normalized: Sequence[bool],
        capture: HiddenCapture | None = None,
        kept: list[Kept] | None = None,
    ) -> list[torch.Tensor]:
        if not trees:  # a plan of single-value fields: nothing to run, not even the head
            if kept is not None:
                kept.append(None)
            return []
        kv, past = self.head_kv(prompt_ids, head_len, stats)
        if kv is not None and past >= len(prompt_ids):  # feed one prompt token at least
            kv.crop(-(past - len(prompt_ids) + 1))
            past = stats.reused_tokens = len(prompt_ids) - 1
        if capture is not None and kv is not None and past > capture.text_start:  # feed the whole text
            kv.crop(capture.text_start - past)
            past = stats.reused_tokens = capture.text_start
        return self.runner.run(prompt_ids, trees, stats, kv, past, normalized, capture, kept)

    def _shared_head(self, head: Sequence[int], stats: Sequence[PassStats]) -> Any:
        """The head's KV for a batch, fetched or computed on the first row's behalf; the other rows
        reuse it (their counters say so)."""
        first = stats[0]
        if not head:  # a raw prompt without a BOS token: nothing is shared
            return None
        if self.prefix_cache is not None:
            kv, _ = self.head_kv(head, len(head), first)
        else:
            kv = self.runner.prefill_head(head, first)
        for other in stats[1:]:
            other.reused_tokens, other.cache_hit = len(head), first.cache_hit
        return kv


def _by_call(
    kept: Sequence[Kept], numbers: Iterable[int]
) -> tuple[list[int], list[tuple[KeptCall, dict[int, int]]]]:
    """The requests numbered `numbers`, split for a later pass: those whose first call was not kept,
    and per kept call, its rows' requests (row -> request number)."""
    alone: list[int] = []
    calls: dict[int, tuple[KeptCall, dict[int, int]]] = {}  # id of the call -> (call, rows)
    for i in numbers:
        handle = kept[i]
        if handle is None:
            alone.append(i)
        else:
            calls.setdefault(id(handle[0]), (handle[0], {}))[1][handle[1]] = i
    return alone, list(calls.values())


def _owners(call: KeptCall, requests: dict[int, int], stats: Sequence[PassStats]) -> list[PassStats | None]:
    """Per row of a kept call, the counters of the request it holds (None: a row of no request)."""
    return [stats[requests[r]] if r in requests else None for r in range(call.rows)]


def _at(capture: Sequence[HiddenCapture] | None, index: int) -> HiddenCapture | None:
    return capture[index] if capture is not None else None
