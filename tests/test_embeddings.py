"""Embeddings: the worker's Embedder in-process, `Runtime.embed` over real workers, and the OpenAI and
Ollama endpoints driven by the official clients, on the tiny Qwen3-Embedding-shaped model."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlxrt import AsyncRuntime, Runtime
from mlxrt.ipc.protocol import Embed, EngineOptions, Generate, SamplingParams
from mlxrt.worker.embed import Embedder, EmbeddingSpec, embedding_spec
from mlxrt.worker.embed_batch import MAX_WASTE_CPU, MAX_WASTE_GPU
from mlxrt.worker.engine import BatchStepError, ModelKindError
from support import assert_stopped, fail_once, running

TEXTS = ["The river ran past the old mill.", "Boats", "The morning train left the station at dawn",
         "Children watched the boats go by while the baker opened his door and the bells rang"]
CONTEXT = 512  # the tiny presets' max_position_embeddings
DIM = 64


@pytest.fixture(scope="module")
def emb_model() -> str:
    from mlxrt.synthetic.build import ensure_model

    return str(ensure_model("tiny-qwen3-embedding"))


@pytest.fixture(scope="module")
def reference(emb_model):
    """In-process mlx-lm: its Qwen3 class with the checkpoint's (bare backbone) weights in its backbone,
    and its tokenizer. Returns (ids_of(text), vector_of(ids)): last token, L2-normalised."""
    from mlx_lm.utils import _get_classes, load_tokenizer

    config = json.loads(Path(emb_model, "config.json").read_text())
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.model.load_weights(list(mx.load(str(Path(emb_model, "model.safetensors"))).items()))
    tokenizer = load_tokenizer(Path(emb_model))

    def vector(ids: list[int], dims: int = DIM) -> np.ndarray:
        v = np.array(model.model(mx.array([ids]))[0, -1].astype(mx.float32))[:dims]
        return v / np.linalg.norm(v)

    return tokenizer.encode, vector


def embed_in_process(embedder: Embedder, requests: list[list[list[int]]], dims: int = 0) -> list[np.ndarray]:
    """Submit every request at once, step until done, and return each one's vectors."""
    from mlxrt.worker.embed import _Collect

    box = _Collect()
    for i, inputs in enumerate(requests):
        embedder.submit(Embed(id=i, inputs=inputs, dimensions=dims), box)
    while embedder.busy:
        embedder.step()
    assert box.error is None, box.error
    return [box.results[i] for i in range(len(requests))]


def random_ids(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2000, n).tolist() for n in lengths]


# ---- the worker's Embedder, in-process ----------------------------------------------


