"""Per-model options: one record from every front door, checked at the edge before any worker starts."""

from __future__ import annotations

import json
import shutil

import msgspec
import pytest
from mlxrt import ModelLoadError, ModelSpec, Runtime
from mlxrt.cli import build_parser
from mlxrt.ipc.protocol import EngineOptions
from mlxrt.orchestrator.http.schemas import ChatCompletionRequest


@pytest.fixture(scope="module")
def small_model() -> str:
    from mlxrt.synthetic.build import ensure_model

    return str(ensure_model("small"))


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test if a worker process is started."""
    from mlxrt.orchestrator.handle import WorkerHandle

    def refuse(*args, **kwargs):
        raise AssertionError("a worker was started for options the edge should have refused")

    monkeypatch.setattr(WorkerHandle, "_spawn", refuse)


@pytest.fixture(scope="module")
def tiny_adapter(tiny_model, tmp_path_factory) -> str:
    from mlxrt.synthetic.variants import make_adapter

    return str(make_adapter(tiny_model, tmp_path_factory.mktemp("adapter") / "tiny-lora"))


BAD_OPTIONS = {
    "kv-bits-7": ({"kv_bits": 7}, ValueError, r"invalid kv_bits=7: must be one of \(2, 3, 4, 5, 6, 8\)"),
    "kv-group-48": ({"kv_bits": 8, "kv_group_size": 48}, ValueError, "invalid kv_group_size=48"),
    "kv-bits-rotating": ({"kv_bits": 4, "max_kv_size": 64}, ValueError, "cannot quantize a rotating cache"),
    "kv-bits-no-fast-path": ({"kv_bits": 4, "single_stream": False}, ValueError, "needs single_stream"),
    "kv-group-head": ({"kv_bits": 8, "kv_group_size": 32}, ValueError, "must divide model .* head size, 16"),
    "max-kv-size-tiny": ({"max_kv_size": 4}, ValueError, "invalid max_kv_size=4: must be >= 8"),
    "num-draft-0": ({"num_draft_tokens": 0}, ValueError, r"invalid num_draft_tokens=0"),
    "draft-policy": ({"draft_policy": "sometimes"}, ValueError, r"invalid draft_policy=.sometimes.: must be"),
    "embed-batch-tiny": ({"embed_batch_tokens": 8}, ValueError,
                         "invalid embed_batch_tokens=8: must be >= 16"),
    "draft-rotating": ({"draft_model": "synthetic:tiny", "max_kv_size": 64}, ValueError,
                       "a rotating one .max_kv_size. cannot"),
    "template-syntax": ({"chat_template": "{% for m in messages %}{{ m.content }}"}, ValueError,
                        "chat_template: it does not render a chat: TemplateSyntaxError"),
    "template-raises": ({"chat_template": "{{ raise_exception('roles must alternate') }}"}, ValueError,
                        "does not render a chat: TemplateError: roles must alternate"),
    "template-neither": ({"chat_template": "no-such-template.jinja"}, ValueError,
                         "neither a file nor a Jinja template"),
    "context-beyond-model": ({"context_length": 4096}, ValueError,
                             "invalid context_length=4096: model 'm' has a 512-token context"),
    "adapter-missing": ({"adapter_path": "/no/such/adapter"}, ModelLoadError, "no such directory"),
    "prompt-file-missing": ({"prompt_cache_file": "/no/such/file.safetensors"}, ModelLoadError,
                            "no such file"),
    "temp-negative": ({"temperature": -1.0}, ValueError, "invalid temperature=-1.0"),
    "top-k-type": ({"top_k": "many"}, ValueError, "invalid model option"),
}


@pytest.mark.parametrize("opts, error, match", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_option_is_refused_before_any_worker_starts(tiny_model, no_spawn, opts, error, match):
    """Each bad option is one clear error naming it, raised before a worker process is spawned."""
    with pytest.raises(error, match=match):
        Runtime(models={"m": ModelSpec(tiny_model, **opts)})


def test_draft_with_another_vocabulary_is_refused_at_the_edge(tiny_model, small_model, no_spawn):
    """A draft whose vocabulary differs from the target's: refused before any worker starts."""
    with pytest.raises(ValueError, match=r"draft_model=.*tokenizer is not the target.s.*8192 .* 2048"):
        Runtime(model=ModelSpec(tiny_model, draft_model=small_model))


