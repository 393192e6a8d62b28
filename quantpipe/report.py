"""The summary of all variants (metrics/summary.json, DESIGN.md §2), report.md and the gates."""

from __future__ import annotations

from quantpipe.bench import describe_profile
from quantpipe.params import GatesParams

QUANTIZED = ("dynamic", "static")
# Below this FP32 latency (ms) per-run overhead, not arithmetic, decides INT8 vs FP32.
TINY_MODEL_MS = 0.05


def build_summary(evals: dict[str, dict], benches: dict[str, dict], threads: int,
                  torch_bench: dict | None = None) -> dict:
    """summary.json: accuracy, size and p50 latency per variant; drop, agreement, size ratio and
    speedup (vs FP32 ONNX) for the quantized ones and the PyTorch eager baseline `torch`.
    Latencies are those at `threads` intra-op threads."""
    fp32 = evals["fp32"]
    summary = {}
    for variant, ev in evals.items():
        rows = benches[variant]["latency"][f"threads{threads}"]  # {"bs1": {...}, ...}
        entry = {"accuracy": ev["accuracy"], "size_bytes": ev["size_bytes"],
                 "latency_p50_ms": {bs: r["p50_ms"] for bs, r in rows.items()}}
        if variant != "fp32":
            entry.update({
                "accuracy_drop_pp": round((fp32["accuracy"] - ev["accuracy"]) * 100, 4),
                "agreement": ev["agreement"],
                "size_ratio": round(ev["size_bytes"] / fp32["size_bytes"], 4),
                # Measured against FP32 in the same interleaved rounds (see stages/bench.py).
                "speedup": {bs: r["speedup"] for bs, r in rows.items()}})
        summary[variant] = entry
    if torch_bench is not None:
        rows = torch_bench["latency"][f"threads{threads}"]
        summary["torch"] = {
            "accuracy": torch_bench["accuracy"], "size_bytes": torch_bench["size_bytes"],
            "latency_p50_ms": {bs: r["p50_ms"] for bs, r in rows.items()},
            # PyTorch eager vs FP32 ONNX: below 1 means the ONNX export alone is faster.
            "speedup": {bs: r["speedup"] for bs, r in rows.items()}}
    return summary


def check_gates(summary: dict, gates: GatesParams) -> list[str]:
    """Human-readable gate failures; empty when all gates hold."""
    failures = []
    for variant in QUANTIZED:
        drop = summary[variant]["accuracy_drop_pp"]
        if drop > gates.max_accuracy_drop_pp:
            failures.append(f"{variant} accuracy drop {drop:.2f} pp > gates.max_accuracy_drop_pp "
                            f"= {gates.max_accuracy_drop_pp}")
    speedups = summary["static"]["speedup"]
    largest = max(speedups, key=lambda k: int(k[2:]))
    if speedups[largest] < gates.min_static_speedup:
        failures.append(f"static speedup x{speedups[largest]:.2f} at {largest} < "
                        f"gates.min_static_speedup = {gates.min_static_speedup}")
    return failures


def slowdown_notes(summary: dict, evals: dict[str, dict], machine: dict,
                   profiles: dict[str, dict] | None = None) -> list[str]:
    """One line per quantized variant that is slower than FP32 somewhere, saying why.

    profiles: variant -> the kernel_profile of its bench JSON (optional), the evidence for a
    slowdown that no setting explains.
    """
    notes = []
    flags = machine.get("cpu_flags", {})
    for variant in QUANTIZED:
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
        notes.append(f"{variant} is slower than FP32 at {', '.join(slow)}: {why}.")
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
    top = profile["top_nodes"][0]
    return (f"its slowest kernel is {top['op']} {top['node']!r} (profiled at "
            f"bs{profile['batch_size']}: {top['ms']:.2f} ms, {top['share']:.0%} of its "
            f"{profile['kernel_ms']:.2f} ms; FP32's kernels take {fp32['kernel_ms']:.2f} ms); {advice}")


def render_markdown(summary: dict, notes: list[str], machine: dict, threads: int,
                    profiles: dict[str, dict] | None = None) -> str:
    sizes = sorted({k for v in summary.values() for k in v["latency_p50_ms"]}, key=lambda k: int(k[2:]))
    head = ["variant", "accuracy", "drop (pp)", "agreement", "size (MB)", "size ratio"]
    head += [f"p50 {k} (ms)" for k in sizes] + [f"speedup {k}" for k in sizes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, s in summary.items():
        cells = [variant, f"{s['accuracy']:.4f}", _fmt(s.get("accuracy_drop_pp"), ".2f"),
                 _fmt(s.get("agreement"), ".4f"), f"{s['size_bytes'] / 1e6:.2f}",
                 _fmt(s.get("size_ratio"), ".3f")]
        cells += [_fmt(s["latency_p50_ms"].get(k), ".3f") for k in sizes]
        cells += [_fmt(s.get("speedup", {}).get(k), ".2f", prefix="x") for k in sizes]
        lines.append("| " + " | ".join(cells) + " |")
    flags = ", ".join(f for f, on in machine.get("cpu_flags", {}).items() if on) or "unknown"
    text = ["# quantpipe results", "", *lines, "",
            f"CPU: {machine.get('cpu', 'unknown')} ({flags}); onnxruntime "
            f"{machine.get('onnxruntime', '?')}; {threads} intra-op thread(s). Speedups are "
            "measured against FP32 in the same interleaved rounds."]
    if profiles:
        # Where the time goes, from one ORT profile per variant (metrics/bench/<variant>.json).
        first = next(iter(profiles.values()))
        text += ["", f"Kernel time at bs{first['batch_size']} ({first['threads']} thread(s), ORT "
                 "profile): " + "; ".join(f"{v} {describe_profile(p)}" for v, p in profiles.items())
                 + "."]
    if notes:
        text += ["", *[f"- {n}" for n in notes]]
    return "\n".join(text) + "\n"


def _fmt(value, spec: str, prefix: str = "") -> str:
    return "—" if value is None else f"{prefix}{value:{spec}}"