def test_embedding_models_are_recognised_by_sentence_transformers_files(emb_model, tiny_model, tmp_path):
    """modules.json with a Pooling module marks an embedding model (its pooling and Normalize read from
    it); a model without it is generative; a pooling mode that is not served is a clear error."""
    assert embedding_spec(emb_model) == EmbeddingSpec("last", normalize=True)
    assert embedding_spec(tiny_model) is None
    other = tmp_path / "max-pooled"
    shutil.copytree(emb_model, other)
    pooling = json.loads((other / "1_Pooling" / "config.json").read_text())
    pooling.update(pooling_mode_lasttoken=False, pooling_mode_max_tokens=True)
    (other / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    with pytest.raises(ValueError, match="max_tokens"):
        embedding_spec(other)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize(("max_waste", "passes"), [(MAX_WASTE_CPU, 6), (MAX_WASTE_GPU, 4)])
def test_padding_does_not_change_a_vector(emb_model, pooling, max_waste, passes):
    """An input's vector is the same alone and right-padded in a batch beside longer inputs, of its length
    bucket or (as on a GPU) of merged neighbouring buckets, padded past the longest to a fixed width, for
    every pooling; inputs longer than prefill_step_size (chunked) too."""
    embedder = Embedder(emb_model, EmbeddingSpec(pooling, True), options=EngineOptions(prefill_step_size=64),
                        max_waste=max_waste)
    inputs = random_ids([9, 12, 16, 13, 3, 20, 40, 100, 150])
    together = embed_in_process(embedder, [inputs])[0]
    # CPU: 9-16 together (width 16), then 3, 20, 40, 100, 150 alone; GPU: 9-16, 20 and 3 merged (width 24)
    assert (embedder.passes, embedder.rows) == (passes, len(inputs))
    for i, ids in enumerate(inputs):
        alone = embed_in_process(embedder, [[ids]])[0][0]
        np.testing.assert_allclose(together[i], alone, rtol=0, atol=1e-6, err_msg=f"input {i}")
        assert np.linalg.norm(alone) == pytest.approx(1.0, abs=1e-5)


def test_concurrent_requests_share_forward_passes(emb_model):
    """Inputs of different requests in one length bucket go through one pass; a bucket that would pad the
    pass too much, and an input over prefill_step_size, get passes of their own; the oldest input always
    goes in the next pass."""
    embedder = Embedder(emb_model, embedding_spec(emb_model), options=EngineOptions(prefill_step_size=64))
    short, other, long = random_ids([10, 12, 9]), random_ids([40]), random_ids([80])
    got = embed_in_process(embedder, [[ids] for ids in short] + [other, long])
    assert [g.shape for g in got] == [(1, DIM)] * 5
    assert (embedder.passes, embedder.rows) == (3, 5)  # the three short inputs together; 40; 80 (chunked)


@pytest.mark.parametrize("option", [{"kv_bits": 8}, {"chat_template": "{{ messages }}"},
                                    {"context_length": 64}])
def test_generation_options_are_refused_for_an_embedding_model(emb_model, option):
    """An option only generation uses (a draft, an adapter, a template, KV settings, a context, a
    prompt-cache file) fails the embedding model's load by name, rather than being ignored."""
    with pytest.raises(ValueError, match=f"{next(iter(option))}: not supported for an embedding model"):
        Embedder(emb_model, embedding_spec(emb_model), options=EngineOptions(**option))


def test_vectors_are_mlx_lm_forward_passes(emb_model, reference):
    """Each vector is the L2-normalised last hidden state of mlx-lm's own forward pass over the input's
    ids (EOS appended by the tokenizer), also for an input run in chunks through the KV cache."""
    ids_of, vector = reference
    embedder = Embedder(emb_model, embedding_spec(emb_model), options=EngineOptions(prefill_step_size=16))
    inputs = [ids_of(t) for t in TEXTS]
    assert all(ids[-1] == ids_of("")[-1] for ids in inputs)  # the EOS Qwen3-Embedding pools
    assert len(inputs[3]) > 16  # chunked
    got = embed_in_process(embedder, [inputs])[0]
    for i, ids in enumerate(inputs):
        np.testing.assert_allclose(got[i], vector(ids), rtol=0, atol=1e-5, err_msg=TEXTS[i])


def test_dimensions_keep_the_first_components_renormalised(emb_model, reference):
    """`dimensions` keeps a vector's first components, L2-normalised again (Matryoshka)."""
    ids_of, vector = reference
    embedder = Embedder(emb_model, embedding_spec(emb_model))
    ids = ids_of(TEXTS[0])
    (got,) = embed_in_process(embedder, [[ids]], dims=8)
    assert got.shape == (1, 8)
    np.testing.assert_allclose(got[0], vector(ids, 8), rtol=0, atol=1e-6)


def test_a_cancelled_or_refused_request_leaves_the_others_alone(emb_model, tiny_model):
    """A generation sent to an embedding model fails alone (ModelKindError), as embeddings asked of a
    generative model's engine do; a cancelled request ends as cancelled, and the request queued beside
    them is answered."""
    from mlxrt.worker.embed import _Collect
    from mlxrt.worker.engine import Engine

    box = _Collect()
    Engine(tiny_model).submit(Embed(id=0, inputs=[[1, 2]]), box)
    assert isinstance(box.error, ModelKindError)
    embedder = Embedder(emb_model, embedding_spec(emb_model))
    box = _Collect()
    embedder.submit(Generate(id=1, params=SamplingParams(), prompt="Hi"), box)
    assert isinstance(box.error, ModelKindError)
    embedder.submit(Embed(id=2, inputs=random_ids([5, 6])), box)
    embedder.submit(Embed(id=3, inputs=random_ids([7])), box)
    assert embedder.cancel(2) and not embedder.cancel(2)
    while embedder.busy:
        embedder.step()
    assert box.stats[2].finish_reason == "cancelled" and 2 not in box.results
    assert box.results[3].shape == (1, DIM)


def test_a_pass_that_runs_out_of_memory_fails_alone_and_hands_the_buffers_back(emb_model):
    """A forward pass whose allocation fails fails the requests it carried, with one warning
    (`engine.out_of_memory`); the next request gets the vector it got before."""
    from mlxrt.worker.embed import _Collect
    from structlog.testing import capture_logs

    embedder = Embedder(emb_model, embedding_spec(emb_model))
    ids = random_ids([9])
    before = embed_in_process(embedder, [ids])[0]
    fail_once(embedder, "forward", RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory"))
    box = _Collect()
    with capture_logs() as logs:
        embedder.submit(Embed(id=7, inputs=ids), box)
        while embedder.busy:
            embedder.step()
    assert isinstance(box.error, BatchStepError) and "out of memory" in str(box.error)
    assert 7 not in box.results
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["engine.out_of_memory"]
    assert mx.get_cache_memory() == 0 and "--embed-batch-tokens" in logs[-1]["hint"]
    np.testing.assert_array_equal(embed_in_process(embedder, [ids])[0], before)


# ---- Runtime.embed over real workers -------------------------------------------------


@pytest.mark.parametrize("transport", ["stdio", "ring"])
def test_runtime_embed(emb_model, tiny_model, reference, transport):
    """rt.embed gives float32 numpy vectors (1-D for one input, one row per input for a list), unit norm,
    writable, equal to mlx-lm's forward pass; token ids give what their text gives; the async API agrees;
    a generative model refuses to embed and the embedding model to generate, before any worker hears."""
    ids_of, vector = reference
    with Runtime(models={"emb": emb_model, "tiny": tiny_model}, transport=transport) as rt:
        one = rt.embed(TEXTS[0], model="emb")
        assert one.shape == (DIM,) and one.dtype == np.float32 and one.flags.writeable
        many = rt.embed(TEXTS, model="emb")
        assert many.shape == (len(TEXTS), DIM)
        np.testing.assert_allclose(np.linalg.norm(many, axis=1), 1.0, atol=1e-5)
        for text, row in zip(TEXTS, many, strict=True):
            np.testing.assert_allclose(row, vector(ids_of(text)), rtol=0, atol=1e-5)
        np.testing.assert_array_equal(rt.embed([ids_of(t) for t in TEXTS], model="emb"), many)

        async def embed_async() -> np.ndarray:
            async with AsyncRuntime(models={"emb": emb_model}, transport=transport) as art:
                return await art.embed(TEXTS, model="emb", dimensions=16)

        short = asyncio.run(embed_async())
        assert short.shape == (len(TEXTS), 16)
        np.testing.assert_allclose(short[1], vector(ids_of(TEXTS[1]), 16), rtol=0, atol=1e-5)
        requests = {w.model: w.requests for w in rt.workers}
        with pytest.raises(ValueError, match="'tiny' is not an embedding model"):
            rt.embed("Hi", model="tiny")
        with pytest.raises(ValueError, match="'emb' is an embedding model"):
            rt.generate("Hi", model="emb", max_tokens=2)
        with pytest.raises(ValueError, match="512 tokens"):
            rt.embed("word " * CONTEXT, model="emb")
        assert {w.model: w.requests for w in rt.workers} == requests
        cut = rt.embed("word " * CONTEXT, model="emb", truncate=True)
        assert cut.shape == (DIM,)
        pids = [w.pid for w in rt.workers]
    assert_stopped(pids)


# ---- the HTTP endpoints, with the official clients -----------------------------------


@pytest.fixture(scope="module")
def srv(emb_model, tiny_model):
    """One server with the embedding model ("emb") and a generative one ("tiny")."""
    with running({"emb": emb_model, "tiny": tiny_model}) as s:
        yield s


def requests_seen(srv) -> dict[str, int]:
    return {w.model: w.requests for w in srv.rt.workers}


def test_openai_client(oai, reference):
    """client.embeddings.create: one vector per input in order, unit norm, mlx-lm's vectors, usage counting
    the inputs' tokens; the client's default (base64 on the wire), explicit floats and explicit base64
    (little-endian float32) give the same floats; an input alone equals itself inside a batch."""
    ids_of, vector = reference
    r = oai.embeddings.create(model="emb", input=TEXTS)
    assert [d.index for d in r.data] == list(range(len(TEXTS))) and r.model == "emb"
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(ids_of(t)) for t in TEXTS)
    got = np.array([d.embedding for d in r.data])
    assert got.shape == (len(TEXTS), DIM)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    for text, row in zip(TEXTS, got, strict=True):
        np.testing.assert_allclose(row, vector(ids_of(text)), rtol=0, atol=1e-5)
    floats = oai.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    assert np.array([d.embedding for d in floats.data]).tolist() == got.tolist()
    b64 = oai.embeddings.create(model="emb", input=TEXTS, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in b64.data]
    assert np.array(decoded).tolist() == got.tolist()
    alone = oai.embeddings.create(model="emb", input=TEXTS[2], encoding_format="float").data[0].embedding
    assert alone == got[2].tolist()
    ids = oai.embeddings.create(model="emb", input=[ids_of(t) for t in TEXTS[:2]], encoding_format="float")
    assert [d.embedding for d in ids.data] == got[:2].tolist()
    cut = oai.embeddings.create(model="emb", input=TEXTS[0], dimensions=8, encoding_format="float")
    np.testing.assert_allclose(cut.data[0].embedding, vector(ids_of(TEXTS[0]), 8), rtol=0, atol=1e-5)


def test_ollama_client(oll, oai, reference):
    """client.embed: one unit vector per input, the OpenAI endpoint's vectors, prompt_eval_count,
    dimensions; an input over the context is cut (truncate defaults to true); the older
    client.embeddings(prompt) gives the same vector; /api/show says the model embeds."""
    ids_of, vector = reference
    r = oll.embed(model="emb", input=TEXTS, keep_alive="5m")
    assert len(r.embeddings) == len(TEXTS) and r.prompt_eval_count == sum(len(ids_of(t)) for t in TEXTS)
    assert r.total_duration > 0
    got = np.array(r.embeddings)
    floats = oai.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    expected = [d.embedding for d in floats.data]
    assert got.tolist() == expected
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert np.array(oll.embed(model="emb:latest", input=TEXTS[1], dimensions=4).embeddings).shape == (1, 4)
    long = oll.embed(model="emb", input="word " * CONTEXT)
    assert long.prompt_eval_count == CONTEXT and len(long.embeddings[0]) == DIM
    assert oll.embeddings(model="emb", prompt=TEXTS[0]).embedding == got[0].tolist()
    assert oll.show("emb").capabilities == ["embedding"]
    assert oll.embed(model="emb").embeddings == []  # no input: the model is loaded, as Ollama does


OVER = "word " * CONTEXT


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"model": "emb", "input": []}, "input"),
    ("/v1/embeddings", {"model": "emb", "input": ""}, "input"),
    ("/v1/embeddings", {"model": "emb", "input": ["fine", ""]}, "input[1]"),
    ("/v1/embeddings", {"model": "emb", "input": [[]]}, "input[0]"),
    ("/v1/embeddings", {"model": "emb", "input": ["fine", 3]}, "input[1]"),
    ("/v1/embeddings", {"model": "emb", "input": [[1, 2], [3, 2048]]}, "input[1]"),
    ("/v1/embeddings", {"model": "emb", "input": ["fine", OVER]}, "input[1]"),
    ("/v1/embeddings", {"model": "emb", "input": list(range(CONTEXT + 1))}, "input"),
    ("/v1/embeddings", {"model": "emb", "input": "fine", "dimensions": DIM + 1}, "dimensions"),
    ("/v1/embeddings", {"model": "emb", "input": "fine", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"model": "emb", "input": "fine", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"model": "tiny", "input": "fine"}, "model"),
    ("/api/embed", {"model": "emb", "input": []}, "input"),
    ("/api/embed", {"model": "emb", "input": OVER, "truncate": False}, "input"),
    ("/api/embed", {"model": "tiny", "input": ["fine"]}, "model"),
    ("/api/embeddings", {"model": "emb", "prompt": OVER}, "prompt"),
    ("/api/embeddings", {"model": "tiny", "prompt": "fine"}, "model"),
])
def test_bad_embedding_requests_are_400_before_any_worker(srv, http, path, body, param):
    """Empty inputs, inputs over the context, ids outside the vocabulary, bad dimensions and a generative
    model are each a 400 in the endpoint's own error shape, naming the field; no worker hears of them."""
    before = requests_seen(srv)
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if path.startswith("/api/"):
        assert isinstance(err, str) and f"invalid {param}" in err
    else:
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
        if "tokens" in err["message"]:
            assert err["code"] == "context_length_exceeded"
    assert requests_seen(srv) == before


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/completions", {"prompt": "Hi"}),
    ("/api/generate", {"prompt": "Hi", "stream": False}),
    ("/api/chat", {"messages": [{"role": "user", "content": "Hi"}], "stream": True}),
])
def test_an_embedding_model_refuses_to_generate_at_the_edge(srv, http, path, body):
    """Every generating endpoint answers an embedding model with a 400 naming the model, before a worker."""
    before = requests_seen(srv)
    r = http.post(path, json={"model": "emb", **body})
    assert r.status_code == 400, r.text
    assert "embedding model" in json.dumps(r.json())
    assert requests_seen(srv) == before


