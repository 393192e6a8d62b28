"""metrics/summary.json: every variant's score, size, latency (p50/p90/p99 by thread count),
throughput, memory and best runtime, from the evaluate and bench JSON; the rows' names; the
threads curve's plot data."""

from __future__ import annotations

from quantpipe import tasks
from quantpipe.errors import UserError

QUANTIZED = ("dynamic", "static", "qat")
# What may be shipped instead of FP32: the INT8 variants and the FP32 file computed in BF16.
CANDIDATES = (*QUANTIZED, "bf16")
# Top-level summary keys that are not model rows.
RECORDS = ("machine", "runtimes", "skipped", "recommended", "server", "task")


def score_keys(summary: dict) -> tuple[str, str, str, str]:
    """The summary's task's score, its drop against FP32 and the drop's unit and gate."""
    s = tasks.for_summary(summary).score
    return s.key, s.drop_key, s.unit, s.gate


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
    task = tasks.of_evaluation(fp32)
    # The default task is left unnamed, as in summaries written before tasks had names.
    summary: dict = {} if task.name == tasks.DEFAULT else {"task": task.name}
    for variant, ev in evals.items():
        b = benches[variant]
        entry = {**task.summary_scores(ev), "size_bytes": ev["size_bytes"],
                 **_latency(b["latency"], threads, with_speedup=variant != "fp32")}
        if "end_to_end" in b:  # a detector's model + decode + NMS
            entry["end_to_end"] = _latency(b["end_to_end"], threads, with_speedup=variant != "fp32")
        best = b["throughput"]["best"]
        entry.update({"throughput_ips": best["ips"],
                      "throughput_config": {"streams": best["streams"], "threads": best["threads"]}})
        if "memory" in b:  # ONNX Runtime's process (the bf16 row runs on another runtime)
            entry.update({"peak_rss_mb": b["memory"]["peak_rss_mb"], "load_ms": b["memory"]["load_ms"]})
        if b.get("runtime", reference) != reference:
            # The bf16 row: its latency keys are this runtime's, in this precision.
            entry.update({"runtime": b["runtime"], "inference_precision": ev["inference_precision"]})
            if "failed" in b["runtimes"][b["runtime"]]:  # it disagrees with FP32 beyond parity
                entry["failed"] = b["runtimes"][b["runtime"]]["failed"]
        if variant != "fp32":
            entry.update({
                **task.summary_drop(ev, fp32),
                "agreement": ev["agreement"],
                "size_ratio": round(ev["size_bytes"] / fp32["size_bytes"], 4),
                # Each side at its own best configuration, FP32 timed in the same rounds.
                "throughput_speedup": b["throughput"]["speedup"]})
        # The fastest runtime and setting; the other runtimes' figures (ONNX Runtime's are the
        # keys above).
        entry["best"] = b["best"]
        if "speedup_vs_bf16" in next(iter(b["best"]["latency"].values())):
            # INT8 at its best against the FP32 file in BF16 at its best, in the same rounds.
            entry["speedup_vs_bf16"] = {bs: r["speedup_vs_bf16"] for bs, r in b["best"]["latency"].items()}
            if "throughput" in b["best"]:
                entry["throughput_speedup_vs_bf16"] = b["best"]["throughput"]["speedup_vs_bf16"]
        entry["kernels"] = b.get("kernels", {})
        entry["runtimes"] = {name: _runtime_entry(e, threads) for name, e in b["runtimes"].items()
                             if not e.get("reference")}
        if variant in (failed or {}):
            entry["failed"] = failed[variant]
        summary[variant] = entry
    if torch_bench is not None:
        # PyTorch eager vs FP32 ONNX: a speedup below 1 means the ONNX export alone is faster.
        summary["torch"] = {**{k: torch_bench[k] for k in task.torch_score_keys},
                            "size_bytes": torch_bench["size_bytes"],
                            **_latency(torch_bench["latency"], threads, with_speedup=True)}
    summary["machine"] = machine
    # The runtimes by name and title, the reference (the one the keys above are of) first.
    runtimes = {name: e for b in benches.values() if "runtimes" in b for name, e in b["runtimes"].items()}
    summary["runtimes"] = {name: e["title"] for name, e in
                           sorted(runtimes.items(), key=lambda item: not item[1].get("reference"))}
    if skipped:
        summary["skipped"] = skipped
    return summary


def _runtime_entry(runtime: dict, threads: list[int]) -> dict:
    """A non-reference runtime on one variant, for the summary: latency (and speedup against FP32
    on ONNX Runtime from the same rounds) at the headline thread count and by_threads at each,
    its best throughput, parity with ONNX Runtime and, when it is not trusted, why."""
    out: dict = {}
    if "latency" in runtime:
        out.update(_latency(runtime["latency"], threads, with_speedup=True))
        top = runtime["throughput"]["best"]
        out.update({"throughput_ips": top["ips"],
                    "throughput_config": {"streams": top["streams"], "threads": top["threads"]},
                    "throughput_speedup": runtime["throughput"]["speedup"]})
    if "parity" in runtime:
        out["parity"] = {k: runtime["parity"][k] for k in ("agreement", "max_abs_diff", "mean_abs_diff")}
    if "failed" in runtime:
        out["failed"] = runtime["failed"]
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
            # The lowest and highest speedup over the rounds: how far the median can be trusted.
            spread = {bs: r["speedup_range"] for bs, r in rows.items() if "speedup_range" in r}
            if spread:
                entry["speedup_range"] = spread
            entry["baseline_p50_ms"] = {bs: r["baseline_p50_ms"] for bs, r in rows.items()}
        by_threads[f"threads{count}"] = entry
    return {**by_threads[f"threads{threads[0]}"], "by_threads": by_threads}


def threads_curve(summary: dict, bs: str) -> list[dict]:
    """Plot data: one row per thread count benched, one column `<variant>_<runtime>` per INT8
    variant (and bf16) and runtime, its speedup over FP32 on the reference runtime at the same
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
