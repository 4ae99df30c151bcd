"""``mlxrt``: generate from the terminal and make synthetic models."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import structlog

from . import logs


def _cmd_generate(args: argparse.Namespace) -> int:
    from .orchestrator.errors import MlxrtError
    from .orchestrator.runtime import Runtime

    prompt = args.prompt if args.prompt != "-" else sys.stdin.read()
    prompt_arg: object = [{"role": "user", "content": prompt}] if args.chat or args.image else prompt
    if args.image:  # a vision model's images, in the user message (docs/vision.md)
        try:
            prompt_arg[0]["images"] = [Path(p).read_bytes() for p in args.image]  # type: ignore[index]
        except OSError as exc:
            print(f"mlxrt: error: --image: {exc}", file=sys.stderr)
            return 2
    params = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
    }
    try:
        group = _group(args)
        groups = {args.model: group} if group is not None else None
        with Runtime(model=args.model, transport=args.transport, engine=_engine_options(args),
                     groups=groups) as rt:
            stream = rt.stream(prompt_arg, **params)  # type: ignore[arg-type]
            for chunk in stream:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            if args.stats and stream.stats is not None:
                import msgspec

                print(json.dumps(msgspec.to_builtins(stream.stats)), file=sys.stderr)
    except (MlxrtError, ValueError) as exc:
        _error(exc)
        return 1
    return 0


def _error(exc: BaseException) -> None:
    """Print `exc` for a user at a terminal: a bad option named by its flag (--prompt-cache-dir)."""
    from .ipc.protocol import InvalidField

    flags = {name: f[0] for name, f in {**MODEL_FLAGS, **SAMPLING_FLAGS}.items()}
    if isinstance(exc, InvalidField) and (exc.field in flags or exc.field in ENGINE_FLAGS):
        message = exc.named(flags.get(exc.field, "--" + exc.field.replace("_", "-")))
    else:
        message = str(exc)
    print(f"mlxrt: error: {message}", file=sys.stderr)


def _cmd_make_model(args: argparse.Namespace) -> int:
    from .synthetic.build import make_model
    from .synthetic.presets import PRESETS

    if args.preset not in PRESETS:
        print(f"mlxrt: error: unknown preset {args.preset!r}; choose from {sorted(PRESETS)}", file=sys.stderr)
        return 2
    if args.noise or args.layers is not None:  # a draft variant: the preset (cached), then the copy
        from .synthetic.build import ensure_synthetic
        from .synthetic.presets import SyntheticRef
        from .synthetic.variants import make_variant

        base = ensure_synthetic(SyntheticRef(args.preset, args.seed, vocab=args.vocab_size))
        out = make_variant(base, args.out, noise=args.noise, layers=args.layers, seed=args.seed)
    else:
        out = make_model(args.preset, args.out, seed=args.seed, force=args.force, vocab_size=args.vocab_size)
    print(out)
    return 0


def _cmd_cache_prompt(args: argparse.Namespace) -> int:
    """Prefill a prompt in this process and save its KV cache (as mlx_lm.cache_prompt does)."""
    from .ipc.protocol import EngineOptions
    from .orchestrator.errors import MlxrtError
    from .orchestrator.options import ModelSpec, prepare

    names = ("adapter_path", "chat_template", "max_kv_size", "prefill_step_size")
    given = {f: getattr(args, f) for f in names if getattr(args, f) is not None}
    spec = ModelSpec(args.model, trust_remote_code=args.trust_remote_code, **given)
    try:
        target, opts = prepare("model", spec, EngineOptions())
        from .worker.engine import Engine
        from .worker.prompt_file import prompt_tokens, save_prompt_file

        engine = Engine(target, options=opts)
        pairs = (("prompt", args.prompt), ("system", args.system))
        text = {k: sys.stdin.read() if v == "-" else v for k, v in pairs if v is not None}
        ids = prompt_tokens(engine, **text)
        nbytes = save_prompt_file(engine, args.prompt_cache_file, ids)
    except (MlxrtError, ValueError, OSError) as exc:
        print(f"mlxrt: error: {exc}", file=sys.stderr)
        return 1
    print(f"{args.prompt_cache_file}: {len(ids)} tokens, {nbytes} bytes of KV cache")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import os

    from .orchestrator.errors import MlxrtError
    from .orchestrator.http import ServerConfig
    from .orchestrator.http.server import parse_model_specs, serve

    try:
        models = parse_model_specs(args.model)
    except ValueError as exc:
        print(f"mlxrt: error: {exc}", file=sys.stderr)
        return 2
    config = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("MLXRT_API_KEY") or None,
        max_body_bytes=args.max_body_bytes,
        responses_store=args.responses_store,
        allow_image_urls=args.allow_image_urls,
    )
    try:
        serve(models, config=config, workers=args.workers, transport=args.transport,
              log_level=args.log_level, engine=_engine_options(args), spares=args.spares,
              group=_group(args))
    except (MlxrtError, ValueError) as exc:
        _error(exc)
        return 1
    return 0


def _engine_options(args: argparse.Namespace):
    """The engine and model flags as `EngineOptions`, each unset one from its MLXRT_* variable or
    default. Checked here; paths and the draft model are checked when the runtime starts."""
    import msgspec

    from .orchestrator.config import engine_from_env

    base = engine_from_env()
    names = (*ENGINE_FLAGS, *MODEL_FLAGS, *(SAMPLING_FLAGS if args.command == "serve" else ()))
    given = {f: getattr(args, f) for f in names if getattr(args, f, None) is not None}
    if getattr(args, "trust_remote_code", False):
        given["trust_remote_code"] = True
    if args.command == "serve" and base.prompt_cache_dir is None and "prompt_cache_dir" not in given:
        given["prompt_cache_dir"] = _default_disk_dir()  # a server keeps its prefixes
    return msgspec.structs.replace(base, **given).validate()


def _default_disk_dir() -> str | None:
    """serve's default disk tier directory; None (the tier off, with a warning) where it cannot be
    written: a read-only home must not stop a server that was never asked for one."""
    from .ipc.protocol import InvalidField
    from .orchestrator.options import writable_dir

    try:
        return writable_dir(default_disk_cache_dir(), "prompt_cache_dir")
    except InvalidField as exc:
        structlog.get_logger("mlxrt.cli").warning("disk_cache.off", reason=str(exc),
                                                  hint="give --prompt-cache-dir DIR to keep prefixes on disk")
        return None


#: Where `mlxrt serve` keeps the prefix cache's disk tier unless told (--prompt-cache-dir), under the
#: user's cache directory ($XDG_CACHE_HOME, else ~/.cache).
DEFAULT_DISK_CACHE_DIR = "$XDG_CACHE_HOME/mlxrt/prompt-cache"


def default_disk_cache_dir() -> str:
    """`DEFAULT_DISK_CACHE_DIR` for this user, as a path."""
    return os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME") or "~/.cache"), "mlxrt",
                        "prompt-cache")

#: mlx_lm.server's flags for the same knobs, with the same names; embed_batch_tokens, gather_ms, burst_ms,
#: prefill_budget_ms, prompt_cache_disk_bytes and prompt_cache_warm_bytes are mlxrt's own.
ENGINE_FLAGS = {
    "decode_concurrency": "most sequences decoded together per worker",
    "prompt_concurrency": "most prompts prefilled together per worker (auto: as many as decode_concurrency "
                          "under the prefill budget, else 8)",
    "prefill_step_size": "prompt tokens per prefill step",
    "prefill_budget_ms": "ms of prefill between two decode steps: a long prompt is prefilled in chunks "
                         "sized to it on this machine, at most prefill_step_size tokens (0: mlx-lm's own "
                         "prefill; auto: 200; mlxrt's own)",
    "prompt_cache_bytes": "byte cap of each worker's prompt-prefix cache (0: no reuse; auto: an eighth of "
                          "the memory MLX may use, 1-64 GiB)",
    "embed_batch_tokens": "an embedding model's padded tokens per forward pass (mlxrt's own)",
    "gather_ms": "after several replies end together, ms to hold new requests back so that their "
                 "prefills go together (0: admit at once; mlxrt's own)",
    "burst_ms": "on an idle worker, ms with no new request before those queued are admitted, so that a "
                "burst's prefills go together (at most the larger of it and gather_ms from the first; 0: "
                "admit at once; auto: 2 on CUDA, else 0; mlxrt's own)",
    "prompt_cache_disk_bytes": "byte budget of the prefix cache's disk tier under --prompt-cache-dir "
                               "(0: no disk tier; mlxrt's own)",
    "prompt_cache_warm_bytes": "bytes of the disk tier's newest entries a started worker reads back into "
                               "memory while idle (0: none; auto: half of prompt_cache_bytes; mlxrt's own)",
}

#: Per-model options (docs/options.md), with mlx_lm.server's and mlx_lm.generate's flag names:
#: field -> (flag, type, help). They apply to every --model given.
MODEL_FLAGS = {
    "draft_model": ("--draft-model", str, "a draft model for speculative decoding (a directory, HF id or "
                    "synthetic:PRESET?noise=X): a lone request drafts with it, a batch decodes plainly"),
    "num_draft_tokens": ("--num-draft-tokens", int, "tokens drafted per speculative step (default: 3)"),
    "draft_policy": ("--draft-policy", str, "adaptive: draft only while drafting is measured faster than "
                     "plain decoding; always: draft every step, as mlx_lm does (default: adaptive)"),
    "kv_bits": ("--kv-bits", int, "quantize a lone request's KV cache to this many bits (2, 3, 4, 5, "
                "6 or 8); a batch keeps full precision (default: none)"),
    "kv_group_size": ("--kv-group-size", int, "group size of KV-cache quantization (default: 64)"),
    "quantized_kv_start": ("--quantized-kv-start", int,
                           "quantize the KV cache once it holds this many tokens (default: 5000)"),
    "max_kv_size": ("--max-kv-size", int, "a rotating KV cache of at most this many tokens per sequence: "
                    "memory stays flat, older tokens are forgotten (default: unbounded)"),
    "adapter_path": ("--adapter-path", str, "a LoRA adapter directory (adapter_config.json, "
                     "adapters.safetensors)"),
    "chat_template": ("--chat-template", str, "a chat template, as Jinja text or a file, in place of the "
                      "tokenizer's"),
    "context_length": ("--context-length", int, "the default context in tokens, prompt and reply, as "
                       "Ollama's num_ctx (default: the model's)"),
    "prompt_cache_file": ("--prompt-cache-file", str, "a KV-cache file from 'mlxrt cache-prompt', loaded "
                          "into each worker's prefix cache at start"),
    "prompt_cache_dir": ("--prompt-cache-dir", str, "the prefix cache's disk tier: prefixes kept here "
                         "outlive eviction, restarts and crashes (serve's default: "
                         f"{DEFAULT_DISK_CACHE_DIR}; generate: none)"),
}
#: Default sampling for requests that leave it out (mlx_lm.server's --temp, ...): serve only.
SAMPLING_FLAGS = {
    "temperature": ("--temp", float, "default sampling temperature (default: each API's own)"),
    "top_p": ("--top-p", float, "default nucleus sampling top-p"),
    "top_k": ("--top-k", int, "default top-k (0 disables)"),
    "min_p": ("--min-p", float, "default min-p"),
    "max_tokens": ("--max-tokens", int, "default most tokens to generate (default: 512 as mlx_lm.server's; "
                   "completions: 16, as OpenAI's)"),
}


def _shown(default: object) -> object:
    return "auto" if default is None else default


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    from .ipc.protocol import EngineOptions

    defaults = EngineOptions()
    for name, what in ENGINE_FLAGS.items():
        env = "MLXRT_" + name.upper()
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help=f"{what} (default: ${env} or {_shown(getattr(defaults, name))})")
    group = p.add_argument_group("model options (each --model; docs/options.md)")
    for name, (flag, kind, what) in MODEL_FLAGS.items():
        group.add_argument(flag, dest=name, type=kind, default=None, help=what)
    group.add_argument("--trust-remote-code", action="store_true",
                       help="let the tokenizer run code shipped with the model")


def _add_sampling_defaults(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("default sampling (requests that leave it out)")
    for name, (flag, kind, what) in SAMPLING_FLAGS.items():
        group.add_argument(flag, dest=name, type=kind, default=None, help=what)


def _group(args: argparse.Namespace):
    """The worker-group flags as a `Group`, or None when none is given (one process per worker)."""
    from .orchestrator.launch import Group

    sharding = "pipeline" if args.pipeline else args.sharding
    group = Group(ranks=args.ranks, backend=args.backend, hosts=args.hosts, sharding=sharding,
                  port=args.starting_port, python=args.python)
    return None if group == Group() else group


def _add_group_flags(p: argparse.ArgumentParser) -> None:
    """`mlx.launch`'s and `mlx_lm.server`'s names for the same knobs (docs/distributed.md)."""
    from .ipc.protocol import GROUP_BACKENDS, SHARDINGS

    g = p.add_argument_group("worker groups", "a worker made of several MLX processes (mx.distributed)")
    g.add_argument("--ranks", type=int, default=None,
                   help="processes per worker (default: the host file's hosts, else 1)")
    g.add_argument("--backend", choices=GROUP_BACKENDS, default="auto",
                   help="MLX's distributed backend (default: nccl with CUDA, else ring; as mlx.launch)")
    g.add_argument("--hosts", "--hostfile", dest="hosts", default=None,
                   help="mlx.launch's JSON host file, this machine first (default: every rank here)")
    g.add_argument("--sharding", choices=SHARDINGS, default="auto",
                   help="tensor or pipeline parallel (default: tensor where the model has it, else pipeline)")
    g.add_argument("--pipeline", action="store_true", help="same as --sharding pipeline (mlx_lm.server)")
    g.add_argument("--starting-port", type=int, default=None,
                   help="first port the ranks listen on (mlx.launch; default: free ports)")
    g.add_argument("--python", default=None,
                   help="the interpreter on other hosts (mlx.launch; default: this one's path)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxrt", description=__doc__)
    parser.add_argument("--log-level", default="warning", help="structlog level (default: warning)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream a completion to the terminal")
    gen.add_argument("prompt", help="the prompt text, or - to read it from stdin")
    gen.add_argument("--model", "-m", required=True, help="model directory, HF id or synthetic:PRESET")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--image", action="append", default=None, metavar="PATH",
                     help="an image file for a vision model (repeat for several; implies --chat)")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", "--temp", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--transport", choices=["auto", "ring", "stdio"], default="auto")
    gen.add_argument("--stats", action="store_true", help="print the request's stats as JSON on stderr")
    _add_engine_flags(gen)
    _add_group_flags(gen)
    gen.set_defaults(func=_cmd_generate)

    from .orchestrator.http.config import (
        DEFAULT_HOST,
        DEFAULT_MAX_BODY_BYTES,
        DEFAULT_PORT,
        DEFAULT_RESPONSES_STORE,
    )

    srv = sub.add_parser("serve", help="serve OpenAI-, Ollama- and Anthropic-compatible HTTP APIs "
                                        "(docs/http.md)")
    srv.add_argument("--model", "-m", action="append", required=True,
                     help="name=path, or a bare path (named by its directory name); repeat for several")
    srv.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default: {DEFAULT_HOST})")
    srv.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default: {DEFAULT_PORT}")
    srv.add_argument("--workers", type=int, default=1, help="worker processes per model")
    srv.add_argument("--spares", type=int, default=0,
                     help="hot spares per model: loaded standby workers that take a crashed worker's "
                          "place at once (default: 0; each holds the model in memory)")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
                                        "(default: $MLXRT_API_KEY)")
    srv.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                     help="larger request bodies get 413")
    srv.add_argument("--responses-store", type=int, default=DEFAULT_RESPONSES_STORE, metavar="N",
                     help="keep the last N Responses-API responses in memory for previous_response_id "
                          f"and GET /v1/responses/ID (default: {DEFAULT_RESPONSES_STORE}; 0 keeps none)")
    srv.add_argument("--allow-image-urls", action="store_true",
                     help="fetch the http(s) image URLs requests carry (off: such an image is a 400; on, a "
                          "client can make this server fetch any URL it can reach: docs/vision.md)")
    srv.add_argument("--transport", choices=["auto", "ring", "stdio"], default="auto")
    _add_engine_flags(srv)
    _add_sampling_defaults(srv)
    _add_group_flags(srv)
    srv.set_defaults(func=_cmd_serve)

    cp = sub.add_parser("cache-prompt", help="save a prompt's KV cache for --prompt-cache-file "
                        "(as mlx_lm.cache_prompt)")
    cp.add_argument("--model", "-m", required=True, help="model directory, HF id or synthetic:PRESET")
    what = cp.add_mutually_exclusive_group(required=True)
    what.add_argument("--system", help="a chat system prompt: cache what every chat with it begins with "
                      "('-' reads stdin)")
    what.add_argument("--prompt", help="raw text: cache its tokens ('-' reads stdin)")
    cp.add_argument("--prompt-cache-file", required=True, help="the .safetensors file to write")
    for name in ("adapter_path", "chat_template", "max_kv_size"):
        flag, kind, what_help = MODEL_FLAGS[name]
        cp.add_argument(flag, dest=name, type=kind, default=None, help=f"{what_help} (as the server will)")
    cp.add_argument("--prefill-step-size", type=int, default=None, help="prompt tokens per prefill step")
    cp.add_argument("--trust-remote-code", action="store_true")
    cp.set_defaults(func=_cmd_cache_prompt)

    mk = sub.add_parser("make-model", help="write a synthetic mlx-lm model directory")
    mk.add_argument("preset", help="tiny, small, tiny-llama, tiny-qwen3, tiny-qwen3-moe, tiny-qwen3.5, "
                    "tiny-gemma3, tiny-gpt-oss, the vision models tiny-qwen2.5-vl and tiny-gemma3-vl, "
                    "or a 4-bit real shape such as qwen3-8b-4bit "
                    "(all presets: docs/models.md)")
    mk.add_argument("--out", required=True, help="directory to write")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--force", action="store_true", help="rewrite even if the directory is current")
    mk.add_argument("--noise", type=float, default=0.0,
                    help="a draft variant: every weight times 1 + NOISE * N(0, 1) (docs/options.md)")
    mk.add_argument("--layers", type=int, default=None, help="a draft variant: keep the first LAYERS layers")
    mk.add_argument("--vocab-size", type=int, default=None,
                    help="another vocabulary size, so the tokenizer of the family's presets of that size")
    mk.set_defaults(func=_cmd_make_model)

    from .soak import add_parser as add_soak_parser

    add_soak_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(level=args.log_level)
    structlog.get_logger("mlxrt.cli").debug("cli.start", command=args.command)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
