"""The results of ``python -m benchmarks``: each scenario's figures and tokens, and the quality gate.

Figures are medians with their spread over rounds, x native paired per round; mlxrt's ids are checked
against native's (or native-batch's under concurrency), peers' agreement is reported, not gated.
"""

from __future__ import annotations

from typing import Any

from .measure import Run, agreement, diff_spread, ratio_spread, spread, text_agreement
from .report import NATIVE_BATCH
from .streams import Streams


class Results(Streams):
    """The per-scenario documents and the gate's verdict over the end-to-end and concurrency runs."""

    def scenario_doc(self, name: str, rs: list[Run]) -> dict[str, Any]:
        checked = self.checked.get(name, True)
        native = self.runs.get("native", [])
        tps = [r.decode_tps for r in rs]
        ttft = [r.ttft_ms for r in rs]
        paired = len(native) == len(rs) and name != "native"
        peaks = [r.peak_memory_bytes for r in rs if r.peak_memory_bytes]
        rss = [r.rss_peak_bytes for r in rs if r.rss_peak_bytes]
        doc: dict[str, Any] = {
            "token_checked": checked,
            "info": self.info.get(name, {}),
            "decode_tps": spread(tps),
            "ttft_ms": spread(ttft),
            "prompt_tps": spread([r.prompt_tps for r in rs]),
            "itl_p50_ms": spread([r.summary()["itl_p50_ms"] for r in rs]),
            "itl_p99_ms": spread([r.summary()["itl_p99_ms"] for r in rs]),
            "peak_memory_bytes": max(peaks) if peaks else None,
            "rss_peak_bytes": max(rss) if rss else None,
            "engine_decode_tps": spread([r.engine.get("decode_tps") or float("nan") for r in rs]),
            "engine_per_token_ms": spread([r.engine.get("per_token_ms") or float("nan") for r in rs]),
            "ratio_to_native": ratio_spread(tps, [r.decode_tps for r in native])
            if paired
            else (spread([1.0] * len(rs)) if name == "native" else None),
            "ttft_overhead_ms": diff_spread(ttft, [r.ttft_ms for r in native]) if paired else None,
            "runs": [r.summary() for r in rs],
        }
        if self.refs and len(rs) == len(self.refs):
            if name == "native":
                doc["tokens"] = {"identical": True, "reference": True}
            elif checked:
                checks = [
                    self.check_tokens(self.prompts[i], r.tokens, ref)
                    for i, (r, ref) in enumerate(zip(rs, self.refs, strict=True))
                ]
                doc["tokens"] = {
                    "identical": all(c["first_divergence"] is None for c in checks),
                    "passed": all(c["ok"] for c in checks),
                    "per_round": checks,
                }
            else:
                ag = [self.agreement(r, ref) for r, ref in zip(rs, self.refs, strict=True)]
                pcts = [a["agree_pct"] for a in ag if a["agree_pct"] is not None]
                doc["tokens"] = {
                    "agree_pct": min(pcts) if pcts else None,
                    "first_divergence": ag[0]["first_divergence"],
                    "basis": ag[0]["basis"],
                }
        return doc

    def agreement(self, run: Run, ref: list[int]) -> dict[str, Any]:
        if run.text is not None and not run.tokens:
            return text_agreement(self.tokenizer.decode, ref, run.text)
        if not run.tokens or min(run.tokens) < 0:  # a peer that returned neither ids nor text
            return {
                "agree_pct": None,
                "first_divergence": None,
                "basis": "none: the peer returned no ids or text",
            }
        return agreement(ref, run.tokens)


    def gate(self, scen: dict[str, Any]) -> dict[str, Any]:
        if self.ref is None:
            return {"passed": None, "checked": [], "mismatched": [], "why": "native did not run"}
        checked = [n for n, s in scen.items() if s["token_checked"] and n != "native"]
        bad = [n for n in checked if not scen[n].get("tokens", {}).get("passed")]
        unchecked = []
        streams: dict[str, dict[str, Any]] = {}  # per target and stream count: the streams that failed
        for name, levels in self.concurrency_runs.items():  # each stream must get its own prompt's tokens
            if not all(n in self.conc_refs for n in levels):
                unchecked.append(f"{name} under concurrency")  # no reference ids (a failed part, say)
                continue
            checked.append(f"{name} under concurrency")
            for n, rs in levels.items():
                batched = self.conc_ref_basis.get(n) == NATIVE_BATCH  # against native-batch's ids
                checks = [
                    {"stream": i, **self.check_tokens(prompt, r.tokens, ref, batched=batched)}
                    for i, (prompt, r, ref) in enumerate(zip(self.conc_prompts[n], rs, self.conc_refs[n],
                                                             strict=True))
                ]
                worst = [c["max_deficit"] for c in checks if "max_deficit" in c]
                streams.setdefault(name, {})[str(n)] = {
                    "failed": [c for c in checks if not c["ok"]],
                    "max_deficit": max(worst) if worst else None,  # teacher-forced checks only
                }
            if any(lv["failed"] for lv in streams[name].values()):
                bad.append(f"{name} under concurrency")
        if self.batch_checks:  # the reference itself: native-batch's streams are native's
            checked.append(f"{NATIVE_BATCH} under concurrency")
            if not all(c["ok"] for cs in self.batch_checks.values() for c in cs):
                bad.append(f"{NATIVE_BATCH} under concurrency")
        mode = self.token_gate.describe() if self.token_gate else {"mode": "identical ids"}
        if self.batch_gate is not None:
            mode["batched"] = self.batch_gate.describe()
        extra = {k: v for k, v in (("unchecked", unchecked), ("streams", streams)) if v}
        return {"passed": not bad, "checked": checked, "mismatched": bad, **mode, **extra}

