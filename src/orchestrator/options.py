"""Per-model options, checked at the edge before any worker starts.

`ModelSpec` names a model and how to run it; `prepare` turns it into what a
worker is sent: the model reference resolved (`models.resolve_model`) and an
`EngineOptions` whose paths are resolved, whose chat template is the template's
text (read from its file if a file was named) and which is known to be
consistent: the adapter directory holds an adapter, the chat template renders,
the draft model's vocabulary is the target's, the context fits the model, the
KV group size divides the model's head size. What can only be known once the
model is loaded (an adapter whose shapes do not fit, a draft whose tokenizer
differs) the worker checks at load, and a worker that fails to load is
stopped before the error reaches the caller.

No MLX here: model facts come from the model directory's config.json, or from
the synthetic preset's config for ``synthetic:`` references.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from ..ipc.protocol import EngineOptions, InvalidField
from ..synthetic.presets import parse_synthetic, synthetic_preset
from .errors import ModelLoadError
from .models import SYNTHETIC_PREFIX, resolve_model

#: The conversation a chat template must render at the edge: every role a chat request can carry.
PROBE_CONVERSATION = [
    {"role": "system", "content": "You are a test."},
    {"role": "user", "content": "Hello?"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Bye?"},
]
#: Files an adapter directory must hold (mlx-lm's `load_adapters` reads both).
ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")


@dataclass(frozen=True, init=False)
class ModelSpec:
    """A model to serve and how to run it.

    ``ModelSpec("synthetic:small", draft_model="synthetic:small?noise=0.02", kv_bits=8)``: `path` is a
    model directory, a Hugging Face id or ``synthetic:PRESET``; `options` an `EngineOptions` (None: the
    runtime's ``engine``); keywords override single fields of it (`EngineOptions`' names).
    """

    path: str
    options: EngineOptions | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def __init__(self, path: str, options: EngineOptions | None = None, **overrides: Any) -> None:
        unknown = sorted(set(overrides) - set(EngineOptions.__struct_fields__))
        if unknown:
            raise TypeError(f"unknown model option(s) {unknown}; known: {EngineOptions.__struct_fields__}")
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "overrides", dict(overrides))

    def engine_options(self, base: EngineOptions) -> EngineOptions:
        """This model's options: `options` (else `base`) with the overrides applied, validated."""
        opts = self.options or base
        try:
            return msgspec.structs.replace(opts, **self.overrides).validate()
        except TypeError as exc:  # a wrong type for a field, caught at the edge like a wrong value
            raise ValueError(f"invalid model option: {exc}") from None


def as_spec(model: str | ModelSpec) -> ModelSpec:
    return model if isinstance(model, ModelSpec) else ModelSpec(model)


def prepare(name: str, spec: ModelSpec, base: EngineOptions) -> tuple[str, EngineOptions]:
    """What a worker of model `name` loads and the options it is sent; `ValueError` (a bad option,
    naming it) or `ModelNotFoundError`/`ModelLoadError` (a path) before any process starts."""
    opts = spec.engine_options(base)
    target = resolve_model(spec.path)
    config = model_config(target)
    changes: dict[str, Any] = {}
    if opts.draft_model is not None:
        changes["draft_model"] = draft = resolve_model(opts.draft_model)
        _check_draft(target, draft, config, model_config(draft))
    if opts.adapter_path is not None:
        changes["adapter_path"] = _adapter_dir(opts.adapter_path)
    if opts.chat_template is not None:
        changes["chat_template"] = template = read_chat_template(opts.chat_template)
        check_chat_template(template)
    if opts.prompt_cache_file is not None:
        changes["prompt_cache_file"] = _file(opts.prompt_cache_file, "prompt_cache_file")
    if opts.prompt_cache_dir is not None and opts.prompt_cache_disk_bytes:
        changes["prompt_cache_dir"] = writable_dir(opts.prompt_cache_dir, "prompt_cache_dir")
    _check_model_fit(opts, config, name)
    return target, msgspec.structs.replace(opts, **changes)


def model_config(ref: str) -> dict[str, Any] | None:
    """The language model's config (a multimodal config's ``text_config`` merged in), if readable here."""
    if ref.startswith(SYNTHETIC_PREFIX):
        config = _synthetic_config(ref[len(SYNTHETIC_PREFIX):])
    else:
        try:
            config = json.loads((Path(ref) / "config.json").read_text())
        except (OSError, ValueError):
            return None  # an HF id not downloaded yet: the worker checks once it has the model
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    return {**text, **config} if isinstance(text, dict) else config


def _synthetic_config(name: str) -> dict[str, Any] | None:
    try:
        return synthetic_preset(parse_synthetic(name)).config()
    except KeyError:
        return None  # an unknown preset: the worker names the choices


