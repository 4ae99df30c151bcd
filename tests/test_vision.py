"""Images through every API on a vision-language model: real worker processes running mlx-vlm on the
tiny Qwen2.5-VL preset, a real `mlxrt serve` with the openai, anthropic and ollama clients, and the
bad inputs that must be refused by name before they reach a worker."""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib

import anthropic
import httpx
import ollama
import openai
import pytest
from mlxrt import InvalidField, RequestError, Runtime
from mlxrt.orchestrator.images import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_IMAGES,
    MAX_REQUEST_IMAGE_BYTES,
    sniff,
)
from support import assert_stopped, free_port

pytest.importorskip("mlx_vlm", reason="the vision extra (pip install 'mlxrt[vision]')")
from PIL import Image  # noqa: E402  (the vision extra brings Pillow)

QUESTION = "What is in this picture?"


def png(width: int, height: int, color=(200, 40, 40)) -> bytes:
    """A `width` x `height` PNG of one colour with a gradient, so two sizes differ in their pixels."""
    img = Image.new("RGB", (width, height), color)
    for x in range(0, width, 7):
        img.putpixel((x, x % height), (x % 256, 255 - x % 256, 90))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def jpeg(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (20, 120, 220)).save(buf, format="JPEG")
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` and whose data is cut short (never decoded here)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat(image: bytes | list[bytes], text: str = QUESTION) -> list[dict]:
    images = image if isinstance(image, list) else [image]
    return [{"role": "user", "content": [*({"type": "image", "image": i} for i in images),
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def vl_model() -> str:
    from mlxrt.synthetic.build import ensure_model

    return str(ensure_model("tiny-qwen2.5-vl"))


@pytest.fixture(scope="module")
def gemma_model() -> str:
    from mlxrt.synthetic.build import ensure_model

    return str(ensure_model("tiny-gemma3-vl"))


#: The vision models the worker tests run on, by the name the runtime serves them under.
VISION = ["vl", "gemma"]


@pytest.fixture(scope="module")
def rt(vl_model, gemma_model, tiny_model):
    """A runtime with two vision models (Qwen2.5-VL "vl", the default, and Gemma 3 "gemma") and a text
    model ("tiny"), real workers."""
    runtime = Runtime(models={"vl": vl_model, "gemma": gemma_model, "tiny": tiny_model}, transport="stdio")
    pids = [w.pid for w in runtime.workers]
    yield runtime
    runtime.close()
    assert_stopped(pids)


# ---- the worker: mlx-vlm's model, the prefix cache ---------------------------------------------


def mlx_vlm_reply(path: str, messages: list[dict], image: bytes, max_tokens: int):
    """mlx-vlm's own greedy `generate` in this process for `messages` (image parts as ``{"type":
    "image"}``) and `image`: the reference a worker's reply is held to."""
    from mlx_vlm import generate, load

    model, processor = load(path)
    tok = processor.tokenizer
    processor.chat_template = tok.chat_template  # the template owns BOS: mlx-vlm adds none then
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return generate(model, processor, prompt, image=[Image.open(io.BytesIO(image))], max_tokens=max_tokens,
                    temperature=0.0, verbose=False)


TEMPLATE_CHAT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
PATHS = {"vl": "vl_model", "gemma": "gemma_model"}


@pytest.mark.parametrize("name", VISION)
def test_greedy_reply_equals_mlx_vlm_generate(rt, request, name):
    """An image chat through a worker gives mlx-vlm's own in-process greedy tokens for the same prompt
    and image, and counts the image's tokens in the prompt (Qwen2.5-VL and Gemma 3)."""
    image = png(120, 90)
    c = rt.generate(chat(image), model=name, max_tokens=12)
    ref = mlx_vlm_reply(request.getfixturevalue(PATHS[name]), TEMPLATE_CHAT, image, 12)
    assert ref.token_ids and c.tokens == ref.token_ids
    assert c.stats.prompt_tokens == ref.prompt_tokens
    text_only = rt.generate([{"role": "user", "content": QUESTION}], model=name, max_tokens=1)
    assert c.stats.prompt_tokens >= text_only.stats.prompt_tokens + 4  # the image's tokens (4 at the least)


@pytest.mark.parametrize("name", VISION)
def test_repeated_image_reuses_the_cache(rt, name):
    """The same image and prompt again is served from the prefix cache (all but the last prompt token)
    with the same tokens; another image is not."""
    image = png(64, 64, (10, 200, 10))
    first = rt.generate(chat(image), model=name, max_tokens=8, ignore_eos=True)
    again = rt.generate(chat(image), model=name, max_tokens=8, ignore_eos=True)
    other = rt.generate(chat(png(64, 64, (10, 10, 200))), model=name, max_tokens=8, ignore_eos=True)
    assert first.stats.cached_tokens == 0
    assert again.stats.cached_tokens == again.stats.prompt_tokens - 1
    assert again.tokens == first.tokens
    assert other.stats.cached_tokens == 0


@pytest.mark.parametrize("name", VISION)
def test_a_later_turn_reuses_the_image_turns_kv(rt, request, name):
    """A chat's next turn with the same image starts from the KV its first turn left (the image's tokens
    and all), and its reply is still mlx-vlm's own for the whole conversation."""
    image = png(70, 70, (120, 60, 200))
    first = rt.generate(chat(image), model=name, max_tokens=6)
    follow = [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And its colour?"}]
    second = rt.generate(chat(image) + follow, model=name, max_tokens=8)
    assert first.stats.cached_tokens == 0
    assert second.stats.cached_tokens == first.stats.prompt_tokens - 1
    ref = mlx_vlm_reply(request.getfixturevalue(PATHS[name]), TEMPLATE_CHAT + follow, image, 8)
    assert second.tokens == ref.token_ids and second.stats.prompt_tokens == ref.prompt_tokens


def test_images_as_data_uris_base64_and_bytes_are_one_request(rt):
    """The Python API takes an image as bytes, a data URI (OpenAI's image_url part) or base64 in a message's
    `images` (Ollama's): the same tokens each way; JPEG too."""
    image = png(80, 50)
    as_bytes = rt.generate(chat(image), model="vl", max_tokens=6, ignore_eos=True)
    as_uri = rt.generate([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(image)}}, {"type": "text", "text": QUESTION}]}],
        model="vl", max_tokens=6, ignore_eos=True)
    b64 = base64.b64encode(image).decode()
    as_b64 = rt.generate([{"role": "user", "content": QUESTION, "images": [b64]}], model="vl", max_tokens=6,
                         ignore_eos=True)
    assert as_bytes.tokens == as_uri.tokens == as_b64.tokens
    two = rt.generate(chat([image, jpeg(40, 60)]), model="vl", max_tokens=2)
    assert two.stats.prompt_tokens > as_bytes.stats.prompt_tokens


def test_stop_strings_and_cancel_on_a_vision_model(rt):
    """A vision model's reply streams, stops at max_tokens, and a stream closed early ends the request
    (the worker serves the next one)."""
    stream = rt.stream(chat(png(30, 30)), model="vl", max_tokens=200, ignore_eos=True)
    for _ in stream:
        break
    stream.close()
    c = rt.generate(chat(png(30, 30)), model="vl", max_tokens=3, ignore_eos=True)
    assert c.finish_reason == "length" and len(c.tokens) == 3


def test_cli_generate_with_an_image(rt, vl_model, tmp_path):
    """`mlxrt generate --image PATH` sends the file as a user message's image: the reply and prompt
    tokens are the Python API's for the same chat."""
    image = png(50, 40)
    (tmp_path / "a.png").write_bytes(image)
    out = subprocess.run([sys.executable, "-m", "mlxrt", "generate", "-m", vl_model, "--image",
                          str(tmp_path / "a.png"), "--max-tokens", "6", "--ignore-eos", "--stats", QUESTION],
                         capture_output=True, text=True, timeout=300, check=True)
    stats = json.loads(out.stderr.strip().splitlines()[-1])
    ref = rt.generate([{"role": "user", "content": QUESTION, "images": [image]}], model="vl", max_tokens=6,
                      ignore_eos=True)
    assert out.stdout.rstrip("\n") == ref.text and stats["prompt_tokens"] == ref.stats.prompt_tokens


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_a_resumed_reply_goes_on_where_it_stopped(vl_model, seed):
    """A request resent after its worker died (`Generate.resume`, the tokens the caller had) goes on with
    the same tokens, sending none of those again, its text and counts whole (docs/supervision.md)."""
    from mlxrt.ipc.protocol import ChatMessage, Generate, Resume, SamplingParams
    from mlxrt.worker.vision import VisionEngine
    from support import Recorder

    engine = VisionEngine(vl_model)
    temperature = 0.0 if seed is None else 0.9
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=temperature, seed=seed)
    messages = [ChatMessage("user", QUESTION, images=[png(60, 60)])]
    whole, rest = Recorder(), Recorder()
    engine.submit(Generate(id=1, params=params, messages=messages), whole)
    while engine.busy:
        engine.step()
    sent = whole.ids[1][:5]
    engine.submit(Generate(id=2, params=params, messages=messages, resume=Resume(tokens=[sent])), rest)
    while engine.busy:
        engine.step()
    assert sent + rest.ids[2] == whole.ids[1]
    assert rest.stats[2].generation_tokens == 12 and rest.stats[2].resumes == 1
    assert rest.stats[2].prompt_tokens == whole.stats[1].prompt_tokens
    assert whole.text[1].endswith(rest.text[2]) and rest.text[2]


def test_an_image_request_that_runs_out_of_memory_fails_alone_and_empties_the_image_cache(vl_model):
    """A decode step whose allocation fails fails its request with one warning (`engine.out_of_memory`) and
    empties the image cache; the request again gets the tokens it got before."""
    import mlx.core as mx
    from mlxrt.ipc.protocol import ChatMessage, Generate, SamplingParams
    from mlxrt.worker.vision import VisionEngine
    from structlog.testing import capture_logs
    from support import Recorder, fail_once

    engine = VisionEngine(vl_model)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    messages = [ChatMessage("user", QUESTION, images=[png(60, 60)])]

    def run(i: int) -> Recorder:
        rec = Recorder()
        engine.submit(Generate(id=i, params=params, messages=messages), rec)
        while engine.busy:
            engine.step()
        return rec

    before = run(1)
    assert engine.cache.nbytes > 0
    fail_once(engine, "_decode", RuntimeError("[METAL] Command buffer execution failed: Insufficient Memory "
                                              "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"))
    with capture_logs() as logs:
        failed = run(2)
    assert "Insufficient Memory" in str(failed.errors[2]) and engine.cache.nbytes == 0
    assert mx.get_cache_memory() == 0
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["engine.out_of_memory"]
    assert run(3).ids[3] == before.ids[1]


def test_an_image_stream_goes_on_after_its_worker_is_killed(vl_model):
    """SIGKILL mid-stream on a vision model: the image request is sent again to the restarted worker with
    the tokens its caller had, and the stream goes on with exactly the uninterrupted run's tokens."""
    from mlxrt import Supervision
    from support import FAST, run_with_deadline

    image = png(80, 60)
    with Runtime(model=vl_model, transport="stdio", supervision=Supervision(**FAST)) as runtime:
        whole = runtime.generate(chat(image), max_tokens=60, ignore_eos=True)
        old = runtime.workers[0].pid
        stream = runtime.stream(chat(image), max_tokens=60, ignore_eos=True)
        ids: list[int] = []
        for i, chunk in enumerate(run_with_deadline(lambda: iter(stream), 120)):
            ids += chunk.tokens
            if i == 0:
                os.kill(old, signal.SIGKILL)
        assert runtime.workers[0].pid != old and runtime.workers[0].resumes == 1
    assert ids == whole.tokens
    assert (stream.stats.generation_tokens, stream.stats.resumes) == (60, 1)
    assert stream.stats.prompt_tokens == whole.stats.prompt_tokens


# ---- bad input, refused by name -----------------------------------------------------------------


@pytest.mark.parametrize("image, words", [
    (b"this is not an image", "not an image"),
    (b"\x89PNG\r\n", "not an image"),
    (png_header(20000, 20000), f"over the limit of {MAX_IMAGE_PIXELS}"),
    (png_header(10, 10) + b"\0" * MAX_IMAGE_BYTES, f"over the limit of {MAX_IMAGE_BYTES}"),
    ("https://example.com/cat.png", "not fetched"),
    ("data:image/png;base64,@@@", "not valid base64"),
])
def test_bad_images_are_refused_at_the_edge(rt, image, words):
    """Bytes that are no image, an image over the byte or pixel limit, a remote URL and bad base64 are an
    `InvalidField` naming the part, before any worker sees them."""
    with pytest.raises(InvalidField) as exc:
        rt.generate(chat(image), model="vl", max_tokens=2)  # type: ignore[arg-type]
    assert exc.value.field == "messages[0].content[0].image" and words in str(exc.value)


def test_too_many_images_are_refused(rt):
    """More than MAX_IMAGES images, or more than MAX_REQUEST_IMAGE_BYTES of them, in one request is
    refused, naming the messages."""
    with pytest.raises(InvalidField) as exc:
        rt.generate(chat([png(8, 8)] * (MAX_IMAGES + 1)), model="vl", max_tokens=2)
    assert exc.value.field == "messages" and f"over the limit of {MAX_IMAGES}" in str(exc.value)
    big = png_header(100, 100) + b"\0" * (MAX_IMAGE_BYTES - 100)  # each under the one-image limit
    n = MAX_REQUEST_IMAGE_BYTES // MAX_IMAGE_BYTES + 1
    with pytest.raises(InvalidField) as exc:
        rt.generate(chat([big] * n), model="vl", max_tokens=2)
    assert exc.value.field == "messages" and f"over the limit of {MAX_REQUEST_IMAGE_BYTES}" in str(exc.value)


def test_a_broken_image_fails_alone_in_the_worker(rt):
    """An image whose header is sound but whose data is not fails in the worker as an invalid field,
    alone: the same worker serves the next request."""
    pid = rt.workers[0].pid
    with pytest.raises(RequestError) as exc:
        rt.generate(chat(png_header(64, 64) + b"garbage" * 10), model="vl", max_tokens=2)
    assert exc.value.kind == "invalid" and exc.value.field == "images[0]"
    assert rt.generate(chat(png(20, 20)), model="vl", max_tokens=2).tokens
    assert pid in [w.pid for w in rt.workers]


def test_token_ids_beyond_the_vocabulary_fail_alone(rt):
    """Prompt ids a vision model's vocabulary lacks fail that request as an invalid prompt; the worker
    serves the next one (ids as a prompt go through the vision worker too)."""
    with pytest.raises(RequestError) as exc:
        rt.generate([5, 17, 10**6], model="vl", max_tokens=2)
    assert exc.value.kind == "invalid" and exc.value.field == "prompt"
    assert len(rt.generate([5, 17, 42], model="vl", max_tokens=3, ignore_eos=True).tokens) == 3


def test_a_text_model_refuses_images(rt):
    """An image sent to a text-only model is refused by name, as a capability it lacks."""
    rt.generate("warm", model="tiny", max_tokens=1)  # its worker is ready: the orchestrator checks
    with pytest.raises(InvalidField) as exc:
        rt.generate(chat(png(16, 16)), model="tiny", max_tokens=2)
    assert exc.value.field == "messages[0]" and exc.value.capability == "vision"


def test_a_text_worker_refuses_images_itself(tiny_model):
    """A text model's engine refuses a chat with images by name, for requests sent before the orchestrator
    knew the model's capabilities (no worker ready yet)."""
    from mlxrt.ipc.protocol import ChatMessage, Generate, SamplingParams
    from mlxrt.worker.engine import Engine
    from support import Recorder

    engine, rec = Engine(tiny_model), Recorder()
    message = ChatMessage("user", QUESTION, images=[png(8, 8)])
    engine.submit(Generate(id=1, params=SamplingParams(max_tokens=2), messages=[message]), rec)
    assert isinstance(rec.errors[1], InvalidField) and rec.errors[1].field == "images"
    assert rec.errors[1].capability == "vision"


def test_headers_give_format_and_size():
    """The orchestrator reads PNG, JPEG, GIF and WebP headers for their size without decoding them."""
    for fmt in ("PNG", "JPEG", "GIF", "WEBP"):
        buf = io.BytesIO()
        Image.new("RGB", (37, 23)).save(buf, format=fmt)
        info = sniff(buf.getvalue())
        assert info is not None and (info.format, info.width, info.height) == (fmt.lower(), 37, 23)
    assert sniff(b"BM" + b"\0" * 40) is None  # BMP is not taken


# ---- the real-shape GPU preset, checked without drawing a weight -------------------------------------


def test_the_3b_preset_has_qwen2_5_vl_3b_parameter_count():
    """The GPU vision preset has Qwen2.5-VL-3B-Instruct's 3,754,622,976 parameters (language model
    3,085,938,688, vision tower 668,684,288), counted from the published shapes; no weight is computed."""
    from mlx.utils import tree_flatten
    from mlxrt.synthetic.presets import get_preset
    from mlxrt.synthetic.vision import vision_model

    model, _ = vision_model(get_preset("qwen2.5-vl-3b-4bit"))  # lazy: never evaluated
    sizes = [(name, p.size) for name, p in tree_flatten(model.parameters())]
    # Language model: tied embedding; q, k, v with biases (2 KV heads of 128); SwiGLU; 2 norms a layer.
    h, layers, kv, inter, vocab = 2048, 36, 2 * 128, 11008, 151936
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * inter + 2 * h
    language = vocab * h + layers * layer + h
    # Vision tower: a 3-D patch conv (3 channels, 2 frames, 14x14); blocks of fused qkv with bias,
    # projection, SwiGLU with biases, 2 RMSNorms; a merger of 2x2 patches (RMSNorm, 5120 -> 5120 -> 2048).
    c, depth, vinter, merged, out = 1280, 32, 3420, 4 * 1280, 2048
    block = (c * 3 * c + 3 * c) + (c * c + c) + 2 * (c * vinter + vinter) + (vinter * c + c) + 2 * c
    vision = c * 3 * 2 * 14 * 14 + depth * block + c + (merged * merged + merged) + (merged * out + out)
    assert sum(n for name, n in sizes if name.startswith("language_model.")) == language == 3_085_938_688
    assert sum(n for name, n in sizes if name.startswith("vision_tower.")) == vision == 668_684_288
    assert sum(n for _, n in sizes) == 3_754_622_976


def test_the_3b_preset_quantizes_the_language_model_only():
    """The 4-bit GPU preset is quantized as mlx-vlm's convert -q does it: every linear layer and the
    embedding of the language model 4-bit group 64, the vision tower and merger left bfloat16."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlxrt.synthetic.build import build_model

    model, config = build_model("qwen2.5-vl-3b-4bit")  # lazy: nothing is drawn
    quantizable = (nn.Linear, nn.Embedding, nn.QuantizedLinear, nn.QuantizedEmbedding)
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, quantizable)]
    language = [m for name, m in modules if name.startswith("language_model.")]
    vision = [m for name, m in modules if name.startswith("vision_tower.")]
    assert len(language) == 36 * 7 + 1 and len(vision) == 32 * 5 + 2  # the tied head is the embedding
    assert all(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in language)
    assert all(m.bits == 4 and m.group_size == 64 for m in language)
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in vision)
    assert all(m.weight.dtype == mx.bfloat16 for m in vision)
    # One entry for the whole model, so mlx-vlm's load quantizes exactly the layers stored with scales.
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}


def test_float32_tower_keeps_the_language_models_dtype(vl_model):
    """What a CUDA worker does to a vision model (`float32_tower`, the SIGFPE workaround), on the tiny
    preset cast to bfloat16: the tower's weights become float32, its image features come out bfloat16,
    so the prompt's embeddings (and the KV cache made from them) stay bfloat16."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm import load
    from mlx_vlm.utils import prepare_inputs
    from mlxrt.worker.vision import float32_tower

    model, processor = load(vl_model)
    model.set_dtype(mx.bfloat16)
    float32_tower(model)
    tower = {p.dtype for _, p in tree_flatten(model.vision_tower.parameters())}
    language = {p.dtype for _, p in tree_flatten(model.language_model.parameters())}
    assert tower == {mx.float32} and language == {mx.bfloat16}
    tok = processor.tokenizer
    prompt = tok.apply_chat_template(TEMPLATE_CHAT, tokenize=False, add_generation_prompt=True)
    inputs = prepare_inputs(processor, images=[Image.open(io.BytesIO(png(56, 56)))], prompts=[prompt])
    features = model.get_input_embeddings(inputs["input_ids"], inputs["pixel_values"],
                                          image_grid_thw=inputs["image_grid_thw"])
    assert features.inputs_embeds.dtype == mx.bfloat16


# ---- every API through a real `mlxrt serve` -----------------------------------------------------


@contextlib.contextmanager
def serving(log, *args: str):
    """`mlxrt serve ARGS` on a free port of 127.0.0.1, up and answering /health; its URL."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlxrt", "--log-level", "info", "serve", *args,
                                 "--port", str(port), "--transport", "stdio"],
                                stdout=subprocess.DEVNULL, stderr=out, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlxrt serve did not come up:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


@pytest.fixture(scope="module")
def server(vl_model, tiny_model, tmp_path_factory):
    """`mlxrt serve --model vl=... --model tiny=...` on 127.0.0.1; its URL and its log's path."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serving(log, "--model", f"vl={vl_model}", "--model", f"tiny={tiny_model}") as url:
        yield url, log


IMAGE = png(100, 70)
#: The image and question as OpenAI chat parts.
OPENAI_PARTS = [{"type": "image_url", "image_url": {"url": data_uri(IMAGE)}},
                {"type": "text", "text": QUESTION}]


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server[0] + "/v1", api_key="x") as client:
        yield client


def openai_chat(client: openai.OpenAI, **kw):
    """The greedy chat completion of IMAGE and QUESTION: the reference the other APIs are held to."""
    return client.chat.completions.create(model="vl", max_tokens=5, temperature=0,
                                          messages=[{"role": "user", "content": OPENAI_PARTS}], **kw)


def test_openai_chat_image_url(oai):
    """OpenAI chat completions take an image_url part as a data URI; usage counts the image's tokens."""
    r = openai_chat(oai)
    text_only = oai.chat.completions.create(model="vl", max_tokens=1,
                                               messages=[{"role": "user", "content": QUESTION}])
    assert r.choices[0].message.content and r.usage.completion_tokens <= 5
    assert r.usage.prompt_tokens > text_only.usage.prompt_tokens + 4
    chunks = openai_chat(oai, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == r.choices[0].message.content


def test_responses_input_image(oai):
    """The Responses API takes an input_image part (a data URI); the same reply and prompt tokens as chat."""
    content = [{"type": "input_image", "image_url": data_uri(IMAGE)},
               {"type": "input_text", "text": QUESTION}]
    r = oai.responses.create(model="vl", max_output_tokens=5, temperature=0,
                             input=[{"role": "user", "content": content}])
    ref = openai_chat(oai)
    assert r.output_text == ref.choices[0].message.content
    assert r.usage.input_tokens == ref.usage.prompt_tokens


def test_anthropic_image_block(server, oai):
    """Anthropic Messages take a base64 image block; the same reply and prompt tokens as chat."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(IMAGE).decode()}}
    with anthropic.Anthropic(base_url=server[0], api_key="x") as client:
        msg = client.messages.create(model="vl", max_tokens=5, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": [image, {"type": "text", "text": QUESTION}]}])
    ref = openai_chat(oai)
    assert msg.content[0].text == ref.choices[0].message.content
    # Anthropic counts the prompt tokens read from the cache apart from the others.
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == ref.usage.prompt_tokens


def test_anthropic_screenshot_in_a_tool_result(server):
    """A coding agent's screenshot comes back in a tool_result block: with tools, the image reaches the
    vision model (its tokens counted) as the tool turn's."""
    tools = [{"name": "screenshot", "description": "Take a screenshot", "input_schema": {"type": "object"}}]

    def turn(result: list[dict]) -> list[dict]:
        return [{"role": "user", "content": "What is on my screen?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "screenshot",
                                                   "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": result}]}]

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(90, 60)).decode()}}
    with anthropic.Anthropic(base_url=server[0], api_key="x") as client:
        shot = client.messages.create(model="vl", max_tokens=3, tools=tools,
                                      messages=turn([image, {"type": "text", "text": "the screen"}]))
        words = client.messages.create(model="vl", max_tokens=3, tools=tools,
                                       messages=turn([{"type": "text", "text": "the screen"}]))
    seen = shot.usage.input_tokens + shot.usage.cache_read_input_tokens
    assert seen > words.usage.input_tokens + words.usage.cache_read_input_tokens + 4


def test_ollama_images(server, oai):
    """Ollama's chat and generate take `images` (base64): the same reply and prompt tokens as chat."""
    b64 = base64.b64encode(IMAGE).decode()
    options = {"num_predict": 5, "temperature": 0}
    with ollama.Client(host=server[0]) as client:
        r = client.chat(model="vl", messages=[{"role": "user", "content": QUESTION, "images": [b64]}],
                        options=options)
        g = client.generate(model="vl", prompt=QUESTION, images=[b64], options=options)
    ref = openai_chat(oai)
    assert r.message.content == g.response == ref.choices[0].message.content
    assert r.prompt_eval_count == g.prompt_eval_count == ref.usage.prompt_tokens


def test_http_bad_images_are_400s_naming_the_field(server):
    """Each API's bad image is a 400 naming its own field, logged; the server goes on serving."""
    url, log = server
    with httpx.Client(base_url=url, timeout=60) as http:
        _check_refusals(http, log)


def _check_refusals(http: httpx.Client, log) -> None:
    """Each case's 400 and the field it names; the refusals in the log; a good request after them."""
    cases = [
        ("/v1/chat/completions", {"model": "vl", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]},
         "messages[0].content[0].image_url.url"),
        ("/v1/chat/completions", {"model": "vl", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(b"not an image")}}]}]},
         "messages[0].content[0].image_url.url"),
        ("/v1/responses", {"model": "vl", "max_output_tokens": 2, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": data_uri(png_header(30000, 30000))}]}]},
         "input[0].content[0].image_url"),
        ("/v1/messages", {"model": "vl", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]},
         "messages[0].content[0].source.url"),
        ("/api/chat", {"model": "vl", "stream": False, "messages": [
            {"role": "user", "content": "hi", "images": ["%%%"]}]}, "messages[0].images[0]"),
        ("/api/generate", {"model": "vl", "stream": False, "prompt": "hi", "images": ["aGVsbG8="]},
         "images[0]"),
        ("/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(IMAGE)}}]}]}, "messages[0]"),
    ]
    for path, body, field in cases:
        r = http.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert field in r.text, (path, r.text)
    logged = log.read_text()
    assert "messages[0].content[0].source.url" in logged and "images[0]" in logged
    ok = http.post("/v1/chat/completions", json={"model": "vl", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(IMAGE)}}]}]})
    assert ok.status_code == 200


# ---- remote image URLs, fetched only with --allow-image-urls -----------------------------------


@pytest.fixture(scope="module")
def image_site():
    """A local HTTP server with /a.png (IMAGE) and nothing else (404); its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the base class's name)
            if self.path == "/a.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(IMAGE)))
                self.end_headers()
                self.wfile.write(IMAGE)
            else:
                self.send_error(404)

        def log_message(self, *args):
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=site.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{site.server_address[1]}"
    site.shutdown()
    site.server_close()
    thread.join(10)


def test_allow_image_urls_fetches_them(vl_model, image_site, tmp_path, oai):
    """With --allow-image-urls an image_url's http URL is fetched: the same reply and prompt tokens as
    the data URI; a URL that answers 404 is a 400 naming the part."""
    log = tmp_path / "serve.log"
    with serving(log, "--model", f"vl={vl_model}", "--allow-image-urls") as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="x") as client:
        def ask(image_url: str):
            return client.chat.completions.create(model="vl", max_tokens=5, temperature=0, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                             {"type": "text", "text": QUESTION}]}])

        fetched = ask(f"{image_site}/a.png")
        with pytest.raises(openai.BadRequestError) as exc:
            ask(f"{image_site}/missing.png")
    ref = openai_chat(oai)
    assert fetched.choices[0].message.content == ref.choices[0].message.content
    assert fetched.usage.prompt_tokens == ref.usage.prompt_tokens
    assert exc.value.body["param"] == "messages[0].content[0].image_url.url"
    assert "could not fetch" in exc.value.body["message"]
