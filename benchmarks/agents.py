"""Agent loops on a template without a tool protocol (SmolLM2's ChatML): how earlier calls and their
results are rendered decides whether the text answer after a tool's result reads the result or writes
the call again.

Conversations built from the development data (../shared/data/bitext_customer_support.jsonl): the
customer's message, the assistant's call of `open_case(category=<the row's category>)`, and the
tool's result, which carries a case number and a promise the answer should pass on. Then
`engine.tools.call(..., tool_choice="auto")` decides the next step and, when it is a text answer,
writes it. Renderings compared (the engine's `Conversation.plain_turns`, patched per run):
  - json-tool (the rendering before the conversation value): the call as the decision's JSON in the
    assistant's turn, the result in the template's `tool` role;
  - words-user: the call said in words ("I called the tool ... with ..."), the result as a user turn
    that names the tool;
  - checking-user, checking-raw-user: the call as "One moment, I am checking that for you.", the
    result as a user turn, after "Result of the check:" or alone;
  - json-decision: json-tool before the decision, the default before the text answer;
  - default (the engine's, chosen from these runs): the call left out (the assistant's words kept),
    the result as it is in the template's `tool` role, before the decision and the text alike.
Reported per rendering: the share of decisions that answer in text, of text answers that repeat the
call (its name, its argument's key or a JSON object), and of text answers that use the result's
content (its case number or its promise).

    python benchmarks/agents.py --limit 60
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.data import load_set
from minicpm_pcd_adapters import load_smollm2
from pcd_engine import Conversation
from pcd_engine.conversation import Call, result_text

TOOL_NAME = "open_case"
PROMISE = "within 24 hours"


def tool(categories: list[str]) -> dict[str, Any]:
    parameters = {
        "type": "object",
        "properties": {"category": {"type": "string", "enum": categories}},
        "required": ["category"],
    }
    return {
        "name": TOOL_NAME,
        "description": "Open a support case for the customer.",
        "parameters": parameters,
    }


def conversation(row: dict[str, Any], number: int) -> list[dict[str, Any]]:
    category = row["labels"]["category"]
    result = f"Case {number} opened ({category}). An agent will contact the customer {PROMISE}."
    call = {
        "id": f"call_{number}",
        "function": {"name": TOOL_NAME, "arguments": json.dumps({"category": category})},
    }
    return [
        {"role": "system", "content": "You are a customer-support assistant. Use the tools to help."},
        {"role": "user", "content": row["text"]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{number}", "content": result},
    ]


def call_text(call: Call) -> str:
    return f"(I called the tool {call.name} with {json.dumps(call.arguments)}.)"


Rendering = Callable[..., list[tuple[str, str]]]


def json_tool(
    self: Conversation, result_role: str = "tool", calls_as: str | None = None
) -> list[tuple[str, str]]:
    """Before: the call as the decision's JSON in the assistant's turn, the result in `tool`."""
    out = []
    for turn in self.turns:
        if turn.calls:
            written = [json.dumps({"tool": c.name, c.name: c.arguments}) for c in turn.calls]
            out.append(("assistant", "\n".join(written)))
        else:
            out.append((turn.role, turn.content))
    return out


def words_user(
    self: Conversation, result_role: str = "tool", calls_as: str | None = None
) -> list[tuple[str, str]]:
    """The call said in words, the result a user turn that names the tool."""
    out = []
    for turn in self.turns:
        if turn.role == "tool":
            out.append(("user", result_text(turn)))
        elif turn.calls:
            out.append(("assistant", "\n".join(call_text(c) for c in turn.calls)))
        else:
            out.append((turn.role, turn.content))
    return out


def checking(lead: str) -> Rendering:
    """The call as an assistant's "checking" sentence (no name), the result a user turn after `lead`."""

    def render(
        self: Conversation, result_role: str = "tool", calls_as: str | None = None
    ) -> list[tuple[str, str]]:
        out = []
        for turn in self.turns:
            if turn.role == "tool":
                out.append(("user", f"{lead}{turn.content}"))
            elif turn.calls:
                out.append(("assistant", "One moment, I am checking that for you."))
            else:
                out.append((turn.role, turn.content))
        return out

    return render


def json_decision(self: Conversation, result_role: str = "tool") -> list[tuple[str, str]]:
    """Before the decision the call as the decision's JSON (what json-tool does), before the text
    answer the engine's own rendering (the call left out): `run` clears the flag while the text is
    generated."""
    return json_tool(self) if DECISION_PASS[0] else ENGINE_RENDERING(self, result_role)


ENGINE_RENDERING = Conversation.plain_turns
DECISION_PASS = [True]
RENDERINGS: dict[str, Rendering | None] = {
    "json-tool": json_tool,
    "words-user": words_user,
    "checking-user": checking("Result of the check:\n"),
    "checking-raw-user": checking(""),
    "json-decision": json_decision,
    "default": None,  # the engine's own: the call left out, the result as it is in the `tool` role
}


def repeats_the_call(text: str) -> bool:
    return TOOL_NAME in text or '"category"' in text or text.lstrip().startswith("{")


def run(engine: Any, rows: list[dict[str, Any]], rendering: str, max_tokens: int) -> dict[str, Any]:
    categories = sorted({r["labels"]["category"] for r in rows})
    tools = [tool(categories)]
    original, generate = Conversation.plain_turns, engine.generate
    Conversation.plain_turns = RENDERINGS[rendering] or original  # type: ignore[method-assign]
    engine.clear_caches()

    def text_answer(*args: Any, **kwargs: Any) -> Any:
        DECISION_PASS[0] = False
        try:
            return generate(*args, **kwargs)
        finally:
            DECISION_PASS[0] = True

    engine.generate = text_answer
    try:
        texts, repeated, used, started = 0, 0, 0, time.perf_counter()
        for number, row in enumerate(rows, 1000):
            result = engine.tools.call(conversation(row, number), tools, max_tokens=max_tokens)
            if result.tool is not None:
                continue
            texts += 1
            answer = result.text or ""
            repeated += repeats_the_call(answer)
            used += str(number) in answer or PROMISE in answer or "24 hours" in answer
        seconds = time.perf_counter() - started
    finally:
        Conversation.plain_turns = original  # type: ignore[method-assign]
        del engine.generate
    n = len(rows)
    return {
        "rendering": rendering,
        "conversations": n,
        "text_answers": texts / n,
        "repeat_the_call": repeated / max(texts, 1),
        "use_the_result": used / max(texts, 1),
        "seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=60, help="conversations (rows of bitext)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--renderings", nargs="*", default=list(RENDERINGS))
    args = parser.parse_args()
    _, rows = load_set("bitext_customer_support", args.limit)
    engine = load_smollm2()
    print("| rendering | conversations | text answers | repeat the call | use the result | seconds |")
    print("|---|---|---|---|---|---|")
    for rendering in args.renderings:
        r = run(engine, rows, rendering, args.max_tokens)
        print(
            f"| {r['rendering']} | {r['conversations']} | {r['text_answers']:.1%} "
            f"| {r['repeat_the_call']:.1%} | {r['use_the_result']:.1%} | {r['seconds']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
