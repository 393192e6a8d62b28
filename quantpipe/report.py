"""The summary of all variants (metrics/summary.json, its keys in docs/results.md), report.md and the
gates."""

from __future__ import annotations

from quantpipe import serving, tails
from quantpipe.profiling import describe_profile
from quantpipe.errors import UserError
from quantpipe.machine import describe
from quantpipe.schemas.gates import GatesParams

QUANTIZED = ("dynamic", "static", "qat")
# What may be shipped instead of FP32: the INT8 variants and the FP32 file computed in BF16.
CANDIDATES = (*QUANTIZED, "bf16")
# Top-level summary keys that are not model rows.
RECORDS = ("machine", "runtimes", "skipped", "recommended", "server", "task")
# Below this FP32 latency (ms) per-run overhead, not arithmetic, decides INT8 vs FP32.
TINY_MODEL_MS = 0.05
# A quantized model that keeps more than this share of its multiply-accumulates in float
# (quantize_static.json: mac_share_int8) computes mostly in float: that, not its kernels, is
# why it is not faster.
MOSTLY_FLOAT = 0.5


# The task's score, its drop against FP32 and the drop's unit and gate (summary["task"]).
SCORES = {"classification": ("accuracy", "accuracy_drop_pp", "pp", "max_accuracy_drop_pp"),
          "detection": ("map_50_95", "map_drop_pts", "points", "max_map_drop_pts")}


def score_keys(summary: dict) -> tuple[str, str, str, str]:
    return SCORES[summary.get("task", "classification")]


def build_summary(evals: dict[str, dict], benches: dict[str, dict],
                  torch_bench: dict | None = None, failed: dict[str, str] | None = None) -> dict:
    """summary.json: per variant accuracy, size, latency and, against FP32 ONNX, drop, agreement,
    size ratio and speedup; throughput with every core busy; memory of a fresh process. Also
    the PyTorch eager baseline `torch` and the `machine` that measured it all.

    latency_p50_ms/speedup are those at the first thread count benched (bench.threads; all
    cores by default); by_threads has every thread count. A variant whose stage skipped (its
    evaluate JSON says `skipped`) has no row, only its reason under `skipped`. A variant its
    stage wrote but recorded as failed (`failed`: {variant: reason}; a static model out of the
    criterion, a QAT export without parity) has its row, with the reason under `failed`.
    """
    skipped = {v: ev["skipped"] for v, ev in evals.items() if "skipped" in ev}
    evals = {v: ev for v, ev in evals.items() if v not in skipped}
    machine, threads = bench_setup({v: b for v, b in benches.items() if v not in skipped})
    fp32 = evals["fp32"]
    reference = next((name for name, e in benches["fp32"].get("runtimes", {}).items()
                      if e.get("reference")), "onnxruntime")
    detection = "map_50_95" in fp32
    summary: dict = {"task": "detection"} if detection else {}
    for variant, ev in evals.items():
        b = benches[variant]
        score = {k: ev[k] for k in ("map_50_95", "map_50", "map_75", "per_class_ap")} \
            if detection else {"accuracy": ev["accuracy"]}
        entry = {**score, "size_bytes": ev["size_bytes"],
                 **_latency(b["latency"], threads, with_speedup=variant != "fp32")}
        if "end_to_end" in b:  # a detector's model + decode + NMS
            entry["end_to_end"] = _latency(b["end_to_end"], threads, with_speedup=variant != "fp32")
        best = b["throughput"]["best"]
        entry.update({"throughput_ips": best["ips"],
                      "throughput_config": {"streams": best["streams"], "threads": best["threads"]}})
        if "memory" in b:  # ONNX Runtime's process (the bf16 row runs on another engine)
            entry.update({"peak_rss_mb": b["memory"]["peak_rss_mb"], "load_ms": b["memory"]["load_ms"]})
        if b.get("runtime", reference) != reference:
            # The bf16 row: its latency keys are this engine's, in this precision.
            entry.update({"runtime": b["runtime"], "inference_precision": ev["inference_precision"]})
            if "failed" in b["runtimes"][b["runtime"]]:  # it disagrees with FP32 beyond parity
                entry["failed"] = b["runtimes"][b["runtime"]]["failed"]
        if variant != "fp32":
            entry.update({
                **({"map_drop_pts": ev["map_drop_pts"]} if detection else
                   {"accuracy_drop_pp": round((fp32["accuracy"] - ev["accuracy"]) * 100, 4)}),
                "agreement": ev["agreement"],
                "size_ratio": round(ev["size_bytes"] / fp32["size_bytes"], 4),
                # Each side at its own best configuration, FP32 timed in the same rounds.
                "throughput_speedup": b["throughput"]["speedup"]})
        # The fastest engine and setting; the other engines' figures (ONNX Runtime's are the
        # keys above).
        entry["best"] = b["best"]
        if "speedup_vs_bf16" in next(iter(b["best"]["latency"].values())):
            # INT8 at its best against the FP32 file in BF16 at its best, in the same rounds.
            entry["speedup_vs_bf16"] = {bs: r["speedup_vs_bf16"] for bs, r in b["best"]["latency"].items()}
            if "throughput" in b["best"]:
                entry["throughput_speedup_vs_bf16"] = b["best"]["throughput"]["speedup_vs_bf16"]
        entry["kernels"] = b.get("kernels", {})
        entry["runtimes"] = {name: _engine_entry(e, threads) for name, e in b["runtimes"].items()
                             if not e.get("reference")}
        if variant in (failed or {}):
            entry["failed"] = failed[variant]
        summary[variant] = entry
    if torch_bench is not None:
        # PyTorch eager vs FP32 ONNX: a speedup below 1 means the ONNX export alone is faster.
        score = ("map_50_95", "map_50") if detection else ("accuracy",)
        summary["torch"] = {**{k: torch_bench[k] for k in score},
                            "size_bytes": torch_bench["size_bytes"],
                            **_latency(torch_bench["latency"], threads, with_speedup=True)}
    summary["machine"] = machine
    # The engines by name and title, the reference (the one the keys above are of) first.
    engines = {name: e for b in benches.values() if "runtimes" in b for name, e in b["runtimes"].items()}
    summary["runtimes"] = {name: e["title"] for name, e in
                           sorted(engines.items(), key=lambda item: not item[1].get("reference"))}
    if skipped:
        summary["skipped"] = skipped
    return summary


