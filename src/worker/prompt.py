"""A request's prompt for one model: its chat template, its context, and what the model can do.

`capabilities` reads from the tokenizer what may be asked of the model (thinking, its
off switch, tool calls; sent to the orchestrator in `Ready`) and `check_request`
refuses the rest. `PromptBuilder`, a part of `Engine`, turns a request into token ids
(text as is, ids as given, chat messages through the chat template), checks them
against the request's context, and finds where a chat's system prompt and the part
its next turn repeats end, for the prefix cache. `reply.py` splits the reply.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from ..ipc.protocol import (
    FORCED_TOOL_FORMATS,
    Capabilities,
    ChatMessage,
    ChatOptions,
    EngineOptions,
    Generate,
    InvalidField,
)

DEFAULT_CONTEXT_LENGTH = 4096
#: System prompts whose templated tokens are remembered (a chat's every turn repeats its own).
MAX_TEMPLATE_HEADS = 32
#: How far back from a prompt's end a template's opened `<think>` is looked for (as mlx_lm.server does).
THINK_TAIL_TOKENS = 11
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
#: Llama 3.x's tool format: its name in `Capabilities.tools`, the tag that may open a call.
LLAMA3_JSON = "llama3_json"
PYTHON_TAG = "<|python_tag|>"
#: The call format Meta's Llama 3.1/3.2/3.3 templates ask for, in their instruction:
#: 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}'.
_LLAMA3_CALL_FORMAT = re.compile(r'\{\s*"name"\s*:[^{}]*"parameters"\s*:')


class PromptTooLongError(ValueError):
    """The prompt does not fit in the model's context."""


class NoChatTemplateError(ValueError):
    """Chat messages were sent to a model whose tokenizer has no chat template."""


def is_harmony(tokenizer) -> bool:
    """gpt-oss's harmony format: its tokens in the vocabulary and its channels in the chat template."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    vocab = tokenizer.get_vocab()
    return all(t in vocab for t in HARMONY_TOKENS) and "<|channel|>" in template


def is_llama3_json(tokenizer) -> bool:
    """Llama 3.1+'s bare-JSON calls: ``<|python_tag|>`` in the vocabulary (Llama 3.0 has none) and the
    template asking for ``{"name": ..., "parameters": ...}`` (quotes escaped or not)."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    unescaped = template.replace('\\"', '"')  # a template written with double-quoted Jinja strings
    return PYTHON_TAG in tokenizer.get_vocab() and bool(_LLAMA3_CALL_FORMAT.search(unescaped))


