# A throwaway probe of session 12 (not part of the harness): where a worker's time goes, step by step.
# Put this folder first on PYTHONPATH and set MLXRT_PROBE_TRACE=DIR: every process that imports mlxrt's
# worker (a worker under the harness, or an in-process engine) appends one JSON line per event to
# DIR/trace-PID.jsonl: a request's arrival on the reader thread, its admission, each step and the calls
# inside it, and each request's first token. `show.py DIR` prints them burst by burst.
# Variants for an A/B (each also applies to the harness's own process, native-batch included; they apply
# with or without MLXRT_PROBE_TRACE: they needed it before, and lease 4's agent run, which set none, lost
# its variant):
#   PROBE_NO_CLEAR=1   mx.clear_cache does nothing (MLX keeps its freed buffers for reuse);
#   PROBE_JOIN_ALL     (session 12: every prompt at its last token joined the batch in one call; the engine's
#                      own way since session 13, so the variant is gone)
#   PROBE_JOIN_PROMPTS=1  the way before session 13: the batch takes `prompt_concurrency` prompts a call;
#   PROBE_MIN_PREFIX=N the prefix cache's shortest served prefix (prefix_cache.MIN_PREFIX_TOKENS) is N;
#   PROBE_GC_FREEZE=1  an engine, once built, moves every object there is to the GC's permanent generation
#                      (gc.freeze), so that no collection walks the model's and the tokenizer's objects;
#   PROBE_READY_BREAK=1  a prefill step ends after a call that left prompts at their last token, so that
#                      they join and get their first token before the next call (as mlx-lm's batch
#                      prefills one prompt batch a step), not after the budget's every call (session 13's
#                      lead for the bursts' TTFT);
#   PROBE_NO_INTAKE    (session 12: no request admitted mid-step; gone since 7471b54 took `intake` out);
#   PROBE_ROW_VIEWS    (session 14: a batched call's joining rows as views of its arrays; the engine's own way
#                      since session 15, `prefill.row_caches`, so the variant is gone);
#   PROBE_ROW_COPIES=1 (session 15) the way before it: every row of a batched call is mlx-lm's extract (a copy
#                      per layer and row), then the batch's merge copies it again;
#   PROBE_NO_OWNED=1   (session 15) the prefix cache keeps a deep copy of what it is given (shares its arrays,
#                      views of a batch's included), not `kvcache.owned`'s copy, as before session 15.
import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time

DIR = os.environ.get("MLXRT_PROBE_TRACE")
_out = None
_lock = threading.Lock()


#: Events noted by the GC's callback, written by the next `emit`: a collection can start inside `emit` (its
#: allocations), where writing again would wait on `_lock` for ever (session 13's leases 3 and 5 hung so).
_pending: list = []


def emit(kind, t0, seconds=0.0, **what):
    global _out
    if not DIR:  # variants only
        return
    with _lock:
        if _out is None:
            os.makedirs(DIR, exist_ok=True)
            _out = open(os.path.join(DIR, f"trace-{os.getpid()}.jsonl"), "a", buffering=1)
        while _pending:
            k, t, d, w = _pending.pop(0)
            _out.write(json.dumps({"e": k, "t": t, "d": d, **w}) + "\n")
        _out.write(json.dumps({"e": kind, "t": t0, "d": seconds, **what}) + "\n")


_evals = threading.local()


def timed(kind, fn, what=None, evals=False):
    """`fn` timed; `what` (called before `fn`) names what it did; `evals`: the time inside mx.eval too."""
    def wrapper(*a, **k):
        named = what(*a, **k) if what else {}
        t0 = time.perf_counter()
        if evals:
            _evals.s = 0.0
        try:
            return fn(*a, **k)
        finally:
            d = time.perf_counter() - t0
            if evals:
                named["eval_ms"] = round(_evals.s * 1e3, 2)
                _evals.s = None
            emit(kind, t0, d, **named)
    wrapper.__wrapped__ = fn
    return wrapper


def watch_gc():
    """Every collection of 0.5 ms or more, as a "gc" event with its generation (session 13)."""
    import gc
    began = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            began[0] = time.perf_counter()
        elif (d := time.perf_counter() - began[0]) >= 5e-4:
            _pending.append(("gc", began[0], d, {"gen": info["generation"], "collected": info["collected"]}))
    gc.callbacks.append(on_gc)


def patch_mx():
    import mlx.core as mx
    ev = mx.eval

    def eval_w(*a, **k):
        if getattr(_evals, "s", None) is None:
            return ev(*a, **k)
        t0 = time.perf_counter()
        try:
            return ev(*a, **k)
        finally:
            _evals.s += time.perf_counter() - t0
    mx.eval = eval_w
    if os.environ.get("PROBE_NO_CLEAR"):
        mx.clear_cache = lambda: None


