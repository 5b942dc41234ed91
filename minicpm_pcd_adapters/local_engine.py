"""What both framework adapters (LangChain's `ChatMiniCPM`, LlamaIndex's `MiniCPMLLM`) are configured
with, declared once: the model to load, decoding defaults, calibrations and the abstention threshold,
and `load()`, which loads the engine on first use.

Each adapter subclasses `LocalEngine` beside its framework's base class and converts its own message
objects into the engine's `Conversation` (its `messages.py`); the engine does the rest.

    >>> LocalEngine(temperature=0.7).sampling({"seed": 3}).temperature
    0.7
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from minicpm_pcd_adapters.minicpm import MINICPM5_2B, EngineSlot
from pcd_engine import Calibration, Conversation, PCDEngine, Sampling, ToolCallResult

SAMPLING_OPTIONS = frozenset(f.name for f in dataclasses.fields(Sampling))


class LocalEngine(BaseModel):
    """The model an adapter runs and how: `model` is a hub id (pinned `revision`), a local folder or a
    GGUF file (`gguf_file`); or pass `engine`, an already loaded `PCDEngine`, so that several adapters
    share one model. Decoding is greedy unless `temperature` > 0. `calibration` (from
    `engine.calibrate`, fitted with the same schema and system message) and `abstain_below` apply to
    structured answers; `tool_calibration` (fitted on `engine.tools.schema(tools, tool_choice)`) and
    `abstain_below` to tool decisions."""

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    model: str = Field(default=MINICPM5_2B.hub_id, description="Hub id, local folder or model name.")
    revision: str | None = Field(default=None, description="The hub revision to load (pin a commit).")
    gguf_file: str | None = Field(default=None, description="A GGUF file in the folder or hub repo.")
    engine: PCDEngine | None = Field(default=None, exclude=True, description="An engine already loaded.")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="PCDEngine options to load with.")
    max_tokens: int = Field(default=512, description="Tokens generated per chat call.")
    temperature: float = Field(default=0.0)
    top_p: float = Field(default=1.0)
    min_p: float = Field(default=0.0)
    repetition_penalty: float = Field(default=1.0)
    seed: int | None = Field(default=None, description="Seed for sampled decoding (temperature > 0).")
    calibration: Calibration | None = Field(
        default=None, exclude=True, description="Calibration (engine.calibrate) for structured answers."
    )
    abstain_below: float | None = Field(
        default=None, description="Fields and decisions below this confidence are marked abstained."
    )
    tool_calibration: Calibration | None = Field(
        default=None, exclude=True, description="Calibration (engine.tools.calibrate) of tool decisions."
    )

    _slot: EngineSlot = PrivateAttr(default_factory=EngineSlot)

    def load(self) -> PCDEngine:
        """The engine, loaded on first use (thread-safe)."""
        if self.engine is None:
            self.engine = self._slot.load(
                self.model, revision=self.revision, gguf_file=self.gguf_file, options=self.engine_kwargs
            )
        return self.engine

    def sampling(self, overrides: Mapping[str, Any] | None = None) -> Sampling:
        """Decoding options: each `Sampling` field from the per-call `overrides`, else this adapter's
        field of that name, else Sampling's default."""
        given = overrides or {}
        return Sampling(
            **{
                f.name: given.get(f.name, getattr(self, f.name, f.default))
                for f in dataclasses.fields(Sampling)
            }
        )

    def structured_options(self, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The options of a structured answer (`engine.classify`): the call's sampling, this
        adapter's calibration and abstention threshold."""
        return {
            "sampling": self.sampling(overrides),
            "calibration": self.calibration,
            "abstain_below": self.abstain_below,
        }

    def decide_tools(
        self,
        conversation: Conversation,
        tools: Sequence[Any],
        tool_choice: Any,
        max_tokens: int,
        sampling: Sampling,
    ) -> ToolCallResult:
        """A tool decision with this adapter's tool calibration and abstention threshold."""
        return self.load().tools.call(
            conversation,
            tools,
            tool_choice=tool_choice,
            calibration=self.tool_calibration,
            abstain_below=self.abstain_below,
            max_tokens=max_tokens,
            sampling=sampling,
        )


__all__ = ["SAMPLING_OPTIONS", "LocalEngine"]
