"""The things the harness times: native in-process MLX and mlxrt over each transport.

Every scenario has ``setup()``, ``run(prompt_ids, gen_tokens) -> Run`` and
``close()``; all run greedy with EOS disabled on the same prompt ids.
"""

from __future__ import annotations

import time

from .measure import Run, time_stream


class Skipped(Exception):
    """A scenario that cannot run here; the message says why."""


class Native:
    """In-process ``mlx_lm.stream_generate``: the baseline."""

    name = "native"

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path

    def setup(self) -> None:
        from mlx_lm import load

        self.model, self.tokenizer = load(self.model_path)
        self.tokenizer.eos_token_ids = set()  # EOS disabled: every run makes gen_tokens tokens

    def run(self, prompt_ids: list[int], gen_tokens: int) -> Run:
        from mlx_lm import stream_generate

        start = time.perf_counter()
        responses = stream_generate(self.model, self.tokenizer, prompt_ids, max_tokens=gen_tokens)
        return time_stream(start, ([r.token] for r in responses))

    def close(self) -> None:
        self.model = self.tokenizer = None


class Embedded:
    """mlxrt's Python API, one worker, over a given transport."""

    def __init__(self, model_path: str, transport: str) -> None:
        self.name = f"mlxrt-{transport}"
        self.model_path = model_path
        self.transport = transport
        self.rt = None

    def setup(self) -> None:
        from mlxrt import Runtime

        self.rt = Runtime(model=self.model_path, transport=self.transport)
        if self.rt.transport != self.transport:
            got = self.rt.transport
            self.rt.close()
            raise Skipped(f"asked for {self.transport}, runtime chose {got}")

    def run(self, prompt_ids: list[int], gen_tokens: int) -> Run:
        start = time.perf_counter()
        stream = self.rt.stream(prompt_ids, max_tokens=gen_tokens, ignore_eos=True)
        return time_stream(start, (c.tokens for c in stream))

    def close(self) -> None:
        if self.rt is not None:
            self.rt.close()
