"""The benchmark's token gate: identity where native is deterministic, teacher forcing where not."""

from __future__ import annotations

import random

import pytest
from support import run_of

from benchmarks.gate import MIN_TOLERANCE, Gate, deficits, first_divergence


class FlakyNative:
    """Native whose repeat run differs from the first at token 5: a nondeterministic backend."""

    def __init__(self, model, tokenizer) -> None:
        from mlx_lm import stream_generate

        self.model, self._gen, self._tok = model, stream_generate, tokenizer

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        saved = self._tok.eos_token_ids
        self._tok.eos_token_ids = set()
        try:
            return [r.token for r in self._gen(self.model, self._tok, prompt, max_tokens=n)]
        finally:
            self._tok.eos_token_ids = saved

    def run(self, prompt: list[int], n: int):
        tokens = self.greedy(prompt, n)
        tokens[5] = (tokens[5] + 1) % 2000

        class R:
            pass

        r = R()
        r.tokens = tokens
        return r


@pytest.fixture(scope="module")
def native(reference):
    return FlakyNative(*reference)


def test_first_divergence():
    """Identical lists have none; otherwise the first differing index or the shorter end."""
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_greedy_tokens_have_near_zero_deficits(native):
    """Tokens native emitted greedily sit at (or within rounding of) the top logit, teacher-forced."""
    prompt = [random.Random(1).randrange(10, 2000) for _ in range(40)]
    tokens = native.greedy(prompt, 24)
    assert max(deficits(native.model, prompt, tokens)) < MIN_TOLERANCE


def test_teacher_forced_gate_passes_greedy_and_fails_crossed_streams(native):
    """On a nondeterministic native, greedy-valid tokens pass; another prompt's tokens (crossed
    streams) and a shifted sequence fail."""
    rng = random.Random(2)
    a = [rng.randrange(10, 2000) for _ in range(40)]
    b = [rng.randrange(10, 2000) for _ in range(40)]
    ref_a, ref_b = native.greedy(a, 24), native.greedy(b, 24)
    gate = Gate(native, a, ref_a, 24)
    assert not gate.deterministic and gate.native_self_divergence == 5
    assert gate.check(a, ref_a, ref_a)["ok"]
    assert not gate.check(a, ref_b, ref_a)["ok"]  # crossed: b's tokens on a's request
    assert not gate.check(a, [ref_a[0]] + ref_a[:-1], ref_a)["ok"]  # shifted by one
    assert not gate.check(a, ref_a[:-3], ref_a)["ok"]  # short


class _PartedNative:
    """A deterministic native whose single-stream ids part from the greedy ones at token 3, as
    gpt-oss's did from its batched ones on an H200: batching and the single stream disagree."""

    def __init__(self, native: FlakyNative) -> None:
        self.model, self._native = native.model, native

    def run(self, prompt: list[int], n: int):
        tokens = self._native.greedy(prompt, n)
        tokens[3] = (tokens[3] + 1) % 2000
        return run_of(tokens)


def test_batched_streams_are_teacher_forced_where_native_batch_parts_from_native(native):
    """Where native-batch parts from native alone, batched streams are teacher-forced; crossed ones fail."""
    from benchmarks import __main__ as bench
    from benchmarks import report

    rng = random.Random(3)
    prompts = [[rng.randrange(10, 2000) for _ in range(30)] for _ in range(2)]
    greedy = [native.greedy(p, 12) for p in prompts]
    args = bench.parse_args(["--model", "synthetic:tiny", "--gen-tokens", "12"])

    def gate_with(batch_tokens, mlxrt_tokens):
        said = []
        suite = bench.Suite(args, bench.make_plan(args), said.append)
        suite.ref = greedy[0]
        suite.live["native"] = _PartedNative(native)
        suite.conc_prompts = {2: prompts}
        suite.conc_refs = {2: batch_tokens}
        suite.conc_ref_basis = {2: bench.NATIVE_BATCH}
        suite.concurrency_runs = {"mlxrt-http": {2: [run_of(t) for t in mlxrt_tokens]}}
        suite.concurrency_references()
        return suite.gate({"native": {"token_checked": True}}), said

    good, said = gate_with(greedy, greedy)
    assert good["passed"] is True, good
    assert good["mode"].startswith("identical ids") and good["batched"]["batch_divergence"] == 3
    assert good["batched"]["tolerance_logits"] == MIN_TOLERANCE  # greedy tokens: rounding noise only
    assert any("parted from native at token 3" in s for s in said)
    line = report.gate_line({"gate": good, "concurrency": {"reference": {"2": bench.NATIVE_BATCH}}})
    assert line.startswith("quality gate: greedy-valid tokens") and "parted from native at token 3" in line
    crossed = gate_with(greedy, greedy[::-1])[0]
    assert crossed["passed"] is False and crossed["mismatched"] == ["mlxrt-http under concurrency"]
    batch_crossed = gate_with(greedy[::-1], greedy[::-1])[0]  # teacher forcing reads each stream's own prompt
    assert batch_crossed["mismatched"] == ["mlxrt-http under concurrency", "native-batch under concurrency"]