def test_adapter_directory_without_weights_is_refused_at_the_edge(tiny_adapter, tmp_path, no_spawn,
                                                                   tiny_model):
    """An adapter directory missing adapters.safetensors is refused before any worker starts."""
    half = tmp_path / "half"
    half.mkdir()
    shutil.copy(f"{tiny_adapter}/adapter_config.json", half)
    with pytest.raises(ModelLoadError, match="not an adapter directory .no adapters.safetensors"):
        Runtime(model=ModelSpec(tiny_model, adapter_path=str(half)))


def test_adapter_for_another_model_fails_the_worker_clearly(small_model, tiny_adapter):
    """An adapter whose shapes do not fit the model: the worker fails at load with mlx-lm's reason,
    the runtime raises ModelLoadError and no process is left (the no_leaks fixture)."""
    with pytest.raises(ModelLoadError, match="Adapter at .* contains incompatible tensors"):
        Runtime(model=ModelSpec(small_model, adapter_path=tiny_adapter), transport="stdio")


def test_unknown_option_keyword_is_a_type_error(tiny_model):
    """A misspelt option is a TypeError listing the known ones."""
    with pytest.raises(TypeError, match="unknown model option.*kv_bit"):
        ModelSpec(tiny_model, kv_bit=8)


def test_chat_template_file_is_read_at_the_edge(tiny_model, tmp_path):
    """--chat-template names a file: the worker is sent its text."""
    from mlxrt.orchestrator.options import prepare

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    _, opts = prepare("m", ModelSpec(tiny_model, chat_template=str(path)), EngineOptions())
    assert opts.chat_template == path.read_text()


def test_each_model_runs_with_its_own_options(tiny_model):
    """Two models in one runtime, one with default sampling of its own: a request that leaves
    max_tokens out gets the model's default; a request's own value wins."""
    models = {"plain": tiny_model, "short": ModelSpec(tiny_model, max_tokens=5, temperature=0.0)}
    with Runtime(models=models, transport="stdio") as rt:
        assert rt.model_options("short").max_tokens == 5
        assert rt.model_options("plain").max_tokens is None
        assert rt.generate("Hello", model="short", ignore_eos=True).stats.generation_tokens == 5
        assert rt.generate("Hello", model="short", ignore_eos=True, max_tokens=3).stats.generation_tokens == 3
        assert rt.generate("Hello", model="plain", ignore_eos=True, max_tokens=7).stats.generation_tokens == 7


def test_workers_on_auto_split_the_prompt_cache_cap(tiny_model, monkeypatch):
    """The workers that leave the prompt cache cap on auto split the machine's share between them; a
    model with a cap of its own keeps it and takes no part of the share."""
    from mlxrt.worker.limits import auto_prompt_cache_bytes

    monkeypatch.delenv("MLXRT_PROMPT_CACHE_BYTES", raising=False)
    models = {"auto": tiny_model, "own": ModelSpec(tiny_model, prompt_cache_bytes=12345678)}
    with Runtime(models=models, workers=2, transport="stdio") as rt:
        model_of = {w.name: w.model for w in rt.workers}
        caps = sorted((model_of[m.name], m.prompt_cache_cap_bytes) for m in rt.memory())
    half = auto_prompt_cache_bytes(2)  # two auto workers: half the machine's share each
    assert half == auto_prompt_cache_bytes() // 2
    assert caps == [("auto", half), ("auto", half), ("own", 12345678), ("own", 12345678)]


