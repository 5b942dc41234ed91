"""LangChain: ChatMiniCPM through langchain-tests' standard suites and through LCEL, on SmolLM2 (CPU)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypedDict

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests
from pydantic import BaseModel, Field

from minicpm_pcd_adapters import ChatMiniCPM
from pcd_engine import ModelLoadError, UnsupportedSchemaError
from pcd_engine.results import json_key
from tests.helpers import smollm2_engine

SMOLLM2 = "SmolLM2-135M-Instruct"


class TestChatMiniCPMUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatMiniCPM]:
        return ChatMiniCPM

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # loaded on first call; none here

    @property
    def supports_model_override(self) -> bool:
        return False  # one chat model serves the one model it loaded

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True


@pytest.mark.slow
class TestChatMiniCPMIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatMiniCPM]:
        return ChatMiniCPM

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": smollm2_engine(), "model": SMOLLM2, "max_tokens": 24}

    @property
    def has_tool_calling(self) -> bool:
        return True  # the tool (or a text answer) is a scored field: engine.tools.call

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True  # method="json_mode" is routed to the engine like every method

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True


class Ticket(BaseModel):
    """A customer-support message to route."""

    topic: Literal["billing", "delivery", "account", "technical", "other"]
    refund_requested: bool = Field(description="Does the customer ask for money back?")


class Triage(TypedDict):
    topic: Literal["billing", "delivery", "other"]
    urgent: bool


TEXTS = [
    "I was charged twice, refund me!",
    "Where is my parcel?",
    "The app crashes at login.",
    "Please delete my account.",
]


@pytest.fixture(scope="module")
def llm() -> ChatMiniCPM:
    return ChatMiniCPM(engine=smollm2_engine(), model=SMOLLM2, max_tokens=16)


class Recorder(BaseCallbackHandler):
    def __init__(self) -> None:
        self.options: list[Any] = []
        self.lock = threading.Lock()

    def on_chat_model_start(self, serialized: Any, messages: Any, *, options: Any = None, **kw: Any) -> None:
        with self.lock:
            self.options.append(options)


def test_with_structured_output_needs_no_model_for_schema_errors():
    class Open(BaseModel):
        summary: str

    llm = ChatMiniCPM(model="not/loaded")
    with pytest.raises(UnsupportedSchemaError, match="'summary'"):
        llm.with_structured_output(Open, method="pcd")
    with pytest.raises(ValueError, match="method must be one of"):
        llm.with_structured_output(Ticket, method="tools")  # type: ignore[arg-type]
    assert llm.engine is None  # nothing was loaded


@pytest.mark.slow
def test_lcel_chain_gives_instances_and_probabilities(llm):
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Route the customer's message."), ("human", "{ticket}")]
    )
    chain = prompt | llm.with_structured_output(Ticket, include_raw=True)
    out = chain.invoke({"ticket": TEXTS[0]})
    assert set(out) == {"raw", "parsed", "parsing_error"} and out["parsing_error"] is None
    assert isinstance(out["parsed"], Ticket) and isinstance(out["raw"], AIMessage)
    fields = out["raw"].response_metadata["pcd"]["fields"]
    assert fields["topic"]["value"] == out["parsed"].topic
    assert abs(sum(fields["topic"]["probabilities"].values()) - 1) < 1e-6
    assert out["raw"].usage_metadata["input_tokens"] > 0


@pytest.mark.slow
def test_typed_dict_and_json_schema_dicts_give_dicts(llm):
    as_typed = llm.with_structured_output(Triage).invoke(TEXTS[1])
    assert isinstance(as_typed, dict) and set(as_typed) == {"topic", "urgent"}
    schema = Ticket.model_json_schema()
    as_schema = llm.with_structured_output(schema, method="function_calling").invoke(TEXTS[1])
    assert isinstance(as_schema, dict) and set(as_schema) == {"topic", "refund_requested"}


@pytest.mark.slow
def test_batch_of_32_uses_the_engine_batch_and_keeps_a_poisoned_input_in_place(llm, monkeypatch):
    structured = llm.with_structured_output(Ticket)
    texts: list[Any] = [TEXTS[i % 4] for i in range(32)]
    texts[9] = {"not": "a prompt"}  # LangChain cannot even turn this into messages
    calls: list[int] = []
    engine = llm.engine
    original = engine.classify_batch

    def counting(batch_texts: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(list(batch_texts)))
        return original(batch_texts, *args, **kwargs)

    monkeypatch.setattr(engine, "classify_batch", counting)
    results = structured.batch(texts, return_exceptions=True)
    assert calls == [31]  # one engine batch for every valid input
    assert isinstance(results[9], Exception)
    singles = {text: structured.invoke(text) for text in TEXTS}
    for i, result in enumerate(results):
        if i != 9:
            assert result == singles[texts[i]]


@pytest.mark.slow
async def test_abatch_equals_batch(llm):
    structured = llm.with_structured_output(Ticket)
    assert await structured.abatch(TEXTS) == structured.batch(TEXTS)


@pytest.mark.slow
def test_threads_give_the_sequential_results(llm):
    structured = llm.with_structured_output(Ticket)
    expected = [structured.invoke(text) for text in TEXTS]
    jobs = [TEXTS[(t + c) % 4] for t in range(8) for c in range(8)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(structured.invoke, jobs))
    assert got == [expected[(t + c) % 4] for t in range(8) for c in range(8)]


@pytest.mark.slow
def test_callbacks_see_the_schema_once_per_call(llm):
    recorder = Recorder()
    llm.with_structured_output(Ticket).invoke(TEXTS[0], config={"callbacks": [recorder]})
    assert len(recorder.options) == 1
    assert recorder.options[0]["ls_structured_output_format"]["schema"]["title"] == "Ticket"
    batch_recorder = Recorder()
    llm.with_structured_output(Ticket).batch(TEXTS, config={"callbacks": [batch_recorder]})
    assert len(batch_recorder.options) == len(TEXTS)


@pytest.mark.slow
def test_plain_chat_streams_tokens_and_honours_stop(llm):
    chunks = list(llm.stream("Count from 1 to 10, separated by commas."))
    assert len(chunks) > 3 and chunks[-1].usage_metadata["output_tokens"] > 0
    whole = llm.invoke("Count from 1 to 10, separated by commas.", stop=["5"])
    assert "5" not in whole.content and whole.response_metadata["finish_reason"] == "stop"


def test_default_model_loads_minicpm5_at_the_pinned_revision(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="12a3808a956f869c767195e9266b59c4d21d92e2"):
        ChatMiniCPM().load()  # offline here: the error names the pinned revision to download


@pytest.mark.slow
def test_calibration_and_abstention_reach_the_structured_answer():
    engine = smollm2_engine()
    labels = [
        {"topic": "billing", "refund_requested": True},
        {"topic": "delivery", "refund_requested": False},
        {"topic": "technical", "refund_requested": False},
        {"topic": "account", "refund_requested": False},
    ]
    cal = engine.calibrate(Ticket, TEXTS, labels, method="temperature", folds=2)
    llm = ChatMiniCPM(engine=engine, model=SMOLLM2, calibration=cal, abstain_below=1.0)
    out = llm.with_structured_output(Ticket, include_raw=True).invoke(TEXTS[0])
    want = engine.classify(TEXTS[0], Ticket, calibration=cal, abstain_below=1.0)
    assert out["parsed"] == want.value
    meta = out["raw"].response_metadata["pcd"]
    assert meta["needs_review"] and meta["abstained_fields"] == ["topic", "refund_requested"]
    assert meta["fields"]["topic"]["calibration"] == "temperature"
    assert meta["fields"]["topic"]["probabilities"] == pytest.approx(
        {k: v for k, v in want.fields["topic"].probabilities.items()}
    )


REFUND_TEXTS = [
    *TEXTS,
    "I want my money back for the broken phone.",
    "How do I change my email address?",
    "Refund the second payment, please.",
    "Is there a shop in Lyon?",
]
REFUND_LABELS = [{"refund_requested": r} for r in (True, False, False, False, True, False, True, True)]


@pytest.mark.slow
def test_a_head_reaches_the_structured_answer_as_in_process():
    engine = smollm2_engine()
    cal = engine.calibrate(Ticket, REFUND_TEXTS, REFUND_LABELS, method="head", folds=2)
    assert cal.needs_hidden  # refund_requested has a head; topic has no labels
    llm = ChatMiniCPM(engine=engine, model=SMOLLM2, calibration=cal)
    structured = llm.with_structured_output(Ticket, include_raw=True)
    outs = structured.batch(REFUND_TEXTS[:3])
    for text, out in zip(REFUND_TEXTS[:3], outs, strict=True):
        want = engine.classify(text, Ticket, calibration=cal)
        assert out["parsed"] == want.value
        got = out["raw"].response_metadata["pcd"]["fields"]["refund_requested"]
        assert got["calibration"] == "head"
        assert got["probabilities"] == pytest.approx(
            {json_key(k): v for k, v in want.fields["refund_requested"].probabilities.items()}, abs=1e-5
        )
