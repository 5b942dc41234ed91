"""`report.html`: the page a person reads after `pcd evaluate`, self-contained (images inline, no
scripts, nothing fetched), rendered by Jinja2 with every text escaped.

Per scored field: accuracy, macro-F1, ECE, log-loss and the majority-answer floor of every variant
(uncalibrated, calibrated), the reliability diagram and the coverage curve with the variants overlaid
(`plots.field_plots`), the confusion matrix and the most confident mistakes with their texts, from
the last variant (the calibrated one where there is one). Below `FEW_ROWS` scored rows it warns.

    >>> write_report(Path("out/evaluate/report.html"), {"uncalibrated": evaluation}, texts)  # doctest: +SKIP
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2

from minicpm_pcd_adapters.plots import field_plots
from pcd_engine import Evaluation

FEW_ROWS = 100  # below this many scored rows, ECE and the reliability bins are noisy
MISTAKES = 10  # most confident mistakes listed per field
MATRIX_VALUES = 12  # a confusion matrix with more values that occur is listed as its largest cells
TEXT_CHARS = 400  # a mistake's text is cut to this many characters


def write_report(
    path: Path,
    variants: Mapping[str, Evaluation],
    texts: Sequence[str],
    about: Mapping[str, str] | None = None,
    first: int = 1,
) -> Path:
    """Write the page for `variants` (name -> Evaluation of the same scored `texts`, in order);
    `about` lists what was evaluated (schema, model, input), shown at the top; `first` is the
    number of the first scored text among the input's records (counted from 1)."""
    last = list(variants)[-1]
    fields = []
    for name in variants[last].fields:
        reports = {v: e.fields[name].report() for v, e in variants.items()}
        if not reports[last]["n"]:
            continue
        reliability, coverage = field_plots(name, reports)
        fields.append(
            {
                "name": name,
                "reports": reports,
                "reliability": _data_url(reliability),
                "coverage": _data_url(coverage),
                "confusion": confusion(reports[last]["confusion"]),
                "mistakes": confident_mistakes(variants[last], name, texts, first),
            }
        )
    scored = variants[last].texts - len(variants[last].errors)
    page = _TEMPLATE.render(
        about=dict(about or {}),
        variants={v: e.summary for v, e in variants.items()},
        last=last,
        fields=fields,
        scored=scored,
        few_rows=FEW_ROWS,
        errors=[
            dict(e, record=first + e["index"], text=_cut(texts[e["index"]])) for e in variants[last].errors
        ],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def confusion(matrix: Mapping[str, Any]) -> dict[str, Any]:
    """The values that occur (as a label or an answer) and their counts[true][answered]; with more
    than MATRIX_VALUES of them, the largest off-diagonal cells as a list instead."""
    values, counts = matrix["values"], matrix["counts"]
    seen = [i for i in range(len(values)) if sum(counts[i]) or sum(row[i] for row in counts)]
    if len(seen) <= MATRIX_VALUES:
        return {"values": [values[i] for i in seen], "rows": [[counts[i][j] for j in seen] for i in seen]}
    cells = [(counts[i][j], values[i], values[j]) for i in seen for j in seen if i != j and counts[i][j]]
    cells.sort(key=lambda cell: -cell[0])
    return {"pairs": cells[:20], "values_seen": len(seen)}


def confident_mistakes(
    evaluation: Evaluation, field: str, texts: Sequence[str], first: int = 1
) -> list[dict[str, Any]]:
    """The MISTAKES wrong answers of `field` given with the highest confidence, with their texts
    and record numbers (the first text is record `first`)."""
    f = evaluation.fields[field]
    wrong = []  # (confidence, text index, answered value, true value)
    for probabilities, label, index in zip(f.probabilities, f.labels, f.texts, strict=True):
        answer = max(range(len(probabilities)), key=probabilities.__getitem__)
        if answer != label:
            wrong.append((probabilities[answer], index, f.values[answer], f.values[label]))
    wrong.sort(key=lambda w: -w[0])
    return [
        {"record": first + i, "confidence": p, "answer": answer, "truth": truth, "text": _cut(texts[i])}
        for p, i, answer, truth in wrong[:MISTAKES]
    ]


def _cut(text: str) -> str:
    return text if len(text) <= TEXT_CHARS else text[:TEXT_CHARS] + "…"


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


_TEMPLATE = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined).from_string(
    """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>pcd evaluate report</title>
<style>
body { font-family: system-ui, sans-serif; max-width: 70rem; margin: 2rem auto; padding: 0 1rem;
       color: #222; line-height: 1.4; }
table { border-collapse: collapse; margin: 0.5rem 0 1rem; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.2rem 0.5rem; text-align: right; }
th:first-child, td:first-child, .text { text-align: left; }
td.text { max-width: 40rem; }
.warning { background: #fff4e5; border: 1px solid #f0a020; padding: 0.5rem 1rem; }
.plots img { max-width: 48%; vertical-align: top; }
.diagonal { background: #e8f4e8; }
section.field { border-top: 2px solid #ddd; margin-top: 2rem; }
.wide { overflow-x: auto; }
</style>
</head>
<body>
<h1>pcd evaluate</h1>
<dl>{% for key, value in about.items() %}<dt>{{ key }}</dt><dd>{{ value }}</dd>{% endfor %}</dl>
{% if scored < few_rows %}
<p class="warning" id="few-rows"><strong>Only {{ scored }} scored rows.</strong> Below {{ few_rows }}
rows, accuracy moves by several points from one sample to the next and ECE and the reliability bins are
noisy (a bin holds a few answers): read these figures as rough.</p>
{% endif %}
<h2>Summary</h2>
<table id="summary">
<tr><th>variant</th><th>answered</th><th>errors</th><th>field accuracy</th><th>macro-F1</th><th>ECE</th>
<th>log-loss</th><th>exact object</th><th>majority answer</th></tr>
{% for name, s in variants.items() %}
<tr><td>{{ name }}</td><td>{{ s.answered }} / {{ s.texts }}</td><td>{{ s.errors }}</td>
{% for key in ("field_accuracy", "field_macro_f1", "field_ece", "field_log_loss", "exact_accuracy",
 "field_majority") %}<td>{{ "%.3f" % s[key] if s[key] is not none else "n/a" }}</td>{% endfor %}</tr>
{% endfor %}
</table>
<p>Figures are means over the fields. ECE: the gap between confidence and accuracy, averaged over
10 confidence bins (0 is perfectly calibrated). The majority answer always answers the field's most
frequent label in these rows: a floor to beat.</p>
{% for f in fields %}
<section class="field" id="field-{{ f.name }}">
<h2>{{ f.name }}</h2>
<table class="metrics">
<tr><th>variant</th><th>n</th><th>accuracy</th><th>macro-F1</th><th>ECE</th><th>log-loss</th>
<th>majority answer</th></tr>
{% for name, r in f.reports.items() %}
<tr><td>{{ name }}</td><td>{{ r.n }}</td>
{% for key in ("accuracy", "macro_f1", "ece", "log_loss", "majority") %}<td>{{ "%.3f" % r[key] }}</td>
{% endfor %}</tr>
{% endfor %}
</table>
<div class="plots">
<img class="reliability" alt="{{ f.name }}: reliability, the variants overlaid" src="{{ f.reliability }}">
<img class="coverage" alt="{{ f.name }}: coverage against accuracy" src="{{ f.coverage }}">
</div>
<h3>Confusion ({{ last }}): rows are the true values, columns the answers</h3>
{% if f.confusion.rows is defined %}
<div class="wide"><table class="confusion">
<tr><th>true \\ answered</th>{% for v in f.confusion["values"] %}<th>{{ v }}</th>{% endfor %}</tr>
{% for row in f.confusion.rows %}{% set i = loop.index0 %}
<tr><th>{{ f.confusion["values"][i] }}</th>{% for count in row %}<td{% if loop.index0 == i %}
 class="diagonal"{% endif %}>{{ count }}</td>{% endfor %}</tr>
{% endfor %}
</table></div>
{% else %}
<p>{{ f.confusion.values_seen }} values occur; the most frequent confusions:</p>
<table class="confusion-pairs">
<tr><th>true</th><th>answered</th><th>count</th></tr>
{% for count, truth, answer in f.confusion.pairs %}
<tr><td>{{ truth }}</td><td>{{ answer }}</td><td>{{ count }}</td></tr>
{% endfor %}
</table>
{% endif %}
<h3>Most confident mistakes ({{ last }})</h3>
{% if f.mistakes %}
<table class="mistakes">
<tr><th>record</th><th>confidence</th><th>answered</th><th>true</th><th class="text">text</th></tr>
{% for m in f.mistakes %}
<tr><td>{{ m.record }}</td><td>{{ "%.3f" % m.confidence }}</td><td>{{ m.answer }}</td>
<td>{{ m.truth }}</td><td class="text">{{ m.text }}</td></tr>
{% endfor %}
</table>
{% else %}<p>No mistakes.</p>{% endif %}
</section>
{% endfor %}
{% if errors %}
<h2>Rows without an answer</h2>
<table id="errors">
<tr><th>record</th><th>error</th><th class="text">message</th><th class="text">text</th></tr>
{% for e in errors %}<tr><td>{{ e.record }}</td><td>{{ e.type }}</td><td class="text">{{ e.message }}</td>
<td class="text">{{ e.text }}</td></tr>{% endfor %}
</table>
{% endif %}
</body>
</html>
"""
)
