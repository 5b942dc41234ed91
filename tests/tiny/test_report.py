"""report.html (`pcd evaluate`'s page): parsed back, it holds every field's figures as the evaluation
computes them, inline images only, the most confident mistakes with their texts escaped, and the
small-sample warning. The CLI run that writes one is in test_smollm2.py."""

from __future__ import annotations

import base64
from html.parser import HTMLParser

import pytest

from minicpm_pcd_adapters.report import MATRIX_VALUES, confusion, write_report
from pcd_engine import PCDEngine, evaluate
from tests.helpers import LABELED, Ticket

LABELS = LABELED[:6]


TEXTS = [
    "I was charged twice for my order",
    "The app crashes when I log in",
    "Where is my parcel? <script>alert('x')</script>",
    "please refund me <img src=https://example.com/x.png>",
    "How do I change my password?",
    "charged twice, app crashes",
]


class Page(HTMLParser):
    """Tags with their attributes, and the cell texts of every table by its id or class."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.tables: dict[str, list[list[list[str]]]] = {}
        self.warning = ""
        self._table: list[list[str]] | None = None
        self._cell: list[str] | None = None
        self._in_warning = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        named = dict(attrs)
        if tag == "table":
            self._table = []
            key = named.get("id") or named.get("class") or "table"
            self.tables.setdefault(key, []).append(self._table)
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "p" and named.get("class") == "warning":
            self._in_warning = True

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._table is not None:
            self._table[-1].append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "table":
            self._table = None
        elif tag == "p":
            self._in_warning = False

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._in_warning:
            self.warning += data


@pytest.fixture(scope="module")
def page(tiny_model, tiny_tokenizer, tmp_path_factory):
    engine = PCDEngine(tiny_model, tiny_tokenizer)
    calibration = engine.calibrate(Ticket, TEXTS, LABELS, method="bias", folds=3)
    answers = engine.classify_batch(TEXTS, Ticket, calibration=calibration)
    labels = [dict(label) for label in LABELS]
    for i in (2, 3):  # the texts with markup are made mistakes, so the page shows them
        labels[i]["topic"] = next(v for v in ("billing", "crash") if v != answers[i].fields["topic"].value)
    texts, labels = [*TEXTS, 42], [*labels, LABELS[0]]  # 42: a text that gets an error record
    base = evaluate(engine, Ticket, texts, labels)
    variants = {"uncalibrated": base, "calibrated": base.recalibrated(calibration)}
    path = tmp_path_factory.mktemp("report") / "report.html"
    write_report(path, variants, [str(t) for t in texts], {"schema": "Ticket"}, first=11)
    source = path.read_text(encoding="utf-8")
    parsed = Page()
    parsed.feed(source)
    return source, parsed, variants, labels


def test_the_page_is_self_contained_and_escapes_the_texts(page):
    source, parsed, _, _ = page
    assert not [tag for tag, _ in parsed.tags if tag in ("script", "link", "iframe", "object")]
    images = [attrs for tag, attrs in parsed.tags if tag == "img"]
    assert len(images) == 2 * 2  # per field: reliability and coverage
    for attrs in images:
        prefix, data = str(attrs["src"]).split(",", 1)
        assert prefix == "data:image/png;base64"
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    assert "&lt;script&gt;alert(" in source and "<script>" not in source
    assert "&lt;img src=https://example.com/x.png&gt;" in source
    assert "https://example.com" not in " ".join(str(v) for _, attrs in parsed.tags for v in attrs.values())


def test_each_field_shows_every_variants_figures_as_the_evaluation_computes_them(page):
    _, parsed, variants, _ = page
    tables = parsed.tables["metrics"]
    assert len(tables) == 2
    for table, field in zip(tables, ("topic", "urgent"), strict=True):
        assert table[0] == ["variant", "n", "accuracy", "macro-F1", "ECE", "log-loss", "majority answer"]
        for row, (name, evaluation) in zip(table[1:], variants.items(), strict=True):
            r = evaluation.fields[field].report()
            want = [f"{r[k]:.3f}" for k in ("accuracy", "macro_f1", "ece", "log_loss", "majority")]
            assert row == [name, str(r["n"]), *want]
    summary = parsed.tables["summary"][0]
    assert [row[0] for row in summary[1:]] == ["uncalibrated", "calibrated"]
    assert summary[1][1] == "6 / 7" and summary[1][2] == "1"  # the error counted, not dropped


def test_confusion_and_most_confident_mistakes_come_from_the_last_variant(page):
    _, parsed, variants, labels = page
    calibrated = variants["calibrated"]
    matrix = parsed.tables["confusion"][0]
    values = matrix[0][1:]
    counts = [[int(c) for c in row[1:]] for row in matrix[1:]]
    report = calibrated.fields["topic"].report()["confusion"]
    for i, true in enumerate(values):
        for j, answered in enumerate(values):
            want = report["counts"][report["values"].index(true)][report["values"].index(answered)]
            assert counts[i][j] == want
    mistakes = parsed.tables["mistakes"][0]
    wrong = sum(sum(row) for row in counts) - sum(counts[i][i] for i in range(len(counts)))
    assert len(mistakes) - 1 == min(wrong, 10) > 0
    confidences = [float(row[1]) for row in mistakes[1:]]
    assert confidences == sorted(confidences, reverse=True)
    for record, _, answered, true, text in mistakes[1:]:
        index = int(record) - 11  # the first scored text is record 11
        assert text == " ".join(TEXTS[index].split()) and answered != true == labels[index]["topic"]
        assert calibrated.results[index]["topic"].value == answered
    errors = parsed.tables["errors"][0]
    assert errors[1][:2] == ["17", "InputError"]  # record 11 + 6


def test_few_rows_are_warned_about(page):
    _, parsed, _, _ = page
    assert "Only 6 scored rows." in parsed.warning and "below 100" in parsed.warning.lower()


def test_a_confusion_with_many_values_lists_its_largest_cells():
    size = MATRIX_VALUES + 3
    counts = [[0] * size for _ in range(size)]
    for i in range(size):
        counts[i][i] = 2
        counts[i][(i + 1) % size] = i  # value i is mistaken for the next one i times
    listed = confusion({"values": [f"v{i}" for i in range(size)], "counts": counts})
    assert listed["values_seen"] == size
    assert listed["pairs"][:2] == [
        (size - 1, f"v{size - 1}", "v0"),
        (size - 2, f"v{size - 2}", f"v{size - 1}"),
    ]
    small = confusion({"values": ["a", "b", "c"], "counts": [[1, 0, 0], [0, 0, 0], [2, 0, 3]]})
    assert small == {"values": ["a", "c"], "rows": [[1, 0], [2, 3]]}  # b never occurs
