"""LlamaIndex: `MiniCPMLLM` (a FunctionCallingLLM) and `MiniCPMPCDProgram` (a Pydantic program) on the
PCD engine.

    llm.py       MiniCPMLLM: chat, completion, function calling, structured predict
    program.py   MiniCPMPCDProgram: LlamaIndex's prompt templates answered by engine.classify
    tools.py     LlamaIndex tools -> the engine's; a decision -> ToolCallBlocks; a parser's schema found
    messages.py  LlamaIndex's chat messages -> the engine's Conversation (the only reader of them)
"""

from minicpm_pcd_adapters.llama_index.llm import MiniCPMLLM
from minicpm_pcd_adapters.llama_index.program import MiniCPMPCDProgram

__all__ = ["MiniCPMLLM", "MiniCPMPCDProgram"]
