"""`engine` under smollm2/: the PCDEngine on SmolLM2-135M-Instruct that the adapter and client tests
share (loaded once per session; free text capped, since SmolLM2 loops when greedy)."""

from __future__ import annotations

import pytest

from tests.helpers import smollm2_engine


@pytest.fixture(scope="module")
def engine():
    return smollm2_engine()
