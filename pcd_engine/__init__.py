"""pcd_engine: typed classification with parallel constrained decoding (PCD).

The core knows nothing of LangChain or LlamaIndex; adapters live in `minicpm_pcd_adapters` and use
only the names exported here: the engine, what its methods return or raise, and the schema helpers
adapters need before any model work.
"""

from pcd_engine import metrics
from pcd_engine.cache import PrefixCache
from pcd_engine.calibration import Calibration, FieldCalibration, ModelIdentity
from pcd_engine.conversation import ROLE_ALIASES, Call, Conversation, Turn, new_call_id
from pcd_engine.engine import DEFAULT_RULE, PCDEngine
from pcd_engine.errors import (
    AbstentionError,
    CalibrationError,
    InputError,
    ModelIntegrityError,
    ModelLoadError,
    PCDError,
    PrecisionCheckError,
    SchemaLimitError,
    StructuredOutputError,
    TokenizationError,
    UnsupportedSchemaError,
)
from pcd_engine.evaluation import Evaluation, FieldEvaluation, evaluate, evaluate_each
from pcd_engine.generate import Sampling
from pcd_engine.grammars import GRAMMAR_KINDS, Grammar
from pcd_engine.heads import FieldHead
from pcd_engine.hidden import HiddenStates
from pcd_engine.manifest import MANIFEST_NAME, create_manifest, read_manifest, verify_manifest, write_manifest
from pcd_engine.options import ClassifyOptions, GenerateOptions, PlanOptions, ToolCallOptions, ToolPlanOptions
from pcd_engine.output_types import OutputType, output_type, require_closed
from pcd_engine.pipeline import Pipeline
from pcd_engine.plan import SchemaPlan
from pcd_engine.precision import SelfCheck
from pcd_engine.prompt import LAYOUTS, TEXT_FRAMINGS, RawPrompt
from pcd_engine.results import (
    Diagnostics,
    FieldResult,
    Generation,
    GenerationChunk,
    PCDResult,
    TokenLogprob,
)
from pcd_engine.rules import RULES, CodeRule, ContextualCalibration, GreedyRule, OptionRule, Rule
from pcd_engine.schema import CompiledSchema, Limits, compile_schema
from pcd_engine.shortlist import ShortlistPolicy
from pcd_engine.suggestions import SHARE as SUGGESTION_SHARE
from pcd_engine.suggestions import LabelSuggestions, Suggestion
from pcd_engine.template_switches import read_switches
from pcd_engine.tool_calls import ToolCaller, ToolCallResult
from pcd_engine.tools import TOOL_CHOICES, Tool, ToolChoice, as_tools

__all__ = [
    "DEFAULT_RULE",
    "GRAMMAR_KINDS",
    "LAYOUTS",
    "MANIFEST_NAME",
    "ROLE_ALIASES",
    "RULES",
    "SUGGESTION_SHARE",
    "TEXT_FRAMINGS",
    "TOOL_CHOICES",
    "AbstentionError",
    "Calibration",
    "CalibrationError",
    "Call",
    "ClassifyOptions",
    "CodeRule",
    "CompiledSchema",
    "ContextualCalibration",
    "Conversation",
    "Diagnostics",
    "Evaluation",
    "FieldCalibration",
    "FieldEvaluation",
    "FieldHead",
    "FieldResult",
    "GenerateOptions",
    "Generation",
    "GenerationChunk",
    "Grammar",
    "GreedyRule",
    "HiddenStates",
    "InputError",
    "LabelSuggestions",
    "Limits",
    "ModelIdentity",
    "ModelIntegrityError",
    "ModelLoadError",
    "OptionRule",
    "OutputType",
    "PCDEngine",
    "PCDError",
    "PCDResult",
    "Pipeline",
    "PlanOptions",
    "PrecisionCheckError",
    "PrefixCache",
    "RawPrompt",
    "Rule",
    "Sampling",
    "SchemaLimitError",
    "SchemaPlan",
    "SelfCheck",
    "ShortlistPolicy",
    "StructuredOutputError",
    "Suggestion",
    "TokenLogprob",
    "TokenizationError",
    "Tool",
    "ToolCallOptions",
    "ToolCallResult",
    "ToolCaller",
    "ToolChoice",
    "ToolPlanOptions",
    "Turn",
    "UnsupportedSchemaError",
    "__version__",
    "as_tools",
    "compile_schema",
    "create_manifest",
    "evaluate",
    "evaluate_each",
    "metrics",
    "new_call_id",
    "output_type",
    "read_manifest",
    "read_switches",
    "require_closed",
    "verify_manifest",
    "write_manifest",
]
__version__ = "0.1.0"
