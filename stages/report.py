"""report: metrics/summary.json and metrics/report.md from every evaluate and bench; gates.

`--metrics DIR` is the metrics folder the other stages write into (dvc.yaml lists each file this
stage reads from it: eval/<variant>.json, bench/<variant>.json, bench/torch.json,
quantize_static.json, quantize_qat.json); it writes summary.json, report.md and plots/ there.
"""

import sys

from quantpipe import params, report
from quantpipe.errors import UserError
from quantpipe.io import VARIANTS, read_json, run_stage, stage_args, write_bytes, write_json
from quantpipe.schemas.gates import GatesParams


def main(argv: list[str]) -> None:
    metrics = stage_args("report", argv, "metrics").metrics
    gates = params.load(GatesParams)
    evals = {v: read_json(metrics / f"eval/{v}.json") for v in VARIANTS}
    qat = read_json(metrics / "quantize_qat.json")
    if "skipped" in qat and "skipped" in evals["qat"]:
        evals["qat"]["skipped"] = qat["skipped"]  # the reason itself, not "the file is empty"
    benches = {v: read_json(metrics / f"bench/{v}.json") for v in VARIANTS}
    torch_bench = read_json(metrics / "bench/torch.json")
    # A variant its stage wrote but could not vouch for (quantize_static out of the criterion,
    # quantize_qat without export parity): measured and shown, never recommended.
    stages = {"static": read_json(metrics / "quantize_static.json"), "qat": qat}
    failed = {v: m["failed"] for v, m in stages.items() if "failed" in m and "skipped" not in evals[v]}
    summary = report.build_summary(evals, benches,
                                   None if "skipped" in torch_bench else torch_bench, failed)
    summary["recommended"] = report.recommend(summary, gates)
    summary["server"] = report.serve(summary, benches)
    profiles = {v: b["kernel_profile"] for v, b in benches.items() if "kernel_profile" in b}
    notes = (report.tolerance_notes(summary, gates)
             + report.slowdown_notes(summary, evals, summary["machine"], profiles, stages)
             + report.thread_scaling_notes(summary))
    write_json(metrics / "summary.json", summary)
    markdown = report.render_markdown(summary, notes, profiles)
    write_bytes(metrics / "report.md", markdown.encode())
    rows = report.variants_of(summary)
    # One row per batch size, one column per variant: `dvc plots` draws a line per column. It
    # drops the whole plot when a column dvc.yaml names is missing, so a variant without a row
    # (skipped qat, no torch for a model brought as ONNX) is null: no point.
    write_json(metrics / "plots/latency.json", [
        {"batch_size": int(bs[2:]),
         **{v: rows[v]["latency_p50_ms"][bs] if v in rows else None for v in (*VARIANTS, "torch")}}
        for bs in rows["fp32"]["latency_p50_ms"]])
    # The threads curve: INT8's speedup over FP32 at each thread count, per variant and engine,
    # at the smallest and the largest batch.
    sizes = sorted(rows["fp32"]["latency_p50_ms"], key=lambda k: int(k[2:]))
    for name, bs in (("smallest", sizes[0]), ("largest", sizes[-1])):
        curve = report.threads_curve(summary, bs)
        write_json(metrics / f"plots/threads_{name}_batch.json",
                   [{"threads": r["threads"], **{c: r.get(c) for c in report.CURVE_COLUMNS}} for r in curve])
    # Accuracy vs size: the ONNX files (the torch checkpoint is the FP32 weights again, bf16
    # the FP32 file again).
    write_json(metrics / "plots/accuracy_size.json", [
        {"variant": v, "size_mb": round(s["size_bytes"] / 1e6, 4),
         "accuracy": s[report.score_keys(summary)[0]]}
        for v, s in rows.items() if v in VARIANTS and v != "bf16"])
    print(markdown)

    failures = report.check_gates(summary, gates)
    for failure in failures:
        print(f"gate: {failure}", file=sys.stderr)
    if failures and gates.enforce:
        raise UserError(f"{len(failures)} gate(s) failed: {failures[0]} "
                        "(set gates.enforce: false to report without failing)")


if __name__ == "__main__":
    run_stage(main)