def test_embeddings_without_the_right_model_name(http):
    """An unknown model is a 404 and a missing one a 400, as for the other endpoints."""
    assert http.post("/v1/embeddings", json={"model": "nope", "input": "x"}).status_code == 404
    assert http.post("/v1/embeddings", json={"input": "x"}).status_code == 400


def test_benchmark_runs_and_its_vectors_agree_with_native(capsys, tmp_path):
    """benchmarks/embeddings.py runs every scenario, writes its JSON document, and every scenario's vectors
    are native's (the benchmark's own gate); it counts the forward passes each scenario took."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:  # `benchmarks` is a folder of the checkout, not an installed package
        sys.path.insert(0, root)
    from benchmarks import embeddings as bench

    out = tmp_path / "embeddings.json"
    result = bench.main(["--preset", "tiny-qwen3-embedding", "--rounds", "1", "--inputs", "6",
                         "--transport", "stdio", "--json", str(out)])
    assert set(result["scenarios"]) == {"native-b1", "native-b32", "mlxrt-b1", "mlxrt-b32", "mlxrt-c32"}
    assert all(s["max_abs_diff"] <= bench.GATE_ABS_DIFF for s in result["scenarios"].values())
    passes = {name: s["passes_per_32_inputs"] for name, s in result["scenarios"].items()}
    assert passes["native-b1"] == passes["mlxrt-b1"] == [32.0]  # one pass per input, counted by the worker
    assert passes["native-b32"] == [32 / 6] and passes["mlxrt-b32"][0] <= passes["mlxrt-b1"][0]
    assert json.loads(out.read_text()) == json.loads(json.dumps(result)) and result["env"]["commit"]
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # a summary line, not the document
    assert last["outputs"] == {"json": str(out)}
    assert set(last["inputs_per_s_median"]) == set(result["scenarios"])