def patch_engine(mod):
    E = mod.Engine

    def step_what(self):
        return {"waiting": len(self._waiting), "prefills": len(self._prefills), "running": len(self._running),
                "solo": self._solo is not None}
    E.step = timed("STEP", E.step, step_what)
    for name in ("_admit", "_prefill_step", "_solo_step", "_hand_over", "_deliver", "_batch_step", "_insert"):
        setattr(E, name, timed(name, getattr(E, name)))
    submit = E.submit

    def submit_w(self, req, *a, **k):
        emit("submit", time.perf_counter(), id=getattr(req, "id", None))
        return submit(self, req, *a, **k)
    E.submit = submit_w
    if os.environ.get("PROBE_GC_FREEZE"):
        import gc
        init_f = E.__init__

        def init_freeze(self, *a, **k):
            init_f(self, *a, **k)
            gc.collect()
            gc.freeze()
        E.__init__ = init_freeze
    if os.environ.get("PROBE_JOIN_PROMPTS"):
        new_batch0 = E._new_batch

        def new_batch_p(self):
            batch = new_batch0(self)
            batch.prefill_batch_size = self.prefill.batch_prompts
            return batch
        E._new_batch = new_batch_p


def patch_prefill(mod):
    if os.environ.get("PROBE_READY_BREAK"):
        ready_break(mod)
    if os.environ.get("PROBE_ROW_COPIES"):
        mod.row_caches = lambda batch, joining: [batch.extract_cache(i) for i in range(len(joining))]
    mod.run_rows = timed("rows", mod.run_rows, lambda m, rows, s, *_, **__: {
        "rows": len(rows), "widths": sorted(len(p.segments[0]) for p in rows),
        "cached": sorted(len(p.tokens) for p in rows)}, evals=True)
    mod.run_chunk = timed("chunk", mod.run_chunk,
                          lambda m, p, size, s, **_: {"size": size, "after": len(p.tokens)}, evals=True)


def ready_break(mod):
    """PROBE_READY_BREAK: a prompt joining after one of this step's calls makes the sizer ask for no more."""
    S, Z = mod.PrefillScheduler, mod.ChunkSizer
    calls = threading.local()
    def noted(fn):
        def call_w(*a, **k):
            calls.made = True
            return fn(*a, **k)
        return call_w
    mod.run_rows, mod.run_chunk = noted(mod.run_rows), noted(mod.run_chunk)
    join, step, size = S._join, S._prefill_step, Z.size

    def join_w(self, p):
        if getattr(calls, "made", False):
            self.sizer.probe_stop = True
        return join(self, p)

    def step_w(self):
        calls.made, self.sizer.probe_stop = False, False
        try:
            return step(self)
        finally:
            calls.made, self.sizer.probe_stop = False, False

    def size_w(self, *a, **k):
        return 0 if getattr(self, "probe_stop", False) else size(self, *a, **k)
    S._join, S._prefill_step, Z.size = join_w, step_w, size_w


def patch_serve(mod):
    S = mod.Server
    on_message = S.on_message

    def on_message_w(self, msg):
        if type(msg).__name__ == "Generate":
            emit("arrive", time.perf_counter(), id=msg.id)
        return on_message(self, msg)
    S.on_message = on_message_w
    first: set = set()
    token = S.token

    def token_w(self, req_id, *a, **k):
        if req_id not in first:
            first.add(req_id)
            emit("first", time.perf_counter(), id=req_id)
        return token(self, req_id, *a, **k)
    S.token = token_w


def patch_generate(mod):
    B = mod.BatchGenerator
    B.next = timed("batch.next", B.next, lambda self: {
        "decoding": len(self._generation_batch), "prompts": len(self._unprocessed_sequences),
        "prompt_batch": len(self._prompt_batch)}, evals=True)


def patch_prefix_cache(mod):
    mod.PrefixCache.fetch = timed("fetch", mod.PrefixCache.fetch)
    if os.environ.get("PROBE_NO_OWNED"):
        import copy
        mod.owned = copy.deepcopy
    if os.environ.get("PROBE_MIN_PREFIX"):
        mod.MIN_PREFIX_TOKENS = int(os.environ["PROBE_MIN_PREFIX"])


PATCHES = {"mlxrt.worker.prefix_cache": patch_prefix_cache, "mlxrt.worker.engine": patch_engine,
           "mlxrt.worker.prefill": patch_prefill, "mlxrt.worker.serve": patch_serve,
           "mlx_lm.generate": patch_generate}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                exec_module(module)
                PATCHES[name](module)
        spec.loader = _Loader()
        return spec


if DIR or any(k.startswith("PROBE_") for k in os.environ):
    sys.meta_path.insert(0, _Finder())
    patch_mx()
    if DIR:
        watch_gc()
