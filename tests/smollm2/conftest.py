"""Under smollm2/: `engine`, the PCDEngine on SmolLM2-135M-Instruct that the adapter and client tests
share (the model loaded once per session; free text capped, since SmolLM2 loops when greedy), and
`url` / `client`: one `pcd serve` on it for the session, on 127.0.0.1, with the API key `KEY` and
the README's `Ticket` (examples/ticket.py) as the schema `/classify` answers with."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from minicpm_pcd_adapters.server.app import create_app
from minicpm_pcd_adapters.server.settings import ServerSettings
from tests.helpers import KEY, served, smollm2_engine


@pytest.fixture(scope="session")
def url() -> Iterator[str]:
    """The base URL (`.../v1`) of one `pcd serve` on SmolLM2 for the whole session."""
    schema = f"{Path(__file__).resolve().parents[2] / 'examples' / 'ticket.py'}:Ticket"  # for /classify
    settings = ServerSettings(model_name="smollm2", api_key=KEY, schema=schema)
    with served(create_app(smollm2_engine(), settings)) as base:
        yield base + "/v1"


@pytest.fixture(scope="session")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def engine():
    return smollm2_engine()
