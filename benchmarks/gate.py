"""The quality gate: every mlxrt scenario must emit the tokens native MLX emits.

Where native decoding is deterministic (MLX's CPU backend), that means the
same ids, exactly. MLX's CUDA decode is not deterministic: on an H100 (mlx
0.32.4) two native runs of one prompt, in one process, parted ways after
93-135 tokens on the near-tied logits of random weights, while prefill
logits were bit-identical. Identity is then unattainable by native itself, so
the gate checks each emitted token by teacher forcing instead: one forward
pass over prompt + output gives, at every position, how far the emitted
token's logit is below the best one (its "deficit"). Greedy decoding emits a
token whose deficit is rounding noise; a wrong, shifted or crossed token
(another stream's) sits well below the top. The tolerance is set from
native's reference run, between `MIN_TOLERANCE` and `MAX_TOLERANCE` logits.

Batching can part ways with native where native alone is deterministic: on an
H200 (mlx 0.32.4) gpt-oss-20b's native-batch streams (mlx-lm's
BatchGenerator, 16 at once) differed from native's single stream at their
first or second token, while Gemma 3's (deterministic too) matched. Where a
batch's arithmetic is not the single stream's, identity is unattainable there
too, so `BatchGate` checks the streams decoded in a batch by teacher forcing,
its tolerance set from native-batch's own streams: rounding passes, a wrong,
shifted or crossed token does not.
"""

from __future__ import annotations

from typing import Any

#: Smallest tolerance, in logits: a few bf16 steps at typical logit sizes.
MIN_TOLERANCE = 0.1
#: Tolerance = this times the largest deficit in native's reference run (if above the floor).
NATIVE_MARGIN = 2.0
#: Largest tolerance, in logits: a crossed or shifted stream lands further below the top than this.
MAX_TOLERANCE = 0.5


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or of the shorter end); None if identical."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def deficits(model: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    """Per emitted token: max logit minus the emitted token's logit, teacher-forced (logits)."""
    import mlx.core as mx

    if not tokens:
        return []
    seq = mx.array(prompt + tokens[:-1])[None]
    logits = model(seq)[0, len(prompt) - 1 :].astype(mx.float32)
    picked = mx.take_along_axis(logits, mx.array(tokens)[:, None], axis=-1)[:, 0]
    out = logits.max(axis=-1) - picked
    mx.eval(out)
    return out.tolist()


class Gate:
    """Decides, once per run of the suite, how mlxrt's tokens are checked against native's."""

    def __init__(self, native: Any, prompt: list[int], reference: list[int], gen_tokens: int) -> None:
        again = native.run(prompt, gen_tokens).tokens
        self.native_self_divergence = first_divergence(reference, again)
        self.deterministic = self.native_self_divergence is None
        self._model = native.model
        self.tolerance: float | None = None
        if not self.deterministic:  # the repeat only detects nondeterminism; the reference sets the noise
            worst = max(deficits(self._model, prompt, reference), default=0.0)
            self.tolerance = _tolerance(worst)

    def check(self, prompt: list[int], tokens: list[int], reference: list[int]) -> dict[str, Any]:
        """Whether `tokens` pass against native's `reference` for the same prompt."""
        if self.deterministic:
            div = first_divergence(reference, tokens)
            return {"ok": div is None, "first_divergence": div}
        return teacher_forced(self._model, prompt, tokens, reference, self.tolerance or 0.0)

    def describe(self) -> dict[str, Any]:
        if self.deterministic:
            return {"mode": "identical ids (native decoding is deterministic here)"}
        return {
            "mode": "teacher-forced greedy check (native decoding is not deterministic here)",
            "native_self_divergence": self.native_self_divergence,
            "tolerance_logits": self.tolerance,
        }


def _tolerance(worst: float) -> float:
    return min(MAX_TOLERANCE, max(MIN_TOLERANCE, NATIVE_MARGIN * worst))


def teacher_forced(model: Any, prompt: list[int], tokens: list[int], reference: list[int],
                   tolerance: float) -> dict[str, Any]:
    """`tokens` pass if as many as `reference`'s, each within `tolerance` logits of the greedy choice."""
    worst = max(deficits(model, prompt, tokens), default=0.0)
    ok = len(tokens) == len(reference) and worst <= tolerance
    return {"ok": ok, "first_divergence": first_divergence(reference, tokens), "max_deficit": worst}


class BatchGate:
    """The check of streams decoded in a batch, where native-batch's ids differ from native's
    alone while native alone is deterministic: teacher forcing on native's model.

    The tolerance comes from the deficits of native-batch's checked streams (`samples`: prompt and
    tokens each), as `Gate`'s comes from native's reference: so native-batch's own streams are held
    to `MAX_TOLERANCE`, a bound a wrong, shifted or crossed token lands beyond.
    """

    deterministic = False

    def __init__(
        self, model: Any, samples: list[tuple[list[int], list[int]]], divergence: int | None
    ) -> None:
        self._model = model
        self.batch_divergence = divergence
        worst = max((max(deficits(model, p, t), default=0.0) for p, t in samples), default=0.0)
        self.tolerance = _tolerance(worst)

    def check(self, prompt: list[int], tokens: list[int], reference: list[int]) -> dict[str, Any]:
        """Whether batched `tokens` pass against `reference` (for the same prompt), teacher-forced."""
        return teacher_forced(self._model, prompt, tokens, reference, self.tolerance)

    def describe(self) -> dict[str, Any]:
        return {
            "mode": "teacher-forced greedy check of batched streams (native-batch's ids differ from"
            " native's alone here)",
            "batch_divergence": self.batch_divergence,
            "tolerance_logits": self.tolerance,
            "native_batch_bound_logits": MAX_TOLERANCE,
        }
