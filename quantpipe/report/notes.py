"""The report's notes: where INT8 does not pay (or pays less), with the measured evidence."""

from __future__ import annotations

from quantpipe import tasks
from quantpipe.report.markdown import describe_config
from quantpipe.report.summary import quantized_of
from quantpipe.schemas.gates import GatesParams

# Below this FP32 latency (ms) per-run overhead, not arithmetic, decides INT8 vs FP32.
TINY_MODEL_MS = 0.05
# A quantized model that keeps more than this share of its multiply-accumulates in float
# (quantize_static.json: mac_share_int8) computes mostly in float: that, not its kernels, is
# why it is not faster.
MOSTLY_FLOAT = 0.5


def tolerance_notes(summary: dict, gates: GatesParams) -> list[str]:
    """The task's tolerance table (a detector's drop between gates.warn_map_drop_pts and the
    gate passes with a warning, report.md)."""
    return tasks.for_summary(summary).tolerance_notes(summary, gates, quantized_of(summary))


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
            f"{describe_config(config)} reach x{entry['throughput_speedup']:.2f} FP32's best "
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