def capabilities(tokenizer) -> Capabilities:
    """What the orchestrator may ask of this model: thinking, its off switch, tool calls."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    if is_harmony(tokenizer):
        thinking, tools = "harmony", "harmony"
    else:
        thinking = "think" if tokenizer.has_thinking else ""
        parser = tokenizer.tool_parser
        tools = parser.__module__.rsplit(".", 1)[-1] if tokenizer.has_tool_calling and parser else ""
        if not tools and not thinking and is_llama3_json(tokenizer):
            tools = LLAMA3_JSON
    return Capabilities(
        chat_template=bool(tokenizer.has_chat_template),
        thinking=thinking,
        thinking_switch="enable_thinking" in template,
        tools=tools,
    )


def template_kwargs(chat: ChatOptions | None) -> dict[str, Any]:
    """The chat template's keyword arguments: only what was asked, so defaults stay the template's."""
    if chat is None:
        return {}
    kw: dict[str, Any] = {}
    if chat.tools:
        kw["tools"] = chat.tools
    if chat.enable_thinking is not None:
        kw["enable_thinking"] = chat.enable_thinking
    if chat.reasoning_effort is not None:
        kw["reasoning_effort"] = chat.reasoning_effort
    return kw


def check_request(chat: ChatOptions | None, caps: Capabilities, model: str) -> None:
    """Refuse what the model cannot do (the orchestrator checks first when it knows the capabilities)."""
    if chat is None:
        return
    if chat.wants_thinking and not caps.thinking:
        raise InvalidField("think", f": model {model} does not support thinking", code="unsupported",
                           capability="thinking")
    if chat.tools and not caps.tools:
        raise InvalidField("tools", f": model {model} does not support tools (mlx-lm has no tool-call parser "
                                    "for it)", code="unsupported", capability="tools")
    if chat.forces_call and caps.tools not in FORCED_TOOL_FORMATS:
        raise InvalidField("tool_choice", f": model {model} cannot be forced to call a tool: its tool format "
                           f"{caps.tools!r} has no grammar (forced: {list(FORCED_TOOL_FORMATS)})",
                           code="unsupported", capability="forced tool calls")


def reasoning_open(tokenizer, caps: Capabilities, prompt: list[int]) -> bool:
    """Whether the template opened ``<think>`` in the prompt (Qwen3.5, QwQ, ...): the reply starts in
    its reasoning, as `mlx_lm.server` detects."""
    if caps.thinking != "think":
        return False
    return tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt)


def template_message(m: ChatMessage) -> dict:
    """A message as chat templates read it: OpenAI's shape, arguments as objects (as mlx_lm.server
    passes them), reasoning as both `reasoning_content` (Qwen) and `thinking` (gpt-oss)."""
    out: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": _json_or_text(c.arguments)}}
            for c in m.tool_calls
        ]
    if m.reasoning is not None:
        out["reasoning_content"] = out["thinking"] = m.reasoning
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class PromptBuilder:
    """How a request becomes the token ids its model is prompted with, within its context.

    Part of `Engine` (a base class), whose loaded model it reads: the attributes below.
    """

    tokenizer: Any  # mlx-lm's TokenizerWrapper
    path: str
    options: EngineOptions
    vocab_size: int
    #: The model's own context (max_position_embeddings) and a request's default, tokens.
    model_context: int
    context_length: int
    trimmable: bool  # every layer's cache can be trimmed: any shared prefix is reused
    capabilities: Capabilities
    _heads: dict[tuple, list[int]]  # system messages, chat options -> templated tokens

    def _default_context(self, requested: int | None) -> int:
        if requested is None:
            return self.model_context
        if requested > self.model_context:
            raise ValueError(f"invalid context_length={requested}: the model's context is "
                             f"{self.model_context} tokens (max_position_embeddings)")
        return requested

    def _check_template(self) -> None:
        """The overriding chat template must render a chat with this tokenizer."""
        try:
            self._apply_template([ChatMessage("system", "s"), ChatMessage("user", "u")], None,
                                 add_generation_prompt=True)
        except Exception as exc:
            raise ValueError(f"invalid chat_template: it does not render a chat: {exc}") from None

    def prompt_ids(self, req: Generate) -> list[int]:
        """The request's prompt as token ids: text as is, ids as given, messages templated."""
        if req.prompt_ids is not None:
            ids = list(req.prompt_ids)
            bad = [t for t in ids if not 0 <= t < self.vocab_size] if self.vocab_size else []
            if bad:
                raise ValueError(f"prompt_ids contains ids outside [0, {self.vocab_size}): {bad[:5]}")
        elif req.messages is not None:
            if not self.capabilities.vision and any(m.images for m in req.messages):
                raise InvalidField("images", f": model {self.path} is not a vision model: it takes no images",
                                   code="unsupported", capability="vision")
            ids = list(self._apply_template(req.messages, req.chat, add_generation_prompt=True))
        elif req.prompt is not None:
            tok = self.tokenizer
            # Same rule as mlx_lm.stream_generate, so raw prompts tokenize identically.
            special = tok.bos_token is None or not req.prompt.startswith(tok.bos_token)
            ids = tok.encode(req.prompt, add_special_tokens=special)
        else:
            raise ValueError("request has no prompt, prompt_ids or messages")
        if not ids:
            raise ValueError("prompt is empty")
        ctx = self.request_context(req)
        if len(ids) >= ctx:
            raise PromptTooLongError(f"prompt has {len(ids)} tokens; the context is {ctx} tokens "
                                     f"({self._context_source(req)})")
        return ids

    def request_context(self, req: Generate) -> int:
        """The request's context in tokens, prompt and reply: its num_ctx, else the model's default."""
        ctx = req.params.num_ctx
        if ctx is None:
            return self.context_length
        if ctx > self.model_context:
            raise ValueError(f"invalid num_ctx={ctx}: the model's context is {self.model_context} tokens")
        return ctx

    def _context_source(self, req: Generate) -> str:
        if req.params.num_ctx is not None:
            return "num_ctx"
        return "context_length" if self.options.context_length is not None else "max_position_embeddings"

    def _apply_template(self, messages, chat, **kwargs) -> list[int]:
        if not self.tokenizer.has_chat_template:
            raise NoChatTemplateError(f"model {self.path} has no chat template")
        return self.tokenizer.apply_chat_template(
            [template_message(m) for m in messages], **template_kwargs(chat), **kwargs
        )

    def system_end(self, req: Generate, ids: list[int]) -> int:
        """Where the chat's leading system messages end in `ids` (0: none, or not a chat)."""
        messages = req.messages or []
        n = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
        if n == 0 or n == len(messages):
            return 0
        head = self._template_head(messages[:n], req.chat)
        pairs = enumerate(zip(head, ids, strict=False))
        end = next((i for i, (a, b) in pairs if a != b), min(len(head), len(ids)))
        return end if 0 < end < len(ids) - 1 else 0

    def _turn_end(self, req: Generate, ids: list[int]) -> int:
        """Where the chat's next turn stops repeating `ids`, when that is before their last token (0: not).

        A thinking template (Qwen3.5; Qwen3.x with thinking off) ends its generation prompt with a
        ``<think>`` that it does not render for the same reply in a later turn, so a checkpoint at the
        prompt's end would never be found again: the "user" checkpoint goes before that tail. Only
        for caches that cannot be trimmed; a trimmable one is cut back to any shared prefix.
        """
        if self.trimmable or not req.messages or self.capabilities.thinking != "think":
            return 0
        start = self.tokenizer.rfind_think_start(ids, start=len(ids) - THINK_TAIL_TOKENS)
        return start if 0 < start < len(ids) - 1 else 0

    def _template_head(self, system: list[ChatMessage], chat) -> list[int]:
        """The template's tokens for these system messages and an empty user turn (memoised).

        Keyed by the messages and the chat options too: templates render tools into the system turn.
        """
        key = (msgspec.msgpack.encode(system), msgspec.msgpack.encode(chat))
        head = self._heads.get(key)
        if head is None:
            head = self._apply_template([*system, ChatMessage("user", "")], chat, add_generation_prompt=False)
            if len(self._heads) >= MAX_TEMPLATE_HEADS:
                self._heads.pop(next(iter(self._heads)))
            self._heads[key] = head
        return head
