"""pcd_engine: typed classification with parallel constrained decoding (PCD).

The core knows nothing of LangChain or LlamaIndex; adapters live in `minicpm_pcd_adapters`.
"""

from pcd_engine.engine import DEFAULT_RULE, PCDEngine
from pcd_engine.errors import (
    InputError,
    ModelLoadError,
    PCDError,
    SchemaLimitError,
    StructuredOutputError,
    UnsupportedSchemaError,
)
from pcd_engine.generate import Sampling
from pcd_engine.results import Diagnostics, FieldResult, Generation, GenerationChunk, PCDResult
from pcd_engine.schema import CompiledSchema, Limits, compile_schema
from pcd_engine.scoring import CodeRule, GreedyRule, OptionRule, Rule

__all__ = [
    "DEFAULT_RULE",
    "CodeRule",
    "CompiledSchema",
    "Diagnostics",
    "FieldResult",
    "Generation",
    "GenerationChunk",
    "GreedyRule",
    "InputError",
    "Limits",
    "ModelLoadError",
    "OptionRule",
    "PCDEngine",
    "PCDError",
    "PCDResult",
    "Rule",
    "Sampling",
    "SchemaLimitError",
    "StructuredOutputError",
    "UnsupportedSchemaError",
    "compile_schema",
]
__version__ = "0.1.0"
