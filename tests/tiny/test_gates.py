"""Gated decisions (gates.py) on a tiny random Llama: a tool's arguments scored only where the tool is
chosen, in a second call on the first call's KV, with exactly the scores of one pass over every tree."""

from __future__ import annotations

import pytest
import torch

from pcd_engine import Conversation, PCDEngine
from pcd_engine.hidden import HiddenCapture
from pcd_engine.runner import PassStats
from pcd_engine.shortlist import ShortlistPolicy
from tests.helpers import ForwardCounter

KINDS = ["shipping", "billing", "account", "refunds", "orders", "delivery"]
REASONS = ["damaged parcel", "late delivery", "wrong item sent", "changed my mind"]
# six tools, each with closed arguments of several multi-token values: their argument trees are most
# of what one pass over every tree feeds
GATED_TOOLS = [
    {
        "name": f"handle_{kind}",
        "description": f"Handle a {kind} request.",
        "parameters": {
            "type": "object",
            "properties": {
                "reason": {"type": "string", "enum": [f"{r} ({kind})" for r in REASONS]},
                "priority": {"type": "string", "enum": ["low priority", "high priority"]},
                "channel": {"type": "string", "enum": ["email"]},  # one value: never scored
            },
            "required": ["reason", "priority", "channel"],
        },
    }
    for kind in KINDS
]
TEXTS = [
    "My parcel arrived broken and I want my money back.",
    "I cannot log in to my account since yesterday.",
    "Where is my order? It is two weeks late.",
    "Please change the address on my delivery.",
]


@pytest.fixture(scope="module")
def engines(tiny_model, tiny_tokenizer):
    """(gated: every extra call pays, one pass over every tree)"""
    gated = PCDEngine(tiny_model, tiny_tokenizer, rule="option", shortlist=ShortlistPolicy(call_cost=0))
    whole = PCDEngine(tiny_model, tiny_tokenizer, rule="option", shortlist=False)
    return gated, whole


