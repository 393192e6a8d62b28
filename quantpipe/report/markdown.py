"""report.md: the recommendation and its tails, the server snippet, then every table."""

from __future__ import annotations

from quantpipe import tails, tasks
from quantpipe.machine import describe
from quantpipe.profiling import describe_profile
from quantpipe.report.recommend import SAME_SPEED
from quantpipe.report.summary import QUANTIZED, candidates_of, score_keys, variants_of


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
    text += ["", *_runtimes_section(onnx_rows, sizes, threads[0], summary["runtimes"])]
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
    in BF16, no calibration), and by how much; each side at its best runtime and setting."""
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
    if bf16.get("inference_precision", "bf16") != "bf16":  # the flags said BF16, the runtime did not
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
            f"{base}. Each side at its best runtime and setting, timed in the same rounds.")


def kernel_isas(kernels: dict[str, dict]) -> dict[str, list[str]]:
    """{"convolutions": [ISA, ...], "matrix multiplies": [...]} of one runtime's kernels (as
    bench records them: base.kernel_table)."""
    out: dict[str, list[str]] = {}
    for k in kernels.values():
        kind = "convolutions" if "Conv" in k["layer"] else "matrix multiplies"
        if k["isa"] not in out.setdefault(kind, []):
            out[kind].append(k["isa"])
    return out


def _kernel_lines(summary: dict) -> list[str]:
    """What ran the shipped kinds of model: per runtime, the instruction sets of static INT8's
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
            *markdown_table(["variant", "runtime", "layer", "kernel", "precision", "ISA", "count"], body), "",
            "OpenVINO names the kernel each layer ran (its executed graph); ONNX Runtime's profile "
            "names op kernels, and the MLAS routine and instruction set follow from the node and "
            "this CPU's flags (docs/precision.md)."]


def _server_section(summary: dict) -> list[str]:
    srv = summary.get("server")
    if not srv:
        return []
    gain = f", x{srv['speedup']:.2f} FP32's best" if "speedup" in srv else ""
    return [f"**Serve it** (`{srv['variant']}` at bs{srv['batch_size']}, the best streams x threads "
            f"measured: {describe_setting(srv, summary['runtimes'])}, {srv['ips']:,.0f} images/s{gain}; "
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
    columns = tasks.of_evaluation(rows["fp32"]).headline  # the task's score and agreement
    # Post-processing timed with the model (a detector's decode + NMS).
    end_to_end = "end_to_end" in rows["fp32"]
    head = ["variant", *(title for title, _, _ in columns), "size (MB)", "size ratio"]
    head += [f"p50 {k} (ms)" for k in sizes] + [f"p99 {k} (ms)" for k in sizes]
    head += [f"speedup {k}" for k in sizes]
    if end_to_end:
        head += [f"end to end speedup {k}" for k in sizes]
    body = []
    for variant, s in rows.items():
        cells = [f"{variant} (failed)" if "failed" in s else variant]
        cells += [_fmt(s.get(key), spec) for _, key, spec in columns]
        cells += [f"{s['size_bytes'] / 1e6:.2f}", _fmt(s.get("size_ratio"), ".3f")]
        cells += [_fmt(s["latency_p50_ms"].get(k), ".3f") for k in sizes]
        cells += [_fmt(s.get("latency_p99_ms", {}).get(k), ".3f") for k in sizes]
        cells += [speedup_cell(s, k) for k in sizes]
        if end_to_end:  # torch has no end-to-end row: its decode would be the variants' code
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
                        + [speedup_cell(entry, k) for k in sizes])
    return markdown_table(head, body)


def _throughput_section(rows: dict[str, dict], machine: dict) -> list[str]:
    body = [[variant, describe_config(s["throughput_config"]), f"{s['throughput_ips']:,.0f}",
             _fmt(s.get("throughput_speedup"), ".2f", prefix="x")] for variant, s in rows.items()]
    cores = machine.get("cores", "all")
    return [f"## Throughput, every core busy ({cores} cores, largest batch)", "",
            *markdown_table(["variant", "best configuration", "images/s", "vs FP32's best"], body), "",
            "A stream is one session serving its own requests; streams x threads = the cores. "
            "Each variant at its own best configuration is compared with FP32 at FP32's best, "
            "timed in the same interleaved rounds (every configuration is in "
            "metrics/bench/<variant>.json, `throughput`)."]