def test_serve_flags_become_one_options_record():
    """`mlxrt serve` takes mlx_lm.server's flag names and turns them into one EngineOptions."""
    from mlxrt.cli import _engine_options

    args = build_parser().parse_args([
        "serve", "--model", "m", "--draft-model", "synthetic:tiny", "--num-draft-tokens", "4",
        "--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "0", "--prefill-step-size", "256",
        "--adapter-path", "/a", "--chat-template", "{{ x }}", "--trust-remote-code",
        "--context-length", "1024",
        "--prompt-cache-file", "/p.safetensors", "--temp", "0.7", "--top-p", "0.9", "--top-k", "20",
        "--min-p", "0.05", "--max-tokens", "100", "--embed-batch-tokens", "4096",
    ])
    opts = _engine_options(args)
    assert (opts.draft_model, opts.num_draft_tokens, opts.kv_bits) == ("synthetic:tiny", 4, 8)
    assert opts.kv_group_size == 32
    assert (opts.quantized_kv_start, opts.prefill_step_size, opts.adapter_path) == (0, 256, "/a")
    assert (opts.chat_template, opts.trust_remote_code, opts.context_length) == ("{{ x }}", True, 1024)
    assert (opts.prompt_cache_file, opts.embed_batch_tokens) == ("/p.safetensors", 4096)
    assert opts.sampling_defaults() == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                        "max_tokens": 100}


def test_prompt_cache_bytes_is_auto_unless_given(monkeypatch):
    """No flag and no variable: None, sized by the worker; the variable, then the flag, win (0: off)."""
    from mlxrt.cli import _engine_options

    monkeypatch.delenv("MLXRT_PROMPT_CACHE_BYTES", raising=False)
    serve = ["serve", "--model", "m"]
    assert _engine_options(build_parser().parse_args(serve)).prompt_cache_bytes is None
    monkeypatch.setenv("MLXRT_PROMPT_CACHE_BYTES", "0")
    assert _engine_options(build_parser().parse_args(serve)).prompt_cache_bytes == 0
    flag = [*serve, "--prompt-cache-bytes", "2048"]
    assert _engine_options(build_parser().parse_args(flag)).prompt_cache_bytes == 2048