def _asked(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _same_fields(gated, whole, paths) -> None:
    for path in paths:
        assert gated[path].value == whole[path].value, path
        assert gated[path].log_scores == pytest.approx(whole[path].log_scores, abs=1e-4), path
        assert gated[path].probabilities == pytest.approx(whole[path].probabilities, abs=1e-5), path


def test_the_plan_gates_each_tools_arguments_on_the_decision_where_the_extra_call_pays(engines):
    gated, whole = engines
    schema = gated.tools.schema(GATED_TOOLS, "required")
    instructions = gated.tools.plan(GATED_TOOLS, "required").instructions
    plan = gated.plan(schema, instructions=instructions)
    assert set(plan.gates) == {f"tool_{n}.{a}" for n in range(6) for a in ("reason", "priority", "channel")}
    assert {gate for gate in plan.gates.values()} == {("tool", f"handle_{kind}") for kind in KINDS}
    assert [plan.scored_decisions[k].decision.path for k in plan.first_trees] == ["tool"]
    assert plan.fingerprint == whole.plan(schema, instructions=instructions).fingerprint  # same calibrations
    assert not whole.plan(schema, instructions=instructions).gates
    on_gpu = ShortlistPolicy.for_device("cuda")  # a call costs as much as thousands of tokens there
    costly = PCDEngine(gated.model, gated.tokenizer, rule="option", shortlist=on_gpu)
    assert not costly.plan(schema, instructions=instructions).gates


@pytest.mark.parametrize("text", TEXTS)
def test_a_gated_tool_call_equals_one_pass_over_every_tree_in_two_calls_feeding_fewer_tokens(engines, text):
    gated, whole = engines
    gated.tools.call(_asked(text), GATED_TOOLS, tool_choice="required")  # the head and priors, once
    counter = ForwardCounter(gated.model.model)
    try:
        fast = gated.tools.call(_asked(text), GATED_TOOLS, tool_choice="required")
    finally:
        counter.close()
    slow = whole.tools.call(_asked(text), GATED_TOOLS, tool_choice="required")
    assert fast.tool == slow.tool and fast.arguments == slow.arguments
    _same_fields({"tool": fast.decision}, {"tool": slow.decision}, ["tool"])
    _same_fields(fast.fields, slow.fields, ["reason", "priority"])
    assert fast.fields["channel"].value == "email"
    assert fast.scoring.diagnostics.forward_calls == 2 and counter.rows == [1, 1]
    assert fast.scoring.diagnostics.branch_tokens < slow.scoring.diagnostics.branch_tokens / 3
    value = fast.scoring.value  # the other tools' arguments are not scored: their groups are None
    chosen = f"tool_{KINDS.index(fast.tool.removeprefix('handle_'))}"
    assert getattr(value, chosen) is not None
    assert all(getattr(value, f"tool_{n}") is None for n in range(6) if f"tool_{n}" != chosen)
    assert set(fast.scoring.fields) == {"tool", f"{chosen}.reason", f"{chosen}.priority", f"{chosen}.channel"}


def test_a_batch_continues_each_first_call_with_the_union_of_its_rows_chosen_trees(engines):
    gated, whole = engines
    plan = gated.tools.plan(GATED_TOOLS, "auto")
    batch = [Conversation.of(_asked(t)) for t in TEXTS]
    fast = gated.classify_batch(batch, plan.schema, instructions=plan.instructions)
    slow = whole.classify_batch(batch, plan.schema, instructions=plan.instructions)
    for a, b in zip(fast, slow, strict=True):
        assert set(a.fields) <= set(b.fields) and "tool" in a.fields
        _same_fields(a.fields, b.fields, [p for p in a.fields if b.fields[p].source == "scored"])
        chosen = a.fields["tool"].value
        scored = {p.split(".")[0] for p in a.fields if p != "tool"}
        assert scored == (
            {f"tool_{KINDS.index(chosen.removeprefix('handle_'))}"} if chosen in plan.arguments else set()
        )


def _prompts(engine, plan, texts):
    return [
        engine.prompt.with_conversation(plan.head, plan.system, Conversation.of(_asked(t))) for t in texts
    ]


def _captures(prompts):
    return [HiddenCapture(len(p.head), len(p.head) + len(p.text)) for p in prompts]


def test_rows_of_one_kept_call_continue_it_with_different_trees_and_a_lost_call_feeds_the_text_again(engines):
    gated, whole = engines
    tools = gated.tools.plan(GATED_TOOLS, "required")
    plan = gated.plan(tools.schema, instructions=tools.instructions)
    reference = whole.plan(tools.schema, instructions=tools.instructions)
    assert [t.tokens for t in plan.trees] == [t.tokens for t in reference.trees]
    prompts = _prompts(gated, plan, TEXTS[:3])
    ids = [p.ids for p in prompts]
    seen = _captures(prompts)
    expected = whole.pipeline.scorer.score(reference, ids, [PassStats() for _ in ids], capture=seen)
    scorer, stats, kept, captured = gated.pipeline.scorer, [PassStats() for _ in ids], [], _captures(prompts)
    first = scorer.score(plan, ids, stats, only=plan.first_trees, kept=kept, capture=captured)
    assert [len(run) for run in first] == [1, 1, 1] and all(k is not None for k in kept)
    assert len({id(k[0]) for k in kept}) == 1  # one batched first call: its rows continue together
    wanted = [[1, 2], [5, 6, 11, 12], []]
    kept[1] = None  # as if that row's first call had run in microbatches: its text is fed again
    gated_runs = scorer.finish_gates(plan, ids, stats, kept, wanted, captured)
    for i, own in enumerate(wanted):
        assert sorted(gated_runs[i]) == own and sorted(captured[i].forks) == [0, *own]
        for k in own:
            assert torch.allclose(gated_runs[i][k], expected[i][k], atol=1e-4), (i, k)
        for k in (0, *own):  # the fork states a head reads, from whichever call fed the tree
            assert torch.allclose(captured[i].forks[k], seen[i].forks[k], atol=1e-4), (i, k)
        assert torch.allclose(captured[i].text_last, seen[i].text_last, atol=1e-5)
    assert [s.forward_calls for s in stats] == [2, 2, 1]  # the third row wanted nothing


def test_the_calibrated_decision_chooses_which_arguments_are_scored(engines):
    gated, whole = engines
    texts = TEXTS * 3
    target = next(
        t["name"]
        for t in GATED_TOOLS
        if t["name"] != gated.tools.call(_asked(TEXTS[0]), GATED_TOOLS, tool_choice="required").tool
    )
    calibration = whole.tools.calibrate(
        GATED_TOOLS, texts, [target] * len(texts), tool_choice="required", method="bias"
    )
    fast = gated.tools.call(_asked(TEXTS[0]), GATED_TOOLS, tool_choice="required", calibration=calibration)
    slow = whole.tools.call(_asked(TEXTS[0]), GATED_TOOLS, tool_choice="required", calibration=calibration)
    assert fast.tool == slow.tool == target  # moved by the calibration, and its arguments were scored
    assert fast.arguments == slow.arguments
    _same_fields(fast.fields, slow.fields, ["reason", "priority"])


def test_fitting_scores_every_tools_arguments_where_the_model_chose_another_tool(engines):
    gated, _ = engines
    chosen = {gated.tools.call(_asked(t), GATED_TOOLS, tool_choice="required").tool for t in TEXTS}
    other = next(t["name"] for t in GATED_TOOLS if t["name"] not in chosen)
    group = f"tool_{KINDS.index(other.removeprefix('handle_'))}"
    labels = [{"tool": other, "arguments": {"priority": "high priority"}}] * len(TEXTS)
    calibration = gated.tools.calibrate(GATED_TOOLS, TEXTS, labels, tool_choice="required", method="bias")
    assert len(calibration.held_out[f"{group}.priority"].labels) == len(TEXTS)


def test_heads_read_the_chosen_tools_fork_states_from_the_second_call(engines):
    gated, whole = engines
    texts = [f"{t} (case {n})" for n in range(3) for t in TEXTS]
    kinds = ["billing", "refunds"] * 6
    priorities = ["low priority", "low priority", "high priority", "high priority"] * 3
    labels = [
        {"tool": f"handle_{k}", "arguments": {"reason": f"{REASONS[n % 2]} ({k})", "priority": p}}
        for n, (k, p) in enumerate(zip(kinds, priorities, strict=True))
    ]
    calibration = whole.tools.calibrate(
        GATED_TOOLS, texts, labels, tool_choice="required", method="head", folds=2
    )
    assert calibration.needs_hidden and calibration.fields["tool_1.priority"].method == "head"
    for text in texts[:4]:
        fast = gated.tools.call(_asked(text), GATED_TOOLS, tool_choice="required", calibration=calibration)
        slow = whole.tools.call(_asked(text), GATED_TOOLS, tool_choice="required", calibration=calibration)
        assert fast.scoring.diagnostics.forward_calls == 2
        assert fast.tool == slow.tool and fast.arguments == slow.arguments
        _same_fields({"tool": fast.decision}, {"tool": slow.decision}, ["tool"])
        _same_fields(fast.fields, slow.fields, ["reason", "priority"])
        assert fast.fields["priority"].calibration == "head"