def tokenizer_key(ref: str) -> object | None:
    """What identifies `ref`'s tokenizer (its ids for every token), if it can be read here: a
    synthetic preset's tokenizer recipe, or a directory's tokenizer.json vocabulary and added tokens.
    Keys of the two kinds do not compare (the first element says which)."""
    if ref.startswith(SYNTHETIC_PREFIX):
        try:
            return "synthetic", synthetic_preset(parse_synthetic(ref[len(SYNTHETIC_PREFIX):])).tokenizer_key
        except KeyError:
            return None
    try:
        data = json.loads((Path(ref) / "tokenizer.json").read_text(encoding="utf-8"))
        vocab = data["model"]["vocab"]
        added = sorted((t["id"], t["content"]) for t in data.get("added_tokens", []))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return "tokenizer.json", vocab, added


def _check_draft(target: str, draft: str, target_cfg, draft_cfg) -> None:
    """A draft must tokenize as the target does (its token ids are compared with the target's), and
    its ids must be ids of the target's embedding."""
    tk, dk = tokenizer_key(target), tokenizer_key(draft)
    if tk is not None and dk is not None and tk[0] == dk[0] and tk != dk:
        raise ValueError(f"invalid draft_model={draft!r}: its tokenizer is not the target's ({target}); "
                         f"a draft must share the target's vocabulary{_sizes(target_cfg, draft_cfg)}")
    tv = (target_cfg or {}).get("vocab_size")
    dv = (draft_cfg or {}).get("vocab_size")
    if tv and dv and dv > tv:
        raise ValueError(f"invalid draft_model={draft!r}: it scores {dv} token ids, more than the "
                         f"target's {tv}")


def _sizes(target_cfg, draft_cfg) -> str:
    tv, dv = (target_cfg or {}).get("vocab_size"), (draft_cfg or {}).get("vocab_size")
    return f" (the draft's has {dv} tokens, the target's {tv})" if tv and dv and tv != dv else ""


def _check_model_fit(opts: EngineOptions, config: dict[str, Any] | None, name: str) -> None:
    if config is None:
        return
    ctx = config.get("max_position_embeddings")
    if opts.context_length is not None and ctx and opts.context_length > ctx:
        raise ValueError(f"invalid context_length={opts.context_length}: model {name!r} has a "
                         f"{ctx}-token context (max_position_embeddings)")
    if opts.kv_bits is not None:
        head = config.get("head_dim") or _div(config.get("hidden_size"), config.get("num_attention_heads"))
        if head and head % opts.kv_group_size:
            raise ValueError(f"invalid kv_group_size={opts.kv_group_size}: must divide model {name!r}'s "
                             f"head size, {head} (kv_bits quantizes each head's keys and values in groups)")


def _div(a: Any, b: Any) -> int | None:
    return a // b if isinstance(a, int) and isinstance(b, int) and b else None


def _adapter_dir(value: str) -> str:
    path = Path(value).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"invalid adapter_path={value!r}: no such directory")
    missing = [f for f in ADAPTER_FILES if not (path / f).is_file()]
    if missing:
        raise ModelLoadError(f"invalid adapter_path={value!r}: not an adapter directory (no {missing[0]})")
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except ValueError as exc:
        raise ModelLoadError(f"invalid adapter_path={value!r}: adapter_config.json is not JSON: {exc}") \
            from None
    if not isinstance(config, dict) or (config.get("fine_tune_type", "lora") != "full"
                                        and not isinstance(config.get("lora_parameters"), dict)):
        raise ModelLoadError(f"invalid adapter_path={value!r}: adapter_config.json has no lora_parameters")
    return str(path.resolve())


def _file(value: str, name: str) -> str:
    path = Path(value).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"invalid {name}={value!r}: no such file")
    return str(path.resolve())


def writable_dir(value: str, name: str) -> str:
    """`value` as an absolute directory this process can write (made if missing); `InvalidField`
    naming `name` if it is a file or cannot be written."""
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise InvalidField(name, f"={value!r}: a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".mlxrt-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise InvalidField(name, f"={value!r}: cannot write there ({exc.strerror or exc})") from None
    return str(path.resolve())


def read_chat_template(value: str) -> str:
    """The template's text: the file `value` names, else `value` itself if it is Jinja."""
    try:
        path = Path(value).expanduser()
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, ValueError):  # too long for a file name, or a NUL in it: text
        pass
    if "{{" not in value and "{%" not in value:
        raise ValueError(f"invalid chat_template={value[:80]!r}: neither a file nor a Jinja template")
    return value


def check_chat_template(template: str) -> None:
    """`ValueError` if `template` does not render a short chat (as Hugging Face renders templates:
    a sandboxed Jinja environment with ``raise_exception`` and ``tojson``)."""
    try:
        text = render_chat_template(template, PROBE_CONVERSATION, add_generation_prompt=True)
    except Exception as exc:
        raise ValueError(f"invalid chat_template: it does not render a chat: {type(exc).__name__}: {exc}") \
            from None
    if not text.strip():
        raise ValueError("invalid chat_template: it renders a chat as empty text")


def render_chat_template(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    from jinja2 import ext
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: "01 Jan 2025"
    return env.from_string(template).render(messages=messages, bos_token="", eos_token="", **kwargs)
