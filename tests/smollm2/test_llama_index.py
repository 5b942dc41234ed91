"""LlamaIndex: MiniCPMLLM and MiniCPMPCDProgram through LlamaIndex's public API, on SmolLM2 (CPU)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

import pytest
from llama_index.core import get_response_synthesizer
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.prompts import ChatPromptTemplate, PromptTemplate
from llama_index.core.schema import NodeWithScore, TextNode
from llama_index.core.workflow import StartEvent, StopEvent, Workflow, step
from pydantic import BaseModel, Field

from minicpm_pcd_adapters import MiniCPMLLM, MiniCPMPCDProgram
from pcd_engine import UnsupportedSchemaError
from tests.helpers import smollm2_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from ticket import Ticket, TriagedTicket

TEXT = "I was charged twice for my order, please refund me."
PROMPT = PromptTemplate("Route this customer message: {text}")


class Open(BaseModel):
    summary: str


def test_metadata_and_errors_need_no_model():
    llm = MiniCPMLLM(model="not/loaded", max_tokens=7)
    meta = llm.metadata
    assert meta.is_chat_model and meta.is_function_calling_model
    assert meta.num_output == 7 and meta.model_name == "not/loaded"
    with pytest.raises(UnsupportedSchemaError, match="'summary'"):  # checked before any loading
        MiniCPMPCDProgram.from_defaults(Open, prompt_template_str="{text}", llm=llm, allow_generation=False)
    with pytest.raises(ValueError, match="either prompt or prompt_template_str"):
        MiniCPMPCDProgram.from_defaults(Open, prompt=PROMPT, prompt_template_str="x", llm=llm)
    program = MiniCPMPCDProgram.from_defaults(Open, prompt_template_str="{text}", llm=llm)
    assert program.output_cls is Open and llm.engine is None
    with pytest.raises(TypeError, match="needs a MiniCPMLLM"):
        MiniCPMPCDProgram(Ticket, PROMPT, llm=object())  # type: ignore[arg-type]


pytestmark_slow = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> MiniCPMLLM:
    return MiniCPMLLM(engine=smollm2_engine(), model="SmolLM2-135M-Instruct", max_tokens=16)


@pytestmark_slow
def test_structured_predict_with_both_template_kinds(llm):
    from_text = llm.structured_predict(Ticket, PROMPT, text=TEXT)
    chat = ChatPromptTemplate.from_messages([("system", "Route the customer's message."), ("user", "{text}")])
    from_chat = llm.structured_predict(Ticket, chat, text=TEXT)
    assert isinstance(from_text, Ticket) and isinstance(from_chat, Ticket)


@pytestmark_slow
async def test_astructured_predict_equals_sync(llm):
    assert await llm.astructured_predict(Ticket, PROMPT, text=TEXT) == llm.structured_predict(
        Ticket, PROMPT, text=TEXT
    )


@pytestmark_slow
def test_stream_structured_predict_yields_the_object(llm):
    items = list(llm.stream_structured_predict(Ticket, PROMPT, text=TEXT))
    assert items == [llm.structured_predict(Ticket, PROMPT, text=TEXT)]


@pytestmark_slow
def test_as_structured_llm_chat_and_complete_return_the_json(llm):
    structured = llm.as_structured_llm(Ticket)
    response = structured.chat([ChatMessage(role=MessageRole.USER, content=TEXT)])
    expected = llm.structured_predict(Ticket, PromptTemplate("{text}"), text=TEXT)
    assert Ticket.model_validate_json(response.message.content) == expected
    assert response.raw == expected
    completed = structured.complete(TEXT)
    assert Ticket.model_validate_json(completed.text) == expected


@pytestmark_slow
async def test_program_call_acall_and_probabilities(llm):
    program = MiniCPMPCDProgram.from_defaults(Ticket, prompt_template_str="Route: {text}", llm=llm)
    value = program(text=TEXT)
    assert isinstance(value, Ticket) and await program.acall(text=TEXT) == value
    topic = program.last_result.fields["topic"]
    assert topic.value == value.topic and abs(sum(topic.probabilities.values()) - 1) < 1e-6


@pytestmark_slow
def test_open_and_mixed_models_through_the_same_paths(llm):
    mixed = llm.structured_predict(TriagedTicket, PROMPT, text=TEXT)
    assert isinstance(mixed, TriagedTicket) and 0 < len(mixed.summary) <= 100
    program = MiniCPMPCDProgram.from_defaults(Open, prompt=PROMPT, llm=llm)
    assert isinstance(program(text=TEXT), Open)
    assert program.last_result.fields["summary"].source == "generated"
    with pytest.raises(UnsupportedSchemaError, match="'summary'"):
        MiniCPMPCDProgram.from_defaults(Open, prompt=PROMPT, llm=llm, allow_generation=False)


@pytestmark_slow
async def test_workflow_step_classifies_tickets(llm):
    program = MiniCPMPCDProgram.from_defaults(Ticket, prompt=PROMPT, llm=llm)

    class Triage(Workflow):
        @step
        async def classify(self, ev: StartEvent) -> StopEvent:
            return StopEvent(result=[await program.acall(text=t) for t in ev.tickets])

    result = await Triage(timeout=600).run(tickets=[TEXT, "Where is my parcel?"])
    assert len(result) == 2 and all(isinstance(r, Ticket) for r in result)


@pytestmark_slow
def test_response_synthesizer_with_output_cls(llm):
    class Verdict(BaseModel):
        topic: Literal["billing", "delivery", "other"] = Field(description="What the notes are about.")
        needs_refund: bool

    synthesizer = get_response_synthesizer(llm=llm, output_cls=Verdict, response_mode="compact")
    nodes = [
        NodeWithScore(node=TextNode(text="Customer was charged twice for order 4412."), score=1.0),
        NodeWithScore(node=TextNode(text="Customer asks for the second payment back."), score=0.9),
    ]
    response = synthesizer.synthesize("What is this ticket about?", nodes=nodes)
    assert isinstance(response.response, Verdict)


@pytestmark_slow
async def test_plain_chat_and_completion(llm):
    messages = [ChatMessage(role=MessageRole.USER, content="Count from 1 to 10.")]
    whole = llm.chat(messages)
    streamed = list(llm.stream_chat(messages))
    assert streamed[-1].message.content == whole.message.content and len(streamed) > 2
    assert "".join(r.delta for r in streamed) == whole.message.content
    assert (await llm.achat(messages)).message.content == whole.message.content
    completion = llm.complete("Count from 1 to 10.")
    assert completion.text == whole.message.content
    pieces = [r async for r in await llm.astream_complete("Count from 1 to 10.")]
    assert pieces[-1].text == completion.text


@pytestmark_slow
def test_calibration_and_abstention_reach_the_program(llm):
    engine = llm.engine
    texts = [TEXT, "Where is my parcel?", "The app crashes.", "Delete my account."]
    labels = [{"topic": t} for t in ("billing", "delivery", "technical", "account")]
    template = PromptTemplate("{text}")
    cal = engine.calibrate(Ticket, texts, labels, method="temperature", folds=2)
    calibrated = MiniCPMLLM(engine=engine, model="SmolLM2-135M-Instruct", calibration=cal, abstain_below=1.0)
    program = MiniCPMPCDProgram.from_defaults(Ticket, prompt=template, llm=calibrated)
    value = program(text=TEXT)
    want = engine.classify(TEXT, Ticket, calibration=cal, abstain_below=1.0)
    assert value == want.value and program.last_result.needs_review
    assert program.last_result.fields["topic"].calibration == "temperature"
    assert program.last_result.fields["topic"].probabilities == want.fields["topic"].probabilities


@pytestmark_slow
def test_a_head_reaches_the_program_as_in_process(llm):
    engine = llm.engine
    texts = [TEXT, "Where is my parcel?", "The app crashes.", "Delete my account.", "Refund my order."]
    texts += ["My card was billed twice.", "Where is the package?", "Login fails again."]
    labels = [{"topic": t} for t in ("billing", "delivery", "technical", "account", "billing")]
    labels += [{"topic": t} for t in ("billing", "delivery", "technical")]
    cal = engine.calibrate(Ticket, texts, labels, method="head", folds=2)
    assert cal.needs_hidden
    calibrated = MiniCPMLLM(engine=engine, model="SmolLM2-135M-Instruct", calibration=cal)
    program = MiniCPMPCDProgram.from_defaults(Ticket, prompt=PromptTemplate("{text}"), llm=calibrated)
    for text in texts[:3]:
        value = program(text=text)
        want = engine.classify(text, Ticket, calibration=cal)
        assert value == want.value
        assert program.last_result.fields["topic"].calibration == "head"
        assert program.last_result.fields["topic"].probabilities == pytest.approx(
            want.fields["topic"].probabilities, abs=1e-5
        )