def _engine_entry(engine: dict, threads: list[int]) -> dict:
    """A non-reference engine on one variant, for the summary: latency (and speedup against FP32
    on ONNX Runtime from the same rounds) at the headline thread count and by_threads at each,
    its best throughput, parity with ONNX Runtime and, when it is not trusted, why."""
    out: dict = {}
    if "latency" in engine:
        out.update(_latency(engine["latency"], threads, with_speedup=True))
        top = engine["throughput"]["best"]
        out.update({"throughput_ips": top["ips"],
                    "throughput_config": {"streams": top["streams"], "threads": top["threads"]},
                    "throughput_speedup": engine["throughput"]["speedup"]})
    if "parity" in engine:
        out["parity"] = {k: engine["parity"][k] for k in ("agreement", "max_abs_diff", "mean_abs_diff")}
    if "failed" in engine:
        out["failed"] = engine["failed"]
    return out


def variants_of(summary: dict) -> dict[str, dict]:
    """The model rows of a summary (every variant and torch), without `machine` and `skipped`."""
    return {name: entry for name, entry in summary.items() if name not in RECORDS}


def quantized_of(summary: dict) -> list[str]:
    """The quantized variants that have a row (a skipped one has none)."""
    return [v for v in QUANTIZED if v in summary]


def candidates_of(summary: dict) -> list[str]:
    """What may be recommended instead of FP32 and has a row: the INT8 variants and bf16."""
    return [v for v in CANDIDATES if v in summary]


def bench_setup(benches: dict[str, dict]) -> tuple[dict, list[int]]:
    """The machine and thread counts every bench JSON shares (the first count is the headline).

    They are all made from one metrics/machine.json and one params.yaml; a mismatch means a
    file was edited or copied from elsewhere.
    """
    (first, ref), *others = benches.items()
    for name, b in others:
        if b.get("machine") != ref.get("machine") or b.get("threads") != ref.get("threads"):
            raise UserError(f"metrics/bench/{name}.json and metrics/bench/{first}.json were measured "
                            "on different machines or thread counts; re-run them with `dvc repro`")
    return ref["machine"], ref["threads"]


def _latency(rows_by_threads: dict[str, dict], threads: list[int], with_speedup: bool) -> dict:
    """latency_p50_ms, _p90_ms, _p99_ms (and speedup) at threads[0], and by_threads for every
    thread count."""
    by_threads = {}
    for count in threads:
        rows = rows_by_threads[f"threads{count}"]  # {"bs1": {...}, ...}
        # The tail beside the median: what the slowest requests of a server wait.
        entry = {f"latency_{q}_ms": {bs: r[f"{q}_ms"] for bs, r in rows.items()}
                 for q in ("p50", "p90", "p99")}
        if with_speedup:
            # Measured against FP32 in the same interleaved rounds (see stages/bench.py):
            # speedup = baseline_p50_ms / latency_p50_ms, FP32's median from those rounds, which
            # differs from FP32's own bench by the machine's drift between the two runs.
            entry["speedup"] = {bs: r["speedup"] for bs, r in rows.items()}
            entry["baseline_p50_ms"] = {bs: r["baseline_p50_ms"] for bs, r in rows.items()}
        by_threads[f"threads{count}"] = entry
    return {**by_threads[f"threads{threads[0]}"], "by_threads": by_threads}


