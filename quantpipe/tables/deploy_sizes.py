"""metrics/deploy_sizes.json (scripts/deploy_sizes.py) as docs/results.md's "At the sizes people
deploy": per model, every variant on both runtimes at batch 1 and 64, one thread and all cores;
OpenVINO's own INT8 flow beside quantpipe's static in the same rounds; each stage's time and
peak memory."""

from __future__ import annotations

from quantpipe.machine import describe
from quantpipe.report.markdown import markdown_table

TITLES = {"onnxruntime": "ONNX Runtime", "openvino": "OpenVINO"}
NAMES = {"resnet50": "ResNet-50", "mobilenet_v3_large": "MobileNetV3-Large",
         "efficientnet_b0": "EfficientNet-B0"}
PEERS = {"fp32@onnxruntime": "FP32, ONNX Runtime", "fp32@openvino": "FP32, OpenVINO",
         "bf16@openvino": "BF16, OpenVINO", "static@onnxruntime": "quantpipe static, ONNX Runtime",
         "static@openvino": "quantpipe static, OpenVINO",
         "openvino_nncf@openvino": "OpenVINO's flow (NNCF to IR), OpenVINO"}


def _cell(c: dict | None) -> str:
    if c is None:
        return "—"
    ms = c["p50_ms"]  # three significant digits, trailing zeros kept
    text = f"{ms:#.3g} ms" if ms < 100 else f"{ms:,.0f} ms"
    return f"{text} (x{c['speedup']:.2f})"


def _columns(cores: int) -> list[tuple[str, str, str]]:
    """(title, threads key, batch key) of the four configurations."""
    return [(f"bs{bs}, {t} thread{'s' * (t > 1)}", f"threads{t}", f"bs{bs}")
            for bs in (1, 64) for t in (1, cores)]


def model_section(name: str, m: dict) -> list[str]:
    title = f"### {NAMES.get(name, name)} at {m['image_size']} px"
    if "variants" not in m:
        return [title, "", f"The recipe did not finish: {m.get('error', 'no summary')}", ""]
    cores = int(m["machine"]["cores"])
    columns = _columns(cores)
    fp32 = m["variants"]["fp32"]["accuracy"]
    chance = ("" if m["above_chance"] else
              f" — **at chance** ({m['classes']} classes): its accuracy columns say nothing")
    rec = "; ".join(f"{bs}: `{r['variant']}` on {TITLES.get(r['runtime'], r['runtime'])}, "
                    f"{r['threads']} thread{'s' * (r['threads'] > 1)}"
                    + (f", x{r['speedup']:.2f} the best FP32" if "speedup" in r else "")
                    for bs, r in m["recommended"].items())
    out = [title, "",
           f"Measured on {describe(m['machine'])}. The recipe "
           f"{'ran green' if m['green'] else 'stopped: ' + m.get('error', '')} in "
           f"{m['repro_seconds'] / 60:.0f} min (code at {m['git_revision'][:7]}); FP32 test "
           f"accuracy {fp32:.3f} on {m['test_samples']} images{chance}. Recommended: {rec}.", "",
           "p50 and, in brackets, the speedup over the best FP32 (the faster runtime) timed in "
           "the same rounds:", ""]
    rows = []
    for v, row in m["variants"].items():
        for runtime, by in row["latency"].items():
            untrusted = " (untrusted)" if runtime in row.get("untrusted", {}) else ""
            rows.append([f"{v}{untrusted}", TITLES.get(runtime, runtime), f"{row['accuracy']:.3f}",
                         f"{row['size_bytes'] / 1e6:.1f} MB",
                         *[_cell(by.get(t, {}).get(bs)) for _, t, bs in columns]])
    out += markdown_table(["variant", "runtime", "test accuracy", "size",
                           *[c for c, _, _ in columns]], rows)
    flow = m.get("openvino_flow")
    if flow:
        out += ["", f"OpenVINO's own INT8 flow on the same FP32 file (`nncf.quantize` "
                f"{flow['nncf']}, {flow['preset']} preset, the same {flow['calib_samples']} "
                f"calibration images, {flow['quantize_seconds']:.0f} s; test accuracy "
                f"{flow['accuracy']:.3f}, agreement with FP32 {flow['agreement_with_fp32']:.3f}), "
                "beside quantpipe's static, all in one run's interleaved rounds:", ""]
        out += markdown_table(["model, runtime", *[c for c, _, _ in columns]],
                              [[PEERS.get(k, k), *[_cell(by.get(t, {}).get(bs)) for _, t, bs in columns]]
                               for k, by in flow["latency"].items()])
    out += ["", "Each stage's wall time and peak resident memory (its metrics' `resources`):", ""]
    out += markdown_table(["stage", "seconds", "peak RSS"],
                          [[s, f"{r['seconds']:.0f}", f"{r['peak_rss_mb'] / 1024:.1f} GB"]
                           for s, r in m["stages"].items()])
    return out + [""]


def deploy_sizes_table(record: dict) -> str:
    out = []
    for name, m in record.get("models", {}).items():
        out += model_section(name, m)
    return "\n".join(out).rstrip() or "Not measured yet: `python scripts/deploy_sizes.py`."
