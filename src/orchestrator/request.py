"""`Request`: the one typed request every API builds and the runtime takes.

Each HTTP API's schema turns itself into a `Request` (`to_request(req, defaults)` in
its module), and `Runtime.generate`/`stream` build one from their keywords; the
runtime only checks it against the model (`check_model`) and sends it. Defaults
merge once, here, in `Request.build`: what the caller gave, over the model's
defaults (`--temp`, `--max-tokens`, ...), over the API's own. Every check raises
`InvalidField` (a `ValueError`) naming the field as data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from ..ipc.protocol import ChatMessage, ChatOptions, Generate, InvalidField, Ready, SamplingParams
from .chat import CHAT_KEYWORDS, chat_messages, chat_options, missing_capability
from .structured import check_grammar, json_schema_grammar

Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]
#: The keywords `Request.build` takes beside the prompt: sampling, chat, and ``json_schema``.
KEYWORDS = (*SamplingParams.__struct_fields__, *CHAT_KEYWORDS, "json_schema")


@dataclass(slots=True)
class Request:
    """A checked request: its prompt (text, token ids or chat messages), sampling and chat options,
    and where it goes (`model`, None: the runtime's default) and how long its model stays loaded
    after it (`keep_alive` s, None: the runtime's default)."""

    params: SamplingParams
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    chat: ChatOptions | None = None
    model: str | None = None
    keep_alive: float | None = None

    @classmethod
    def build(cls, prompt: Prompt, given: Mapping[str, Any], *, defaults: Mapping[str, Any] | None = None,
              model: str | None = None, keep_alive: float | None = None) -> Request:
        """Validate `prompt` and the keywords `given` (over `defaults`, merged here and only here).

        ``json_schema`` (a schema object or its JSON text) is the short way to say
        ``grammar=Grammar(kind="json_schema", ...)``; either is checked here. An unknown keyword is
        a `TypeError` (a caller's bug); a bad value an `InvalidField` naming it.
        """
        params = {**(defaults or {}), **given}
        unknown = sorted(set(params) - set(KEYWORDS))
        if unknown:
            raise TypeError(f"unknown sampling parameter(s) {unknown}; known: "
                            f"{SamplingParams.__struct_fields__} and the chat keywords {CHAT_KEYWORDS}")
        if params.get("json_schema") is not None:
            params["grammar"] = json_schema_grammar(params["json_schema"])
        params.pop("json_schema", None)
        chat = chat_options(**{k: params.pop(k) for k in CHAT_KEYWORDS if k in params})
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]
        sp = _sampling(params).validate()
        if sp.grammar is not None:
            check_grammar(sp.grammar)
        req = cls(params=sp, model=model, keep_alive=keep_alive_seconds(keep_alive))
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidField("prompt", ": empty string")
            req.prompt = prompt
        elif not isinstance(prompt, Sequence) or not prompt:
            raise InvalidField("prompt", ": expected a non-empty str, list of token ids or list of messages")
        elif all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(t < 0 for t in prompt):  # type: ignore[operator]
                raise InvalidField("prompt", ": token ids must be >= 0")
            req.prompt_ids = list(prompt)  # type: ignore[arg-type]
        else:
            req.messages, req.chat = chat_messages(prompt), chat
            return req
        if chat is not None:  # no chat template: nothing for tools or thinking to act on
            raise InvalidField("prompt", ": tools, tool_choice and think need chat messages")
        return req

    def to_wire(self, req_id: int) -> Generate:
        """The `Generate` frame that carries this request to a worker as request `req_id`."""
        return Generate(id=req_id, params=self.params, prompt=self.prompt, prompt_ids=self.prompt_ids,
                        messages=self.messages, chat=self.chat)


def _sampling(params: dict[str, Any]) -> SamplingParams:
    """`params` as `SamplingParams`; a value of the wrong type is an `InvalidField` naming its key."""
    try:
        return msgspec.convert(params, SamplingParams)
    except msgspec.ValidationError as exc:
        for key, value in params.items():  # the field at fault, found by converting each alone
            try:
                msgspec.convert({key: value}, SamplingParams)
            except msgspec.ValidationError as one:
                raise InvalidField(key, f"={value!r}: {one}") from None
        raise InvalidField("params", f": {exc}") from None


def keep_alive_seconds(value: float | None) -> float | None:
    """`value` as seconds the model stays loaded after a request (None: the runtime's default)."""
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise InvalidField("keep_alive", f"={value!r}: seconds >= 0, or None for the runtime default")
    return float(value)


def build_request(req_id: int, prompt: Prompt, params: Mapping[str, Any]) -> Generate:
    """`Request.build` with no defaults, as the `Generate` frame for `req_id` (tests and tools that
    talk to a worker directly)."""
    return Request.build(prompt, params).to_wire(req_id)


def check_model(req: Request, ready: Ready | None, name: str) -> None:
    """`InvalidField` when `req` asks model `name` (as its worker reported itself in `ready`; None: no
    worker ready yet, the worker checks) for what it cannot do: generate from an embedding model,
    thinking or tools it lacks, a context beyond its own, sampling beyond its vocabulary."""
    if ready is None:
        return
    if ready.capabilities is not None and ready.capabilities.embedding:
        raise InvalidField("model", f": {name!r} is an embedding model: it cannot generate (ask it for "
                                    "embeddings)")
    with_images = next((i for i, m in enumerate(req.messages or ()) if m.images), None)
    if with_images is not None and not (ready.capabilities is not None and ready.capabilities.vision):
        raise InvalidField(f"messages[{with_images}]", f": model {name!r} is not a vision model: it takes no "
                                                       "images", code="unsupported", capability="vision")
    ctx = req.params.num_ctx
    if ctx is not None and ctx > ready.context_length:
        raise InvalidField("num_ctx", f"={ctx}: model {name!r} has a {ready.context_length}-token context")
    req.params.check_vocabulary(ready.vocab_size)
    if req.chat is None:
        return
    chat = req.chat
    missing = missing_capability(ready.capabilities, thinking=chat.wants_thinking, tools=bool(chat.tools),
                                 forced=chat.forces_call)
    if missing is not None:
        field = {"thinking": "think", "tools": "tools"}.get(missing, "tool_choice")
        raise InvalidField(field, f": model {name!r} does not support {missing}", code="unsupported",
                           capability=missing)
