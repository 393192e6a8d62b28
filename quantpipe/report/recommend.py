"""What to ship: `recommended` per batch size (the fastest within the accuracy gate, never slower
than FP32, tails weighed) and the server configuration as code."""

from __future__ import annotations

from quantpipe import serving, tails, tasks
from quantpipe.report.summary import candidates_of, score_keys
from quantpipe.schemas.gates import GatesParams


def recommend(summary: dict, gates: GatesParams) -> dict[str, dict]:
    """The variant to ship per batch size: the fastest (its `best` configuration) among FP32 and
    the candidates (the INT8 variants and bf16) that did not fail their stage's check
    (`failed`), keep within gates.max_accuracy_drop_pp (or drop by what their test split cannot
    tell from noise: the gates' rule, task.drop_noise) and are no slower than
    FP32 in any measurement at that batch size — every thread count (on ONNX Runtime; bf16's on
    its runtime) and the best configurations against each other. FP32 when none is; `why` says
    what decided it."""
    fp32 = summary["fp32"]
    _, drop_key, unit, gate = score_keys(summary)
    task = tasks.for_summary(summary)
    recommended = {}
    for bs in fp32["latency_p50_ms"]:
        candidates, reasons = [], []
        for variant in candidates_of(summary):
            entry = summary[variant]
            speedups = {f"{count.removeprefix('threads')} thread(s)": row["speedup"][bs]
                        for count, row in entry["by_threads"].items()}
            speedups["best configurations"] = entry["best"]["latency"][bs]["speedup"]
            slower = {k: v for k, v in speedups.items() if v < 1.0}
            if "failed" in entry:
                reasons.append(f"{variant} failed its stage's check")
            elif entry[drop_key] > getattr(gates, gate) and not task.drop_noise(entry, gates):
                reasons.append(f"{variant} loses {entry[drop_key]:.2f} {unit} > gates.{gate}")
            elif slower:
                reasons.append(f"{variant} is slower than FP32 ("
                               + ", ".join(f"x{v:.2f} at {k}" for k, v in slower.items()) + ")")
            else:
                candidates.append(variant)
        pick, why = _fastest_then_most_accurate(summary, candidates, bs)
        best = summary[pick]["best"]["latency"][bs]
        row = {"variant": pick, "runtime": best["runtime"], "threads": best["threads"],
               **{k: best[k] for k in ("p50_ms", "p90_ms", "p99_ms")}}
        if pick != "fp32":
            row["speedup"] = best["speedup"]
        row["why"] = why if pick != "fp32" else ("; ".join(reasons) or "no quantized variant")
        recommended[bs] = row
    return recommended


def serve(summary: dict, benches: dict[str, dict]) -> dict:
    """The recommended configurations as the code that runs them (quantpipe.serving, from the
    settings each runtime recorded in metrics/bench/<variant>.json): `options` and `snippet` on
    each summary["recommended"] row (one session of its threads), and the server: the variant
    recommended at the largest batch at its best streams x threads, with its throughput."""
    def written(variant: str, runtime: str, streams: int, threads: int) -> dict:
        settings = benches[variant]["runtimes"][runtime]["settings"]
        model = f"models/{'fp32' if variant == 'bf16' else variant}.onnx"
        return {"options": serving.options(runtime, settings, streams, threads),
                "snippet": serving.snippet(runtime, settings, model, streams, threads)}

    recommended = summary["recommended"]
    for row in recommended.values():
        row.update(written(row["variant"], row["runtime"], 1, row["threads"]))
    largest = max(recommended, key=lambda bs: int(bs[2:]))
    variant = recommended[largest]["variant"]
    top = summary[variant]["best"]["throughput"]
    return {"variant": variant, "batch_size": int(largest[2:]), "runtime": top["runtime"],
            "streams": top["streams"], "threads": top["threads"], "ips": top["ips"],
            **({"speedup": top["speedup"]} if "speedup" in top else {}),
            **written(variant, top["runtime"], top["streams"], top["threads"])}


# Best latencies within this fraction of the fastest are the same speed: run-to-run noise at
# bs1 is about that (README), and a recommendation should not flip with it.
SAME_SPEED = tails.SAME_SPEED


def _fastest_then_most_accurate(summary: dict, candidates: list[str], bs: str) -> tuple[str, str]:
    """Among candidates as fast as the fastest (within SAME_SPEED), the most accurate; unless
    its tail is loose and a candidate ranks before it by tails.pace (tails.choose)."""
    if not candidates:
        return "fp32", ""
    best = {v: summary[v]["best"]["latency"][bs] for v in candidates}
    p50 = {v: b["p50_ms"] for v, b in best.items()}
    fastest = min(p50, key=p50.get)
    tied = [v for v in candidates if p50[v] <= p50[fastest] * (1 + SAME_SPEED)]
    key = score_keys(summary)[0]
    pick = max(tied, key=lambda v: (summary[v][key], -p50[v]))
    among = ("of the variants within the accuracy gate and faster than FP32 everywhere ("
             + ", ".join(candidates) + ")")
    steady = tails.choose(candidates, p50=p50.get, p99=lambda v: best[v]["p99_ms"], pick=pick)
    if steady != pick:
        tail = tails.describe(p50[pick], best[pick]["p99_ms"])
        # steady's own tail is tight, or loose but shorter than pick's (tails.pace ranked it first).
        kind = "tight" if tails.tight(p50[steady], best[steady]["p99_ms"]) else "shorter"
        as_fast = p50[steady] <= p50[pick] * (1 + SAME_SPEED)
        if p50[steady] <= p50[pick] or kind == "tight" and as_fast:
            return steady, (f"as fast as {pick} (within {SAME_SPEED:.0%}) with a {kind} tail "
                            f"({pick}'s {tail}), {among}")
        return steady, (f"{pick} is faster at the median but its tail is loose ({tail}); ranked "
                        f"by a third of that p99, {steady} comes first {among}")
    if pick == fastest:
        return pick, f"the fastest {among}"
    return pick, (f"as fast as {fastest} (within {SAME_SPEED:.0%}) and more accurate "
                  f"({summary[pick][key]:.4f} vs {summary[fastest][key]:.4f}), {among}")