def test_serve_help_lists_the_options(capsys):
    """`mlxrt serve --help` lists every per-model option."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--draft-model", "--num-draft-tokens", "--draft-policy", "--kv-bits", "--kv-group-size",
                 "--quantized-kv-start", "--max-kv-size", "--prefill-step-size", "--adapter-path",
                 "--chat-template",
                 "--trust-remote-code", "--context-length", "--prompt-cache-file", "--temp", "--top-p",
                 "--top-k", "--min-p", "--max-tokens"):
        assert flag in text


def test_model_defaults_fill_what_a_request_leaves_out():
    """The APIs' requests: the request's value, else the model's default, else the API's own."""
    from mlxrt.orchestrator.http import anthropic, ollama, openai, responses
    from mlxrt.orchestrator.http.anthropic_schemas import MessagesRequest
    from mlxrt.orchestrator.http.responses_schemas import ResponsesRequest
    from mlxrt.orchestrator.http.schemas import OllamaChatRequest

    defaults = {"temperature": 0.2, "top_k": 5, "max_tokens": 9}
    hi = [{"role": "user", "content": "hi"}]
    req = msgspec.convert({"model": "m", "messages": hi, "top_k": 3}, ChatCompletionRequest)
    p = openai.chat_request(req, "m", defaults).params
    assert (p.temperature, p.top_k, p.max_tokens) == (0.2, 3, 9)
    assert openai.chat_request(req, "m", {}).params.temperature == 1.0
    chat = msgspec.convert({"model": "m", "messages": hi, "options": {"temperature": 0.5}}, OllamaChatRequest)
    o = ollama.chat_request(chat, "m", defaults, None).params
    assert (o.temperature, o.top_k, o.max_tokens, o.top_p) == (0.5, 5, 9, 0.9)
    msgs = msgspec.convert({"model": "m", "messages": hi, "max_tokens": 7}, MessagesRequest)
    m = anthropic.messages_request(msgs, "m", defaults).params
    assert (m.temperature, m.max_tokens) == (0.2, 7)  # Messages requires max_tokens
    r = responses.responses_request(ResponsesRequest(model="m", input="hi"), hi, "m", defaults).params
    assert (r.temperature, r.max_tokens) == (0.2, 9)
    r = responses.responses_request(ResponsesRequest(model="m", input="hi", temperature=0.0), hi, "m",
                                    defaults).params
    assert r.temperature == 0.0


def test_synthetic_variant_references_parse():
    """``synthetic:PRESET[:SEED]?noise=X&layers=N&context=C``: parsed, and bad values named."""
    from mlxrt.synthetic.presets import parse_synthetic

    ref = parse_synthetic("tiny:3?noise=0.02&layers=1")
    assert (ref.preset, ref.seed, ref.noise, ref.layers, ref.is_variant) == ("tiny", 3, 0.02, 1, True)
    assert not parse_synthetic("tiny").is_variant
    assert parse_synthetic("tiny-qwen3?context=131072").context == 131072
    for bad in ("tiny?noise=x", "tiny?depth=2", "tiny?layers=0", "tiny:-1", "tiny?context=8"):
        with pytest.raises(ValueError, match="invalid synthetic model"):
            parse_synthetic(bad)


def test_kv_bits_allowed_are_what_mlx_quantizes():
    """KV_BITS and KV_GROUP_SIZES (checked in the orchestrator, without MLX) are what mx.quantize takes."""
    import mlx.core as mx
    from mlxrt.ipc.protocol import KV_BITS, KV_GROUP_SIZES

    x = mx.ones((2, 128))
    for bits in KV_BITS:
        for group in KV_GROUP_SIZES:
            mx.eval(mx.quantize(x, group_size=group, bits=bits))
    with pytest.raises(ValueError):
        mx.eval(mx.quantize(x, group_size=64, bits=7))
    json.dumps(KV_BITS)


def test_synthetic_draft_of_another_preset_shares_the_tokenizer_only_with_its_vocabulary():
    """A small preset drafts for a large one of its family once made with the large one's vocabulary
    (``?vocab=``): the edge compares the tokenizers the two synthetic references will have."""
    from mlxrt.orchestrator.options import tokenizer_key

    big, small = "synthetic:qwen2.5-7b-4bit", "synthetic:qwen2.5-0.5b-4bit"
    assert tokenizer_key(big) != tokenizer_key(small)
    assert tokenizer_key(big) == tokenizer_key(small + "?vocab=152064")
    assert tokenizer_key("synthetic:tiny") == tokenizer_key("synthetic:tiny?noise=0.1&layers=1")


def test_worker_refuses_a_draft_with_another_tokenizer(tiny_model):
    """Where the edge cannot read the tokenizers, the worker compares them at load."""
    from mlxrt.worker.engine import Engine

    with pytest.raises(ValueError, match="draft_model=.*tokenizer .* is not the target's"):
        Engine(tiny_model, options=EngineOptions(draft_model="synthetic:tiny?vocab=4096"))


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role | upper }}: {{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>ASSISTANT: {% endif %}")


def test_adapter_and_chat_template_per_model(tiny_model, tiny_adapter, reference):
    """One runtime, three models on one directory: the adapter changes the greedy ids to mlx-lm's with
    that adapter, the model without it keeps the base ids; an overriding chat template is what a chat
    is rendered with."""
    from mlx_lm import load, stream_generate

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    prompt = "Once upon a time"
    tuned_model, tuned_tok = load(tiny_model, adapter_path=tiny_adapter)
    want_tuned = [r.token for r in stream_generate(tuned_model, tuned_tok, prompt, max_tokens=12)]
    base_model, base_tok = reference
    want_base = [r.token for r in stream_generate(base_model, base_tok, prompt, max_tokens=12)]
    assert want_tuned != want_base
    models = {"base": tiny_model, "tuned": ModelSpec(tiny_model, adapter_path=tiny_adapter),
              "templated": ModelSpec(tiny_model, chat_template=TEMPLATE)}
    with Runtime(models=models, transport="stdio") as rt:
        assert rt.generate(prompt, model="tuned", max_tokens=12, ignore_eos=True).tokens == want_tuned
        assert rt.generate(prompt, model="base", max_tokens=12, ignore_eos=True).tokens == want_base
        rendered = "<|im_start|>SYSTEM: Be brief.<|im_end|>\n<|im_start|>USER: Tell me a story.<|im_end|>\n" \
                   "<|im_start|>ASSISTANT: "
        chat = rt.generate(messages, model="templated", max_tokens=8, ignore_eos=True)
        raw = rt.generate(rendered, model="templated", max_tokens=8, ignore_eos=True)
        assert chat.tokens == raw.tokens
        assert chat.stats.prompt_tokens == len(base_tok.encode(rendered))
        default = rt.generate(messages, model="base", max_tokens=8, ignore_eos=True)
        assert default.stats.prompt_tokens != chat.stats.prompt_tokens


def test_context_length_default_and_num_ctx(tiny_model):
    """A model's default context bounds prompt and reply; a request's num_ctx replaces it, up to the
    model's own context; beyond that it is refused before the request reaches a worker."""
    from mlxrt import RequestError

    long_prompt = list(range(100, 180))  # 80 tokens
    with Runtime(model=ModelSpec(tiny_model, context_length=64), transport="stdio") as rt:
        with pytest.raises(RequestError, match=r"80 tokens; the context is 64 tokens \(context_length\)"):
            rt.generate(long_prompt, max_tokens=4)
        c = rt.generate(long_prompt, max_tokens=1000, ignore_eos=True, num_ctx=100)
        assert c.stats.generation_tokens == 100 - 80 and c.finish_reason == "length"
        c = rt.generate([5, 6, 7, 8], max_tokens=1000, ignore_eos=True)
        assert c.stats.generation_tokens == 64 - 4
        with pytest.raises(ValueError, match="invalid num_ctx=513: model .* has a 512-token context"):
            rt.generate("Hi", num_ctx=513)
        with pytest.raises(RequestError, match=r"the context is 16 tokens \(num_ctx\)"):
            rt.generate(long_prompt, num_ctx=16)


