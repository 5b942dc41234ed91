"""Real model, CPU: open and mixed models, LangChain's standard schemas, chat generation on SmolLM2."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, TypedDict

import pytest
import torch
from pydantic import BaseModel, Field

from pcd_engine import Limits, PCDEngine

pytestmark = pytest.mark.slow
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from ticket import TriagedTicket  # noqa: E402

TEXTS = [
    "I was charged twice for my subscription this month. Please refund the second payment.",
    "The app crashes every time I open the settings page.",
    "My parcel was supposed to arrive on Monday and it still hasn't shown up.",
]


class Joke(BaseModel):  # langchain_tests' schemas
    """Joke to tell user."""

    setup: str = Field(description="question to set up a joke")
    punchline: str | None = Field(default=None, description="answer to resolve the joke")


class JokeDict(TypedDict):
    """Joke to tell user."""

    setup: Annotated[str, ..., "question to set up a joke"]
    punchline: Annotated[str, ..., "answer to resolve the joke"]


class Person(BaseModel):
    name: str = Field(..., description="The name of the person.")
    age: int = Field(..., description="The age of the person.")


@pytest.fixture(scope="module")
def engine(smollm2):
    model, tokenizer = smollm2
    return PCDEngine(model, tokenizer, limits=Limits(max_string_length=60))


def test_mixed_ticket_scores_closed_fields_and_generates_the_summary(engine):
    results = [engine.classify(text, TriagedTicket) for text in TEXTS]
    for result in results:
        for path in ("topic", "refund_requested", "priority"):
            field = result.fields[path]
            assert field.source == "scored" and getattr(result.value, path) == field.value
            assert field.value == max(field.probabilities, key=field.probabilities.__getitem__)
        assert result.fields["summary"].source == "generated"
        assert 0 < len(result.value.summary) <= 100
    assert results[0].value.topic == "billing"
    batch = engine.classify_batch(TEXTS, TriagedTicket)
    assert [r.value for r in batch] == [r.value for r in results]  # padded batch == cached single calls


def test_langchain_standard_schemas_give_valid_objects(engine):
    person = engine.classify("Erick, 27 years old", Person)
    assert person.value == Person(name="Erick", age=27)
    joke = engine.classify("Tell me a joke about cats.", Joke)
    assert isinstance(joke.value, Joke) and len(joke.value.setup) <= 60
    as_dict = engine.classify("Tell me a joke about cats.", JokeDict)
    assert set(as_dict.value) == {"setup", "punchline"}


def test_generate_and_stream_equal_hf_greedy_generate(engine, smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    result = engine.generate(messages, max_tokens=20)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, pad_token_id=2)
    expected = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert result.text == expected and "Paris" in result.text
    assert "".join(chunk.text for chunk in engine.stream(messages, max_tokens=20)) == result.text
