"""Every docs page renders as written: no markdown table or list left as a paragraph of raw text, and
no nested list flattened into its parent (`mkdocs build --strict` passes all three). Pages are
rendered by Python-Markdown with the site's own extensions, as mkdocs renders them; Python-Markdown
nests a list only under four spaces of indentation, where GitHub takes two."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import markdown
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
RAW = [
    (re.compile(r"^\s*\|.*\|\s*$"), "a table row"),
    (re.compile(r"^\s*\|?\s*:?-{3,}:?\s*\|"), "a table rule"),
    (re.compile(r"^\s*[-*+] \S"), "a list item"),
    (re.compile(r"^\s*\d+\. \S"), "a numbered list item"),
]


def extensions() -> list[str]:
    """The site's markdown extensions (mkdocs.yml), by name."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    names = [e if isinstance(e, str) else next(iter(e)) for e in config["markdown_extensions"]]
    return names


class Paragraphs(HTMLParser):
    """The text of every <p>, line by line (code spans' text included)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth, self.current, self.found = 0, [], []

    def handle_starttag(self, tag, attrs):
        if tag == "p":
            self.depth, self.current = self.depth + 1, []

    def handle_endtag(self, tag):
        if tag == "p" and self.depth:
            self.depth -= 1
            self.found.append("".join(self.current))

    def handle_data(self, data):
        if self.depth:
            self.current.append(data)


def unrendered(text: str) -> list[str]:
    """Lines of rendered paragraphs that are still markdown tables or lists."""
    parser = Paragraphs()
    parser.feed(markdown.markdown(text, extensions=extensions()))
    out = []
    for paragraph in parser.found:
        for line in paragraph.splitlines()[1:]:  # a paragraph's first line is its own text
            kind = next((what for pattern, what in RAW if pattern.match(line)), None)
            if kind is not None:
                out.append(f"{kind}: {line.strip()[:70]}")
    return out


def shallow_nested(text: str) -> list[str]:
    """List items indented by one to three spaces outside code blocks: Python-Markdown flattens them
    into the parent list."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"^ {1,3}([-*+]|\d+\.) \S", line):
            out.append(line.strip()[:70])
    return out


def test_the_check_finds_a_list_and_a_table_without_a_blank_line_before_them():
    assert unrendered("Systems:\n- one\n- two\n") == ["a list item: - one", "a list item: - two"]
    found = unrendered("The ratios\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    assert found[0] == "a table row: | a | b |" and len(found) == 3
    assert unrendered("Systems:\n\n- one\n\nThe ratios\n\n| a | b |\n|---|---|\n| 1 | 2 |\n") == []


def test_the_check_finds_a_nested_list_indented_by_two_spaces():
    flat = "- forms:\n  - auto\n  - none\n"
    assert shallow_nested(flat) == ["- auto", "- none"]
    html = markdown.markdown(flat, extensions=extensions())
    assert html.count("<ul>") == 1  # what the check guards against: one flat list
    assert shallow_nested(flat.replace("  -", "    -")) == []
    assert markdown.markdown(flat.replace("  -", "    -"), extensions=extensions()).count("<ul>") == 2


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_table_and_list_of_the_page_renders(page):
    assert unrendered(page.read_text()) == []
    if page.parent.name == "docs":  # README.md is read on GitHub, which nests under two spaces
        assert shallow_nested(page.read_text()) == []