def test_ollama_num_ctx_is_enforced_with_a_400(srv):
    """Ollama's options.num_ctx: beyond the model's context, or shorter than the prompt, is a 400."""
    import httpx

    body = {"model": "tiny", "prompt": "Hello there", "raw": True, "stream": False}
    r = httpx.post(srv.url + "/api/generate", json={**body, "options": {"num_ctx": 4096}}, timeout=60)
    assert r.status_code == 400 and "options.num_ctx" in r.json()["error"] and "512" in r.json()["error"]
    r = httpx.post(srv.url + "/api/generate", json={**body, "prompt": "word " * 40,
                                                    "options": {"num_ctx": 8}}, timeout=60)
    assert r.status_code == 400 and "the context is 8 tokens (num_ctx)" in r.json()["error"]
    r = httpx.post(srv.url + "/api/generate", json={**body, "options": {"num_ctx": 8, "num_predict": -1}},
                   timeout=60)
    assert r.status_code == 200 and r.json()["prompt_eval_count"] + r.json()["eval_count"] <= 8


def test_make_model_writes_a_draft_variant(tmp_path):
    """`mlxrt make-model PRESET --noise X --layers N` writes a loadable cut, perturbed copy that keeps
    the preset's tokenizer."""
    from mlx_lm import load
    from mlxrt.cli import main
    from mlxrt.synthetic.build import ensure_model

    assert main(["make-model", "tiny", "--out", str(tmp_path / "d"), "--noise", "0.02", "--layers", "1"]) == 0
    model, tokenizer = load(str(tmp_path / "d"))
    _, base = load(str(ensure_model("tiny")))
    assert len(model.layers) == 1 and tokenizer.get_vocab() == base.get_vocab()