def _runtimes_section(rows: dict[str, dict], sizes: list[str], threads: int,
                      titles: dict[str, str]) -> list[str]:
    """The same files on every runtime (bench.runtimes; titles: name -> title, the reference
    first), then a line per variant naming the fastest runtime and setting at batch 1 (the
    smallest batch) and the largest batch, and a line per runtime left out of "best"."""
    largest = sizes[-1]
    reference = next(iter(titles))
    ref_title = titles[reference]
    head = (["variant", "runtime", f"agreement with {ref_title}", "max logit diff"]
            + [f"p50 / p99 {k} (ms)" for k in sizes] + [f"vs FP32 on {ref_title}, {largest}",
                                                         "throughput (images/s)", "trusted"])
    body, fastest, left_out = [], [], []
    for variant, s in rows.items():
        # A row's top-level keys are the reference's, except bf16's (its runtime's, already
        # under runtimes).
        runtimes = {**({} if "runtime" in s else {
            reference: {"latency_p50_ms": s["latency_p50_ms"], "latency_p99_ms": s["latency_p99_ms"],
                        "speedup": s.get("speedup", {largest: 1.0}),
                        "throughput_ips": s["throughput_ips"]}}), **s["runtimes"]}
        for name, e in runtimes.items():
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
    return [f"## Runtimes: the same files on each of them ({threads} thread(s))", "",
            *markdown_table(head, body), "",
            f"Another runtime is trusted when its predictions (top-1 class; a detector's matched "
            f"detections) agree with {ref_title}'s on the test split (bench.min_runtime_agreement); "
            f"speedups are against FP32 on {ref_title} in the same interleaved rounds. Fastest "
            "trusted runtime and setting, against the fastest FP32 one (every thread count and stream configuration benched):", "",
            *[f"- {line}" for line in fastest + left_out]]


def _fastest_line(variant: str, best: dict, sizes: list[str], titles: dict[str, str]) -> str:
    parts = []
    for bs in dict.fromkeys((sizes[0], sizes[-1])):
        b = best["latency"][bs]
        part = f"at {bs} {describe_setting(b, titles)}, p50 {b['p50_ms']:.3f} ms, p99 {b['p99_ms']:.3f} ms"
        if "baseline" in b:
            base = b["baseline"]
            part += f" (x{b['speedup']:.2f} the best FP32: {describe_setting(base, titles)}, {base['p50_ms']:.3f} ms"
            if "bf16" in b:
                part += (f"; x{b['speedup_vs_bf16']:.2f} the best BF16: {describe_setting(b['bf16'], titles)}, "
                         f"{b['bf16']['p50_ms']:.3f} ms")
            part += ")"
        parts.append(part)
    t = best.get("throughput")
    if t:
        part = f"throughput {describe_setting(t, titles)}, {t['ips']:,.0f} images/s"
        if "baseline" in t:
            base = t["baseline"]
            part += f" (x{t['speedup']:.2f} the best FP32: {describe_setting(base, titles)}, {base['ips']:,.0f}"
            if "bf16" in t:
                part += f"; x{t['speedup_vs_bf16']:.2f} the best BF16: {describe_setting(t['bf16'], titles)}, {t['bf16']['ips']:,.0f}"
            part += ")"
        parts.append(part)
    return f"**{variant}**: " + "; ".join(parts) + "."


def describe_setting(best: dict, titles: dict[str, str]) -> str:
    """'OpenVINO, 2 threads' or 'OpenVINO, 1 stream x 2 threads'."""
    runtime = titles[best["runtime"]]
    if "streams" in best:
        return f"{runtime}, {describe_config(best)}"
    return f"{runtime}, {best['threads']} thread{'s' * (best['threads'] != 1)}"


def _memory_section(rows: dict[str, dict], sizes: list[str], threads: int) -> list[str]:
    body = [[variant, f"{s['load_ms']:.1f}"] + [_fmt(s["peak_rss_mb"].get(k), ".1f") for k in sizes]
            for variant, s in rows.items()]
    head = ["variant", "load (ms)"] + [f"peak RSS {k} (MB)" for k in sizes]
    return [f"## Memory and start-up (a fresh process, {threads} thread(s))", "",
            *markdown_table(head, body), "",
            "Peak RSS: the whole process (Python, numpy and onnxruntime included) that loads the "
            "model and runs it at that batch size; load: creating the InferenceSession."]


def describe_config(config: dict) -> str:
    streams, threads = config["streams"], config["threads"]
    return f"{streams} stream{'s' * (streams != 1)} x {threads} thread{'s' * (threads != 1)}"


def speedup_cell(entry: dict, bs: str) -> str:
    """'x3.10 (3.05-3.12)': the speedup at batch size `bs` and, where the bench recorded it,
    its lowest and highest over the interleaved rounds."""
    value = entry.get("speedup", {}).get(bs)
    spread = entry.get("speedup_range", {}).get(bs)
    if value is None or not spread:
        return _fmt(value, ".2f", prefix="x")
    return f"x{value:.2f} ({spread['low']:.2f}–{spread['high']:.2f})"


def _fmt(value, spec: str, prefix: str = "") -> str:
    return "—" if value is None else f"{prefix}{value:{spec}}"