def recommend(summary: dict, gates: GatesParams) -> dict[str, dict]:
    """The variant to ship per batch size: the fastest (its `best` configuration) among FP32 and
    the candidates (the INT8 variants and bf16) that did not fail their stage's check
    (`failed`), keep within gates.max_accuracy_drop_pp and are no slower than
    FP32 in any measurement at that batch size — every thread count (on ONNX Runtime; bf16's on
    its engine) and the best configurations against each other. FP32 when none is; `why` says
    what decided it."""
    fp32 = summary["fp32"]
    _, drop_key, unit, gate = score_keys(summary)
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
            elif entry[drop_key] > getattr(gates, gate):
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
    settings each engine recorded in metrics/bench/<variant>.json): `options` and `snippet` on
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
    its tail is loose and a candidate as fast as it has a tight one (tails.choose)."""
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
        return steady, (f"as fast as {pick} (within {SAME_SPEED:.0%}) with a tight tail ({pick}'s "
                        f"{tails.describe(p50[pick], best[pick]['p99_ms'])}), {among}")
    if pick == fastest:
        return pick, f"the fastest {among}"
    return pick, (f"as fast as {fastest} (within {SAME_SPEED:.0%}) and more accurate "
                  f"({summary[pick][key]:.4f} vs {summary[fastest][key]:.4f}), {among}")


def check_gates(summary: dict, gates: GatesParams) -> list[str]:
    """Human-readable gate failures; empty when all gates hold."""
    return list(gate_failures(summary, gates).values())


def gate_failures(summary: dict, gates: GatesParams) -> dict[str, str]:
    """The failed gates, '<variant> <gates key>' -> what failed: the key says which gate failed
    for which variant whatever the figures (`make gate` compares two revisions' keys)."""
    failures = {f"{variant} failed": f"{variant} failed: {summary[variant]['failed']}"
                for variant in quantized_of(summary) if "failed" in summary[variant]}
    _, drop_key, unit, gate = score_keys(summary)
    for variant in quantized_of(summary):
        drop = summary[variant][drop_key]
        if drop > getattr(gates, gate):
            failures[f"{variant} gates.{gate}"] = (
                f"{variant} {'mAP' if unit == 'points' else 'accuracy'} drop "
                f"{drop:.2f} {unit} > gates.{gate} = {getattr(gates, gate)}"
                + (f"; {DETECTION_INVESTIGATION}" if unit == "points" else ""))
    speedups = summary["static"]["speedup"]
    largest = max(speedups, key=lambda k: int(k[2:]))
    if speedups[largest] < gates.min_static_speedup:
        failures["static gates.min_static_speedup"] = (
            f"static speedup x{speedups[largest]:.2f} at {largest} < "
            f"gates.min_static_speedup = {gates.min_static_speedup}")
    if gates.max_peak_rss_mb is not None:
        for variant, entry in variants_of(summary).items():
            peaks = entry.get("peak_rss_mb", {})
            worst = max(peaks, key=peaks.get, default=None)
            if worst is not None and peaks[worst] > gates.max_peak_rss_mb:
                failures[f"{variant} gates.max_peak_rss_mb"] = (
                    f"{variant} peak RSS {peaks[worst]:.1f} MB at {worst} > "
                    f"gates.max_peak_rss_mb = {gates.max_peak_rss_mb}")
    return failures


# The guides' order of investigation when a detector loses more than the tolerance.
DETECTION_INVESTIGATION = (
    "investigate in this order: calibration data that does not match the test distribution "
    "(prepare.calib_size, the calibration warning in metrics/quantize_static.json), "
    "quantize_static.per_channel, the first/last layers in float "
    "(quantize_static.nodes_to_exclude), then QAT")


def tolerance_notes(summary: dict, gates: GatesParams) -> list[str]:
    """Detection's tolerance table: a drop between gates.warn_map_drop_pts and the gate passes
    with a warning (report.md)."""
    if summary.get("task") != "detection":
        return []
    return [f"{v} loses {summary[v]['map_drop_pts']:.2f} points of mAP@[.5:.95]: acceptable "
            f"(between {gates.warn_map_drop_pts} and {gates.max_map_drop_pts}), but check it; "
            f"{DETECTION_INVESTIGATION}" for v in quantized_of(summary)
            if gates.warn_map_drop_pts < summary[v]["map_drop_pts"] <= gates.max_map_drop_pts]


def slowdown_notes(summary: dict, evals: dict[str, dict], machine: dict,
                   profiles: dict[str, dict] | None = None,
                   stages: dict[str, dict] | None = None) -> list[str]:
    """One line per quantized variant that is slower than FP32 somewhere, saying why; and one
    per variant that keeps most of its MACs in float, whatever its speed, since that is why it
    cannot be much faster.

    profiles: variant -> the kernel_profile of its bench JSON (optional), the evidence for a
    slowdown that no setting explains. stages: variant -> its quantize stage's metrics
    (optional; quantize_static.json's mac_share_int8 and macs_by_op_type).
    """
    notes = []
    flags = machine.get("cpu_flags", {})
    for variant in quantized_of(summary):
        stage = (stages or {}).get(variant, {})
        mostly_float = float_compute_note(variant, summary[variant], stage)
        if mostly_float:
            notes.append(mostly_float)
            continue
        slow = [k for k, v in summary[variant]["speedup"].items() if v < 1.0]
        if not slow:
            continue
        ops = evals[variant].get("ops", {})
        level = evals[variant].get("graph_optimization_level", "")
        if not (flags.get("avx512_vnni") or flags.get("avx_vnni")):
            why = "this CPU has no VNNI, so INT8 dot products are not faster than FP32"
        elif ops.get("ConvInteger"):
            why = "ConvInteger (dynamic quantization of Conv) is slow on x86; keep Conv out of quantize_dynamic.op_types"
        elif level in ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC"):
            why = f"QDQ pairs are fused into QLinear kernels only at ORT_ENABLE_EXTENDED or above (runtime is {level})"
        else:
            # Per batch size: a microsecond model loses to fixed costs, a larger one to its kernels.
            fp32_ms = summary["fp32"]["latency_p50_ms"]
            tiny = [k for k in slow if fp32_ms[k] < TINY_MODEL_MS]
            rest = [k for k in slow if k not in tiny]
            parts = []
            if tiny:
                parts.append(f"at {', '.join(tiny)} the FP32 model takes only microseconds, so the "
                             "fixed cost of quantizing the input and dequantizing the output "
                             "outweighs the faster INT8 kernels")
            if rest:
                parts.append(f"at {', '.join(rest)} " + _kernel_cause(variant, profiles or {}))
            why = "; ".join(parts)
        # What its stage measured: the INT8 kernels had the arithmetic to gain on.
        if stage.get("mac_share_int8") is not None:
            why += f" ({stage['mac_share_int8']:.1%} of its MACs run in INT8)"
        notes.append(f"{variant} is slower than FP32 at {', '.join(slow)}: {why}.")
    return notes


def float_compute_note(variant: str, entry: dict, stage: dict) -> str | None:
    """'static keeps 98% of its MACs in float (Conv 98%, MatMul 2%) ...': the measured reason a
    quantized model is not faster, when its stage recorded that most of its multiply-accumulates
    run in float (mac_share_int8 below 1 - MOSTLY_FLOAT); None otherwise."""
    share = stage.get("mac_share_int8")
    if share is None or 1 - share <= MOSTLY_FLOAT:
        return None
    by_op = ", ".join(f"{op} {s:.0%}" for op, s in stage.get("macs_by_op_type", {}).items())
    speed = ", ".join(f"x{v:.2f} at {bs}" for bs, v in entry["speedup"].items())
    types = ", ".join(stage.get("op_types_to_quantize") or []) or "every op type"
    why = f" ({stage['op_selection']})" if stage.get("op_selection") else ""
    return (f"{variant} keeps {1 - share:.0%} of its MACs in float ({by_op} of its MACs), so INT8 "
            f"can speed up at most the other {share:.0%} of its arithmetic ({speed} against "
            f"FP32): quantize_static.json's op_types_to_quantize is {types}{why}, "
            f"{len(stage.get('nodes_in_float', []))} compute node(s) in float (nodes_in_float).")


def thread_scaling_notes(summary: dict) -> list[str]:
    """One line per quantized variant whose speedup at the largest batch shrinks by more than
    10% from one thread to the headline thread count, with the throughput configuration that
    keeps the gain when every core is busy."""
    notes = []
    for variant in quantized_of(summary):
        entry = summary[variant]
        by_threads = entry["by_threads"]
        counts = [int(k.removeprefix("threads")) for k in by_threads]
        if 1 not in counts or counts[0] == 1:
            continue
        largest = max(entry["speedup"], key=lambda k: int(k[2:]))
        one, many = by_threads["threads1"]["speedup"][largest], entry["speedup"][largest]
        if many >= 0.9 * one:
            continue
        config = entry["throughput_config"]
        advice = (": serve concurrent requests from several sessions rather than one session "
                  "with every thread" if config["streams"] > 1 else "")
        curve = ", ".join(f"x{by_threads[f'threads{c}']['speedup'][largest]:.2f} at {c}"
                          for c in sorted(counts))
        notes.append(
            f"{variant} gains less with more threads: {curve} threads ({largest}), because "
            "FP32's kernels parallelize better than its "
            f"INT8 kernels (compare the kernel profiles). With every core busy, "
            f"{_config(config)} reach x{entry['throughput_speedup']:.2f} FP32's best "
            f"throughput{advice}.")
    return notes


def _kernel_cause(variant: str, profiles: dict[str, dict]) -> str:
    """Why a variant loses where the FP32 model is not tiny, with the bench profile as evidence."""
    profile, fp32 = profiles.get(variant), profiles.get("fp32")
    measured = bool(profile and profile["top_nodes"] and fp32 and profile["kernel_ms"])
    if variant == "dynamic":
        if not measured:
            return ("dynamic quantization re-quantizes activations every run; it pays off on "
                    "MatMul-heavy models")
        int8_ms = sum(ms for op, ms in profile["by_op_ms"].items()
                      if op.startswith("DynamicQuantize") or "Integer" in op)
        return (f"only {int8_ms / profile['kernel_ms']:.0%} of its kernel time (profiled at "
                f"bs{profile['batch_size']}) is in INT8 kernels, so there is little to gain while "
                "activations are re-quantized every run; dynamic quantization pays off on "
                "MatMul-heavy models")
    advice = ("INT8 kernels gain little on layers with little arithmetic per value, and a first "
              "Conv on few input channels (one, for grey images) can be slower than float; check "
              "quantize_static.activation_type (QUInt8 is the fast x86 path) and README, "
              "Troubleshooting")
    if not measured:
        return advice
    # Where the time goes, measured: the INT8 convolutions and matrix products against FP32's
    # float ones, and the op types that take the rest (elementwise INT8 ops such as a SiLU's
    # QLinearSigmoid/QLinearMul, layout changes, the float decode).
    compute = lambda by_op: sum(ms for op, ms in by_op.items() if _heavy(op))  # noqa: E731
    total, heavy, fp32_heavy = profile["kernel_ms"], compute(profile["by_op_ms"]), compute(fp32["by_op_ms"])
    others = sorted(((ms, op) for op, ms in profile["by_op_ms"].items() if not _heavy(op)),
                    reverse=True)
    rest = ", ".join(f"{op} {ms / total:.0%}" for ms, op in others[:3])
    where = (f"profiled at bs{profile['batch_size']}: {total:.2f} ms of kernels, FP32's "
             f"{fp32['kernel_ms']:.2f} ms")
    if heavy >= fp32_heavy:
        top = profile["top_nodes"][0]
        return (f"its INT8 convolutions and matrix products themselves take longer than FP32's "
                f"({heavy:.2f} ms against {fp32_heavy:.2f} ms, {where}; its slowest kernel is "
                f"{top['op']} {top['node']!r}, {top['ms']:.2f} ms); {advice}")
    return (f"its convolutions and matrix products take {heavy:.2f} ms in INT8 against FP32's "
            f"{fp32_heavy:.2f} ms, but only {heavy / total:.0%} of its kernel time ({where}): "
            f"the rest ({rest}) is ops with little arithmetic per value, where INT8 gains nothing "
            "or costs (re)quantizing; a model this small spends its time there, a larger one in "
            "its convolutions")


# Op types whose arithmetic INT8 speeds up (ORT's names after its graph optimizations).
HEAVY_OPS = {"Conv", "FusedConv", "QLinearConv", "ConvInteger", "Gemm", "FusedGemm", "QGemm",
             "MatMul", "FusedMatMul", "QLinearMatMul", "MatMulInteger", "MatMulIntegerToFloat"}


def _heavy(op: str) -> bool:
    """An op type of convolution or matrix-product arithmetic (its QLinear/QGemm variants too)."""
    return op in HEAVY_OPS or op.startswith(("QLinearConv", "QGemm"))


def render_markdown(summary: dict, notes: list[str], profiles: dict[str, dict] | None = None) -> str:
    """report.md: where it was measured, the headline table (first thread count), latency by
    thread count, throughput with every core busy, memory, kernel time and slowdown notes."""
    machine = summary["machine"]
    rows = variants_of(summary)
    threads = [int(k.removeprefix("threads")) for k in rows["fp32"]["by_threads"]]
    sizes = sorted(rows["fp32"]["latency_p50_ms"], key=lambda k: int(k[2:]))
    text = ["# quantpipe results", "", precision_line(summary, sizes), "",
            f"Measured on {describe(machine)}. Speedups are measured against FP32 in the same "
            "interleaved rounds, on this machine only.", "",
            *_kernel_lines(summary),
            *_recommendation(summary, notes),
            *_server_section(summary),
            f"## {_threads_title(threads[0], machine)}", "",
            *_headline_table(rows, sizes), "",
            *_routes_section(summary, sizes), "",
            "## Latency by thread count", "",
            *_threads_table(rows, threads, sizes)]
    onnx_rows = {v: s for v, s in rows.items() if "throughput_ips" in s}  # not torch
    text += ["", *_throughput_section(onnx_rows, machine)]
    text += ["", *_engines_section(onnx_rows, sizes, threads[0], summary["runtimes"])]
    text += ["", *_memory_section({v: r for v, r in onnx_rows.items() if "load_ms" in r}, sizes,
                                  threads[0])]
    text += ["", *_kernels_section(rows, summary["runtimes"])]
    if profiles:
        # Where the time goes, from one ORT profile per variant (metrics/bench/<variant>.json).
        first = next(iter(profiles.values()))
        text += ["", f"Kernel time at bs{first['batch_size']} ({first['threads']} thread(s), ORT "
                 "profile): " + "; ".join(f"{v} {describe_profile(p)}" for v, p in profiles.items())
                 + "."]
    return "\n".join(text) + "\n"


def precision_line(summary: dict, sizes: list[str]) -> str:
    """report.md's first line: on this machine, does INT8 pay over BF16 (the FP32 file computed
    in BF16, no calibration), and by how much; each side at its best engine and setting."""
    flags = summary["machine"].get("cpu_flags", {})
    isa = ", ".join(f for f in ("amx_int8", "amx_bf16", "avx512_bf16", "avx512_vnni", "avx_vnni")
                    if flags.get(f)) or "no VNNI, AMX or BF16"
    if "bf16" not in summary:
        why = summary.get("skipped", {}).get("bf16", "no bf16 row")
        return (f"**INT8 against BF16 on this machine** ({isa}): not measured, {why}; INT8 is "
                "weighed against FP32 only.")
    smallest, largest = sizes[0], sizes[-1]
    bf16 = summary["bf16"]
    drop_key, unit = score_keys(summary)[1:3]
    base = (f"BF16 (the FP32 file on {summary['runtimes'][bf16['runtime']]}, no calibration) "
            f"runs x{bf16['best']['latency'][largest]['speedup']:.2f} the best FP32 at {largest} "
            f"and loses {bf16[drop_key]:.2f} {unit}")
    if bf16.get("inference_precision", "bf16") != "bf16":  # the flags said BF16, the engine did not
        base += f" (but {summary['runtimes'][bf16['runtime']]} ran it in {bf16['inference_precision']})"
    int8 = [v for v in QUANTIZED if "speedup_vs_bf16" in summary.get(v, {})
            and "failed" not in summary[v]]
    if not int8:
        return (f"**INT8 against BF16 on this machine** ({isa}): {base}; no INT8 variant passed "
                "its checks to compare with it.")
    top = max(int8, key=lambda v: summary[v]["speedup_vs_bf16"][largest])
    gain = summary[top]["speedup_vs_bf16"][largest]
    verdict = (f"INT8 pays over BF16: {top} runs x{gain:.2f} BF16's best" if gain > 1 + SAME_SPEED
               else f"INT8 does not pay over BF16: the fastest, {top}, runs x{gain:.2f} BF16's best")
    each = "; ".join(f"{v} x{summary[v]['speedup_vs_bf16'][largest]:.2f} at {largest}"
                     + (f", x{summary[v]['speedup_vs_bf16'][smallest]:.2f} at {smallest}"
                        if smallest != largest else "") for v in int8)
    return (f"**INT8 against BF16 on this machine** ({isa}): {verdict} at {largest} ({each}). "
            f"{base}. Each side at its best engine and setting, timed in the same rounds.")


def kernel_isas(kernels: dict[str, dict]) -> dict[str, list[str]]:
    """{"convolutions": [ISA, ...], "matrix multiplies": [...]} of one engine's kernels (as
    bench records them: base.kernel_table)."""
    out: dict[str, list[str]] = {}
    for k in kernels.values():
        kind = "convolutions" if "Conv" in k["layer"] else "matrix multiplies"
        if k["isa"] not in out.setdefault(kind, []):
            out[kind].append(k["isa"])
    return out


def _kernel_lines(summary: dict) -> list[str]:
    """What ran the shipped kinds of model: per engine, the instruction sets of static INT8's
    (else the first INT8 variant's) and bf16's convolutions and matrix multiplies."""
    titles = summary["runtimes"]
    parts = []
    for variant, label in ((next((v for v in ("static", *QUANTIZED) if v in summary), None), "INT8"),
                           ("bf16", "BF16")):
        for name, kernels in summary.get(variant, {}).get("kernels", {}).items() if variant else ():
            isas = kernel_isas(kernels)
            if isas:
                ran = " and ".join(f"{kind} ran on " + ", ".join(i) for kind, i in isas.items())
                parts.append(f"{label} {ran} under {titles[name]}")
    return [f"**Kernels**: {'; '.join(parts)} (every kernel: Kernels, below).", ""] if parts else []


def _kernels_section(rows: dict[str, dict], titles: dict[str, str]) -> list[str]:
    body = [[variant, titles[name], k["layer"], f"`{k['kernel']}`", k["precision"], k["isa"],
             str(k["count"])]
            for variant, s in rows.items() for name, kernels in s.get("kernels", {}).items()
            for k in kernels.values()]
    if not body:
        return []
    return ["## Kernels (largest batch, latency configuration)", "",
            *markdown_table(["variant", "engine", "layer", "kernel", "precision", "ISA", "count"], body), "",
            "OpenVINO names the kernel each layer ran (its executed graph); ONNX Runtime's profile "
            "names op kernels, and the MLAS routine and instruction set follow from the node and "
            "this CPU's flags (docs/precision.md)."]


def threads_curve(summary: dict, bs: str) -> list[dict]:
    """Plot data: one row per thread count benched, one column `<variant>_<engine>` per INT8
    variant (and bf16) and engine, its speedup over FP32 on the reference engine at the same
    thread count and batch size `bs` (null where it was not timed)."""
    reference = next(iter(summary["runtimes"]))
    columns: dict[str, dict] = {}
    for variant in candidates_of(summary):
        s = summary[variant]
        columns[f"{variant}_{s.get('runtime', reference)}"] = s["by_threads"]
        for name, e in s["runtimes"].items():
            if "by_threads" in e:
                columns[f"{variant}_{name}"] = e["by_threads"]
    counts = sorted(int(k.removeprefix("threads")) for k in summary["fp32"]["by_threads"])
    return [{"threads": count,
             **{col: by.get(f"threads{count}", {}).get("speedup", {}).get(bs)
                for col, by in sorted(columns.items())}} for count in counts]


# The columns of threads_curve that dvc.yaml's threads plots name: a plot whose named column is
# missing is dropped, so each is written, null when not timed.
CURVE_COLUMNS = ("dynamic_onnxruntime", "dynamic_openvino", "static_onnxruntime", "static_openvino",
                 "qat_onnxruntime", "qat_openvino", "bf16_openvino")


def _server_section(summary: dict) -> list[str]:
    srv = summary.get("server")
    if not srv:
        return []
    gain = f", x{srv['speedup']:.2f} FP32's best" if "speedup" in srv else ""
    return [f"**Serve it** (`{srv['variant']}` at bs{srv['batch_size']}, the best streams x threads "
            f"measured: {_setting(srv, summary['runtimes'])}, {srv['ips']:,.0f} images/s{gain}; "
            "summary.json `server`, and each recommended row's `snippet`):", "",
            "```python", srv["snippet"], "```", ""]


def _recommendation(summary: dict, notes: list[str]) -> list[str]:
    """The first lines: what to ship per batch size, then every note on INT8 that does not pay
    (or gains less than it could) with its evidence."""
    lines = recommended_lines(summary)
    if notes:
        lines += (["", "**Where INT8 does not pay (or pays less)**:", ""] if lines else []) \
            + [f"- {n}" for n in notes]
    return [*lines, ""] if lines else []


def recommended_lines(summary: dict) -> list[str]:
    """What to ship per batch size and why, and the variants that failed their stage's check:
    the head of report.md, and of the review comment on a pull request."""
    lines = []
    titles = summary["runtimes"]
    for bs, r in summary.get("recommended", {}).items():
        where = f"{titles[r['runtime']]}, {r['threads']} thread{'s' * (r['threads'] != 1)}"
        gain = f", x{r['speedup']:.2f} the best FP32" if "speedup" in r else ""
        lines.append(f"- **{bs}: ship `{r['variant']}`** ({where}, p50 {r['p50_ms']:.3f} ms, "
                     f"{tails.describe(r['p50_ms'], r['p99_ms'])}{gain}): {r['why']}.")
    if lines:
        lines = [f"**Recommended** (by latency, within `gates.{score_keys(summary)[3]}`, never "
                 "slower than FP32):", "", *lines]
    failed = {v: summary[v]["failed"] for v in candidates_of(summary) if "failed" in summary[v]}
    if failed:
        lines += ["", "**Failed** (measured below, left out of the recommendation; the gates "
                  "fail on it):", "", *[f"- `{v}`: {why}" for v, why in failed.items()]]
    return lines


def _threads_title(count: int, machine: dict) -> str:
    cores = machine.get("cores")
    return (f"{count} intra-op thread{'s' * (count != 1)} "
            f"({'all cores' if count == cores else f'of {cores} cores'})")


def markdown_table(head: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *["| " + " | ".join(cells) + " |" for cells in body]]


def _headline_table(rows: dict[str, dict], sizes: list[str]) -> list[str]:
    detection = "map_50_95" in rows["fp32"]
    head = (["variant", "mAP@[.5:.95]", "mAP@.5", "drop (points)", "detection agreement"]
            if detection else ["variant", "accuracy", "drop (pp)", "agreement"])
    head += ["size (MB)", "size ratio"]
    head += [f"p50 {k} (ms)" for k in sizes] + [f"p99 {k} (ms)" for k in sizes]
    head += [f"speedup {k}" for k in sizes]
    if detection:
        head += [f"end to end speedup {k}" for k in sizes]
    body = []
    for variant, s in rows.items():
        name = f"{variant} (failed)" if "failed" in s else variant
        cells = [name, f"{s['map_50_95']:.4f}", f"{s['map_50']:.4f}",
                 _fmt(s.get("map_drop_pts"), ".2f")] if detection else \
            [name, f"{s['accuracy']:.4f}", _fmt(s.get("accuracy_drop_pp"), ".2f")]
        cells += [_fmt(s.get("agreement"), ".4f"), f"{s['size_bytes'] / 1e6:.2f}",
                  _fmt(s.get("size_ratio"), ".3f")]
        cells += [_fmt(s["latency_p50_ms"].get(k), ".3f") for k in sizes]
        cells += [_fmt(s.get("latency_p99_ms", {}).get(k), ".3f") for k in sizes]
        cells += [_fmt(s.get("speedup", {}).get(k), ".2f", prefix="x") for k in sizes]
        if detection:  # torch has no end-to-end row: its decode would be the variants' code
            cells += [_fmt(s.get("end_to_end", {}).get("speedup", {}).get(k), ".2f", prefix="x")
                      for k in sizes]
        body.append(cells)
    return markdown_table(head, body)


# The practitioners' comparison: the PyTorch model, its ONNX export, and INT8 by post-training
# quantization and by quantization-aware training.
ROUTES = (("torch", "FP32 PyTorch", "models/model.pt"), ("fp32", "FP32 ONNX", "models/fp32.onnx"),
          ("static", "INT8 ONNX, post-training (PTQ)", "models/static.onnx"),
          ("qat", "INT8 ONNX, quantization-aware training (QAT)", "models/qat.onnx"))


def _routes_section(summary: dict, sizes: list[str]) -> list[str]:
    largest = sizes[-1]
    score = score_keys(summary)[0]
    head = ["model", "file", score, "size (MB)"] + [f"p50 {k} (ms)" for k in sizes] + \
        [f"speed vs FP32 ONNX, {largest}"]
    body, missing = [], []
    for key, title, path in ROUTES:
        s = summary.get(key)
        if s is None:
            why = summary.get("skipped", {}).get(key, "no PyTorch model (brought as ONNX)")
            missing.append(f"{title}: {why}.")
            continue
        speed = 1.0 if key == "fp32" else s["speedup"][largest]
        body.append([title, f"`{path}`", f"{s[score]:.4f}", f"{s['size_bytes'] / 1e6:.2f}"]
                    + [_fmt(s["latency_p50_ms"].get(k), ".3f") for k in sizes] + [f"x{speed:.2f}"])
    return ["## FP32 PyTorch, FP32 ONNX, INT8 PTQ, INT8 QAT", "", *markdown_table(head, body),
            *(["", *[f"- {m}" for m in missing]] if missing else [])]


def _threads_table(rows: dict[str, dict], threads: list[int], sizes: list[str]) -> list[str]:
    """Every variant at every thread count benched (ascending: the threads curve), p50 / p90 /
    p99 and the speedup over FP32 at the same count."""
    head = ["variant", "threads"] + [f"p50 / p90 / p99 {k} (ms)" for k in sizes] + \
        [f"speedup {k}" for k in sizes]
    body = []
    for variant, s in rows.items():
        for count in sorted(threads):
            entry = s["by_threads"][f"threads{count}"]
            body.append([variant, str(count)]
                        + [" / ".join(_fmt(entry.get(f"latency_{q}_ms", {}).get(k), ".3f")
                                      for q in ("p50", "p90", "p99")) for k in sizes]
                        + [_fmt(entry.get("speedup", {}).get(k), ".2f", prefix="x") for k in sizes])
    return markdown_table(head, body)


def _throughput_section(rows: dict[str, dict], machine: dict) -> list[str]:
    body = [[variant, _config(s["throughput_config"]), f"{s['throughput_ips']:,.0f}",
             _fmt(s.get("throughput_speedup"), ".2f", prefix="x")] for variant, s in rows.items()]
    cores = machine.get("cores", "all")
    return [f"## Throughput, every core busy ({cores} cores, largest batch)", "",
            *markdown_table(["variant", "best configuration", "images/s", "vs FP32's best"], body), "",
            "A stream is one session serving its own requests; streams x threads = the cores. "
            "Each variant at its own best configuration is compared with FP32 at FP32's best, "
            "timed in the same interleaved rounds (every configuration is in "
            "metrics/bench/<variant>.json, `throughput`)."]


def _engines_section(rows: dict[str, dict], sizes: list[str], threads: int,
                     titles: dict[str, str]) -> list[str]:
    """The same files on every engine (bench.runtimes; titles: name -> title, the reference
    first), then a line per variant naming the fastest engine and setting at batch 1 (the
    smallest batch) and the largest batch, and a line per engine left out of "best"."""
    largest = sizes[-1]
    reference = next(iter(titles))
    ref_title = titles[reference]
    head = (["variant", "engine", f"agreement with {ref_title}", "max logit diff"]
            + [f"p50 / p99 {k} (ms)" for k in sizes] + [f"vs FP32 on {ref_title}, {largest}",
                                                         "throughput (images/s)", "trusted"])
    body, fastest, left_out = [], [], []
    for variant, s in rows.items():
        # A row's top-level keys are the reference's, except bf16's (its engine's, already
        # under runtimes).
        engines = {**({} if "runtime" in s else {
            reference: {"latency_p50_ms": s["latency_p50_ms"], "latency_p99_ms": s["latency_p99_ms"],
                        "speedup": s.get("speedup", {largest: 1.0}),
                        "throughput_ips": s["throughput_ips"]}}), **s["runtimes"]}
        for name, e in engines.items():
            parity = e.get("parity", {})
            trusted = "no" if "failed" in e else ("reference" if name == reference else "yes")
            body.append([variant, titles[name], _fmt(parity.get("agreement"), ".2%"),
                         _fmt(parity.get("max_abs_diff"), ".3g")]
                        + [f"{_fmt(e.get('latency_p50_ms', {}).get(k), '.3f')} / "
                           f"{_fmt(e.get('latency_p99_ms', {}).get(k), '.3f')}" for k in sizes]
                        + [_fmt(e.get("speedup", {}).get(largest), ".2f", prefix="x"),
                           _fmt(e.get("throughput_ips"), ",.0f"), trusted])
            if "failed" in e:
                left_out.append(f"{titles[name]} is left out of {variant}'s best: {e['failed']}.")
        fastest.append(_fastest_line(variant, s["best"], sizes, titles))
    return [f"## Engines: the same files on each runtime ({threads} thread(s))", "",
            *markdown_table(head, body), "",
            f"Another engine is trusted when its predictions (top-1 class; a detector's matched "
            f"detections) agree with {ref_title}'s on the test split (bench.min_runtime_agreement); "
            f"speedups are against FP32 on {ref_title} in the same interleaved rounds. Fastest "
            "trusted engine and setting, against the fastest FP32 one (every thread count and stream configuration benched):", "",
            *[f"- {line}" for line in fastest + left_out]]


def _fastest_line(variant: str, best: dict, sizes: list[str], titles: dict[str, str]) -> str:
    parts = []
    for bs in dict.fromkeys((sizes[0], sizes[-1])):
        b = best["latency"][bs]
        part = f"at {bs} {_setting(b, titles)}, p50 {b['p50_ms']:.3f} ms, p99 {b['p99_ms']:.3f} ms"
        if "baseline" in b:
            base = b["baseline"]
            part += f" (x{b['speedup']:.2f} the best FP32: {_setting(base, titles)}, {base['p50_ms']:.3f} ms"
            if "bf16" in b:
                part += (f"; x{b['speedup_vs_bf16']:.2f} the best BF16: {_setting(b['bf16'], titles)}, "
                         f"{b['bf16']['p50_ms']:.3f} ms")
            part += ")"
        parts.append(part)
    t = best.get("throughput")
    if t:
        part = f"throughput {_setting(t, titles)}, {t['ips']:,.0f} images/s"
        if "baseline" in t:
            base = t["baseline"]
            part += f" (x{t['speedup']:.2f} the best FP32: {_setting(base, titles)}, {base['ips']:,.0f}"
            if "bf16" in t:
                part += f"; x{t['speedup_vs_bf16']:.2f} the best BF16: {_setting(t['bf16'], titles)}, {t['bf16']['ips']:,.0f}"
            part += ")"
        parts.append(part)
    return f"**{variant}**: " + "; ".join(parts) + "."


def _setting(best: dict, titles: dict[str, str]) -> str:
    """'OpenVINO, 2 threads' or 'OpenVINO, 1 stream x 2 threads'."""
    engine = titles[best["runtime"]]
    if "streams" in best:
        return f"{engine}, {_config(best)}"
    return f"{engine}, {best['threads']} thread{'s' * (best['threads'] != 1)}"


def _memory_section(rows: dict[str, dict], sizes: list[str], threads: int) -> list[str]:
    body = [[variant, f"{s['load_ms']:.1f}"] + [_fmt(s["peak_rss_mb"].get(k), ".1f") for k in sizes]
            for variant, s in rows.items()]
    head = ["variant", "load (ms)"] + [f"peak RSS {k} (MB)" for k in sizes]
    return [f"## Memory and start-up (a fresh process, {threads} thread(s))", "",
            *markdown_table(head, body), "",
            "Peak RSS: the whole process (Python, numpy and onnxruntime included) that loads the "
            "model and runs it at that batch size; load: creating the InferenceSession."]


def _config(config: dict) -> str:
    streams, threads = config["streams"], config["threads"]
    return f"{streams} stream{'s' * (streams != 1)} x {threads} thread{'s' * (threads != 1)}"


def _fmt(value, spec: str, prefix: str = "") -> str:
    return "—" if value is None else f"{prefix}{value:{spec}}"
