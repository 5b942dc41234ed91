"""LangChain: `ChatMiniCPM`, a chat model whose structured output, tool calls and agents run the PCD
engine.

    chat_model.py  ChatMiniCPM: plain chat, bound tools and answer formats, with_structured_output
    structured.py  the with_structured_output runnable: parser, include_raw, one engine batch per batch
    tools.py       LangChain's tool forms -> the engine's; a tool decision -> AIMessage.tool_calls
    messages.py    LangChain's messages -> the engine's Conversation (the only reader of them)
"""

from minicpm_pcd_adapters.langchain.chat_model import ChatMiniCPM

__all__ = ["ChatMiniCPM"]
