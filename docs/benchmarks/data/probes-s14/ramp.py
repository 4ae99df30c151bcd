# A throwaway probe of session 14 (not part of the harness): session 11's steps.py (a burst in-process,
# native-batch against mlxrt's Engine) with one more engine, a variant of the engine's step in which the
# second batch step (the one that hands a prompt that joined the batch its first token in the same step)
# is left out while other prompts still wait to prefill: a burst's ramp then decodes its early streams
# once per prefill budget rather than twice. VARIANT=eights: instead, prompts at their last token wait
# out of the batch while others are still prefilling, until `prompt_concurrency` (8) of them are ready,
# and join together, as mlx-lm's batch starts a burst 8 at a time (every prompt of these bursts
# arrives at once: the rule knows no cohorts, so a short prompt behind a long one would wait too).
#   PROMPT=128 GEN=128 [VARIANT=eights] python docs/benchmarks/data/probes-s14/ramp.py MODEL N[,N..] [ROUNDS]
import os
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "probes-s11"))
sys.path.insert(0, ".")
import steps  # noqa: E402

from benchmarks.e2e import make_prompt, model_tokenizer  # noqa: E402
from benchmarks.interleave import EngineTarget  # noqa: E402


def one_step_in_ramp(self):
    if self._solo is not None and self._waiting:
        self._hand_over()
    self._admit()
    if self._solo is not None:
        self._solo_step()
        return
    if self._prefills:
        self._prefill_step()
    if self._running and self._batch_step() and self.scheduled and self._running and not self._prefills:
        self._batch_step()


def join_in_eights(self):
    ready = [p for p in self._prefills if p.ready]
    if len(ready) < len(self._prefills) and len(ready) < self.prefill.batch_prompts:
        return  # others are still prefilling: wait for a group
    for p in ready:
        self._join(p)


def pick_unready(pick):
    return lambda prefills: pick([p for p in prefills if not p.ready])


if __name__ == "__main__":
    model, ns = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    path, tok = model_tokenizer(model)
    eights = os.environ.get("VARIANT") == "eights"
    base = EngineTarget("as is", model, None)
    ramp = EngineTarget("joins in eights" if eights else "one step in a ramp", model, None)
    if eights:
        import mlxrt.worker.prefill as prefill

        prefill.pick = pick_unready(prefill.pick)  # the held prompts are not prefilled again
        ramp.engine._join_ready = types.MethodType(join_in_eights, ramp.engine)
    else:
        ramp.engine.step = types.MethodType(one_step_in_ramp, ramp.engine)
    print(f"budget {base.engine.sizer.budget_ms} ms, decode_concurrency {base.engine.decode_concurrency}",
          flush=True)
    for r in range(rounds + 1):  # round 0 builds the shapes
        for n in ns:
            prompts = [make_prompt(tok, steps.PROMPT, start=1000 * r + 7 * i + 100 * n)[0] for i in range(n)]
            print(f"round {r}, {n} streams{' (warm-up)' if r == 0 else ''}:", flush=True)
            order = [base, ramp] if r % 2 else [ramp, base]
            steps.native(base.engine.model, prompts)
            for t in order:
                steps.engine(t, prompts, 0, t.name)
