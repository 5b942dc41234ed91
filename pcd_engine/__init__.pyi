"""The public names of pcd_engine, for type checkers and for `lazy_loader`, which imports each
one from its module on first use (see __init__.py)."""

from . import metrics
from .cache import PrefixCache
from .calibration import Calibration, FieldCalibration, ModelIdentity
from .conversation import ROLE_ALIASES, Call, Conversation, Turn, new_call_id
from .engine import DEFAULT_RULE, PCDEngine
from .errors import (
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
from .evaluation import Evaluation, FieldEvaluation, evaluate, evaluate_each
from .generate import Sampling
from .grammars import GRAMMAR_KINDS, Grammar
from .heads import FieldHead
from .hidden import HiddenStates
from .manifest import MANIFEST_NAME, create_manifest, read_manifest, verify_manifest, write_manifest
from .options import ClassifyOptions, GenerateOptions, PlanOptions, ToolCallOptions, ToolPlanOptions
from .output_types import OutputType, output_type, require_closed
from .pipeline import Pipeline
from .plan import SchemaPlan
from .precision import SelfCheck
from .prompt import LAYOUTS, TEXT_FRAMINGS, RawPrompt
from .results import (
    Diagnostics,
    FieldResult,
    Generation,
    GenerationChunk,
    PCDResult,
    TokenLogprob,
)
from .rules import RULES, CodeRule, ContextualCalibration, GreedyRule, OptionRule, Rule
from .schema import CompiledSchema, Limits, compile_schema
from .shortlist import ShortlistPolicy
from .suggestions import SUGGESTION_SHARE, LabelSuggestions, Suggestion
from .template_switches import read_switches
from .tool_calls import ToolCaller, ToolCallResult
from .tools import TOOL_CHOICES, Tool, ToolChoice, as_tools

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
__version__: str
