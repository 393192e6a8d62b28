"""The measured tables of README.md and docs/, rendered from the committed metrics (never typed).

Each table stands between two marker lines, `<!-- generated: NAME -->` and `<!-- end: NAME -->`;
NAME picks what renders it:

- `default`: metrics/summary.json and metrics/bench/static.json (the default pipeline: all
  cores, one thread, throughput and memory, ONNX Runtime vs OpenVINO);
- `headline`: the short table of the README (summary.json; each speedup's range over repeated
  runs from metrics/spread.json when it is this machine's);
- `runtimes`: static.onnx and fp32.onnx on each runtime (metrics/bench/static.json);
- `families`: metrics/families.json (scripts/families.py);
- `engines`: metrics/engines.json (scripts/engines.py);
- `qat_hard`: metrics/qat_hard.json (scripts/qat_hard.py);
- `detection`: metrics/detection.json (scripts/detection.py);
- `segmentation`: metrics/segmentation.json (scripts/segmentation.py);
- `precision`, `precision_one_thread`: every precision on both runtimes (summary.json: FP32,
  BF16, INT8), all cores and one thread;
- `ort_amx`: metrics/ort_amx.json (scripts/ort_amx.py);
- `scale`: metrics/scale.json (scripts/scale.py);
- `ort_threads`: metrics/ort_threads.json (scripts/ort_threads.py);
- `machines`: per machine, this one (metrics/summary.json) and each measured by
  scripts/remote_bench.py (metrics/machines/*/summary.json): the threads curve, the recommended
  configurations with their tails and the server configuration.

The pictures (quantpipe.pictures, docs/img/*.svg) are drawn from the committed metrics the same way.

    python -m quantpipe.docs            # rewrite every generated table (`make docs`)
    python -m quantpipe.docs --check    # exit 1 naming the file whose tables differ (a test)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

from quantpipe.machine import describe
from quantpipe.profiling import describe_profile
# report.md's table layout, settings as words and score keys
from quantpipe.report import describe_config, describe_setting, markdown_table, score_keys
from quantpipe.review import GATED_SPEEDUPS  # which speedups make gate judges
from quantpipe.tables.deploy_sizes import deploy_sizes_table

# The documents that hold generated tables.
DOCUMENTS = ("README.md", "docs/*.md")

BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end: \2 -->)", re.S)


def _ms(value: float | None) -> str:
    """Three significant digits, trailing zeros kept (3.00 ms, 0.0951 ms, 123 ms)."""
    if value is None:
        return "—"
    return f"{value:.0f} ms" if value >= 100 else f"{value:#.3g} ms"


def _x(value: float | None) -> str:
    return "—" if value is None else f"x{value:.2f}"


def _sizes(summary: dict) -> list[str]:
    return sorted(summary["fp32"]["latency_p50_ms"], key=lambda k: int(k[2:]))


def _latency_rows(summary: dict, names: list[str], sizes: list[str], key: str | None) -> list[list[str]]:
    """Per variant and batch size: p50, FP32's p50 from the same interleaved rounds, and the
    speedup (the one divided by the other). key: a by_threads key, or None for the headline."""
    label = {"torch": "torch (eager)", "bf16": "bf16 (fp32.onnx on OpenVINO)"}
    rows = []
    for v in names:
        s = summary[v]
        t = s if key is None else s["by_threads"][key]
        row = [label.get(v, v) + (" (failed)" if "failed" in s else "")]
        for k in sizes:
            row += [_ms(t["latency_p50_ms"][k]), _ms(t.get("baseline_p50_ms", {}).get(k)),
                    _x(t.get("speedup", {}).get(k)), _ms(t.get("latency_p99_ms", {}).get(k))]
        rows.append(row)
    return rows


def _latency_head(sizes: list[str]) -> list[str]:
    return [h for k in sizes
            for h in (f"p50 {k}", f"FP32 p50 {k}, same rounds", f"speedup {k}", f"p99 {k}")]


# What every speedup column divides, said once under each table that has one.
SPEEDUP_NOTE = ("speedup = FP32's p50 from the same interleaved rounds / the variant's p50. The "
                "fp32 row's own p50 comes from its own bench, minutes earlier or later, so it "
                "differs from the same-rounds column by the machine's drift between the two runs; "
                "the ratio does not.")


def _spread_of(summary: dict, spread: dict | None) -> dict[str, list[float]]:
    """Per speedup path of summary.json its values over scripts/spread.py's runs, when those
    were measured on the machine that measured summary.json (the first of them is its run)."""
    if not spread or spread.get("machine") != describe(summary["machine"]):
        return {}
    return spread["speedup"].get("values", {})


def _with_range(cell: str, values: list[float] | None) -> str:
    return cell if not values else f"{cell} ({min(values):.2f}–{max(values):.2f})"


def headline_table(summary: dict, spread: dict | None = None) -> str:
    """The README's table: accuracy, size and the largest batch at all cores and on one thread;
    each speedup with its range over repeated runs when metrics/spread.json has this machine's."""
    sizes = _sizes(summary)[-1:]
    names = [v for v in ("fp32", "dynamic", "static", "qat", "bf16") if v in summary]
    cores = summary["machine"]["cores"]
    ranges, bs = _spread_of(summary, spread), sizes[-1]
    rows = []
    for v, first, one in zip(names, _latency_rows(summary, names, sizes, None),
                             _latency_rows(summary, names, sizes, "threads1")):
        s = summary[v]
        first[3] = _with_range(first[3], ranges.get(f"{v}.speedup.{bs}"))
        one[3] = _with_range(one[3], ranges.get(f"{v}.by_threads.threads1.speedup.{bs}"))
        rows.append([first[0], f"{s['accuracy']:.3f}", f"{s['size_bytes'] / 1e6:.2f} MB",
                     *first[1:], *one[1:]])
    head = ["variant", "test accuracy", "size",
            *[f"{h}, {cores} threads" for h in _latency_head(sizes)],
            *[f"{h}, 1 thread" for h in _latency_head(sizes)]]
    if ranges:
        seeds = spread["accuracy"]["seed_range_pp"]
        noise = (f"In brackets: the lowest and highest speedup over {spread['bench_runs']} runs of "
                 "the same models, one after another on this machine (`metrics/spread.json`, "
                 "`scripts/spread.py`); this table is the first of those runs. Accuracy is the "
                 "same on a re-run here (the pipeline is deterministic on one machine) and moves "
                 f"by up to {max(seeds.values()):.1f} points across seeds "
                 f"{', '.join(map(str, spread['accuracy']['seeds']))} (split and training).")
    else:
        noise = ("No spread over repeated runs was measured on this machine: "
                 "`python scripts/spread.py`, then `make docs`, adds it here.")
    return "\n".join([f"Measured on {describe(summary['machine'])}.", "", *markdown_table(head, rows), "",
                      SPEEDUP_NOTE, "", noise])


def default_tables(summary: dict, static_bench: dict) -> str:
    """The default pipeline's tables (docs/results.md)."""
    machine = summary["machine"]
    sizes = _sizes(summary)
    names = [v for v in ("fp32", "dynamic", "static", "qat", "bf16", "torch") if v in summary]
    cores = machine["cores"]
    out = [f"Measured on {describe(machine)}. {SPEEDUP_NOTE}", "",
           f"**All cores** ({cores} intra-op threads: ORT's default and what you deploy with; "
           "the headline of `metrics/summary.json`):", ""]
    rows = [[first[0], f"{summary[v]['accuracy']:.3f}",
             "—" if "accuracy_drop_pp" not in summary[v] else f"{summary[v]['accuracy_drop_pp']:.1f}",
             "—" if "agreement" not in summary[v] else f"{summary[v]['agreement']:.3f}",
             f"{summary[v]['size_bytes'] / 1e6:.2f} MB", *first[1:]]
            for v, first in zip(names, _latency_rows(summary, names, sizes, None))]
    out += markdown_table(["variant", "accuracy", "drop (pp)", "agreement", "size", *_latency_head(sizes)], rows)
    out += ["", "**One thread** (`by_threads.threads1`): the gain per core.", ""]
    out += markdown_table(["variant", *_latency_head(sizes)], _latency_rows(summary, names, sizes, "threads1"))
    largest = sizes[-1]
    out += ["", f"**Every core busy, and memory** (batch {largest[2:]}; a fresh process per batch "
            "size for memory):", ""]
    rows = []
    for v in names:
        s = summary[v]
        if "throughput_ips" not in s:
            continue
        config = s["throughput_config"]
        rows.append([v, describe_config(config),
                     f"{round(s['throughput_ips'], -2):,.0f}", _x(s.get("throughput_speedup")),
                     *[f"{s['peak_rss_mb'][k]:.0f} MB" if "peak_rss_mb" in s else "—" for k in sizes],
                     f"{s['load_ms']:.0f} ms" if "load_ms" in s else "—"])
    out += markdown_table(["variant", "best configuration", "images/s", "vs FP32's best",
                   *[f"peak RSS {k}" for k in sizes], "session load"], rows)
    out += ["", *runtimes_table(static_bench, sizes, cores, machine.get("openvino", ""))]
    return "\n".join(out)


def runtimes_table(bench: dict, sizes: list[str], cores: int, version: str) -> list[str]:
    """static.onnx and fp32.onnx on ONNX Runtime and OpenVINO, per batch size and thread
    count, from one bench JSON (every figure from the same interleaved rounds); the fastest
    INT8 cell of each row in bold."""
    ov = bench["runtimes"].get("openvino")
    if ov is None or "latency" not in ov:
        return []
    rows = []
    for bs in reversed(sizes):
        for count in bench["threads"]:
            key = f"threads{count}"
            ort, vino = bench["latency"][key][bs], ov["latency"][key][bs]
            cells = [f"{_ms(ort['p50_ms'])} ({_x(ort['speedup'])})",
                     f"{_ms(vino['p50_ms'])} ({_x(vino['speedup'])})"]
            fastest = 0 if ort["p50_ms"] <= vino["p50_ms"] else 1
            cells[fastest] = f"**{cells[fastest]}**"
            base = ov["baseline"]["latency"][key][bs]
            what = f"{bs[2:]}, {count} thread{'s' * (count != 1)}" + (" (all cores)" if count == cores else "")
            rows.append([what, _ms(ort["baseline_p50_ms"]), *cells,
                         f"{_ms(base['p50_ms'])} ({_x(base['speedup'])})"])
    ips = lambda t: f"{round(t['best']['ips'], -2):,.0f} img/s"  # noqa: E731
    cells = [f"{ips(bench['throughput'])} ({_x(bench['throughput']['speedup'])})",
             f"{ips(ov['throughput'])} ({_x(ov['throughput']['speedup'])})"]
    fastest = 0 if bench["throughput"]["best"]["ips"] >= ov["throughput"]["best"]["ips"] else 1
    cells[fastest] = f"**{cells[fastest]}**"
    rows.append([f"throughput, {bench['throughput']['batch_size']}, {cores} cores",
                 f"{round(bench['throughput']['baseline_best']['ips'], -2):,.0f} img/s", *cells,
                 f"{ips(ov['baseline']['throughput'])} ({_x(ov['baseline']['throughput']['speedup'])})"])
    return ["**Which runtime** (`bench.runtimes`: the same `.onnx` files on ONNX Runtime and "
            f"OpenVINO {version}, timed in the same rounds; speedups against FP32 on ONNX "
            "Runtime from those rounds):", "",
            *markdown_table(["batch, threads", "FP32, ONNX Runtime", "static, ONNX Runtime",
                     "static, OpenVINO", "FP32, OpenVINO"], rows)]


# Why a variant failed, in a table cell: the rule, not the whole message.
FAILED_SHORT = (("agreement_floor", "agreement floor"), ("differs from the fake-quant", "export parity"),
                ("McNemar", "real drop"))


# Why a variant was skipped, in a table cell (metrics/families.json has the whole line).
SKIPPED_SHORT = (("TorchScript exporter cannot write", "skipped: the TorchScript exporter cannot "
                  "write it as QDQ"), ("torch.fx cannot trace", "skipped: torch.fx cannot trace it"))


def _cell(v: dict, *, parity: bool = False) -> str:
    """'acc (agreement) xSPEED', or why there is none; a failed variant says which check."""
    if "accuracy" not in v:
        reason = v.get("skipped") or ""
        detail = re.search(r"ONNX export of operator (\w+)", reason)
        return next((short + (f" ({detail.group(1)})" if detail else "")
                     for key, short in SKIPPED_SHORT if key in reason), "skipped" if reason else "")
    text = f"{v['accuracy']:.3f} ({v['agreement']:.3f}) x{v['speedup']:.2f}"
    if parity and "parity_agreement" in v:
        text += f", parity {v['parity_agreement']:.3f}"
    if "failed" in v:
        rule = next((short for key, short in FAILED_SHORT if key in v["failed"]), "check")
        text += f" **failed: {rule}**"
    return text


def families_table(families: dict) -> str:
    """metrics/families.json (scripts/families.py) as a table: a row per model."""
    rows = families["rows"]
    batch = max(yaml.safe_load(str(families["settings"]["bench.batch_sizes"])))
    out = [f"| family | model | px | fp32 acc | static: acc (agreement) x bs{batch} | "
           f"qat: acc (agreement) x bs{batch}, export parity | dynamic: acc (agreement) x bs{batch} | "
           f"`recommended` bs{batch} | min |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["result"] != "ok":
            out.append(f"| {r['family']} | {r['model']} | {r['image_size']} | {r['result']} "
                       f"| | | | | {r['seconds'] / 60:.1f} |")
            continue
        rec = r["recommended"]
        runtime = {"onnxruntime": "ORT", "openvino": "OpenVINO"}.get(rec["runtime"], rec["runtime"])
        where = "" if rec["variant"] == "fp32" else f", {runtime} x{rec['speedup']:.2f}"
        out.append(f"| {r['family']} | {r['model']} | {r['image_size']} | {r['fp32_accuracy']:.3f} | "
                   f"{_cell(r['static'])} | {_cell(r['qat'], parity=True)} | {_cell(r['dynamic'])} | "
                   f"{rec['variant']}{where} | {r['seconds'] / 60:.1f} |")
    return "\n".join(out)


def engines_table(rows: list[dict]) -> str:
    """metrics/engines.json (scripts/engines.py): each case on each engine, with and without its
    fallback."""
    lines = ["| case | engine | fallback | test acc | drop pp | agreement | flips (lost/won) | "
             "nodes in float | static speedup (all cores / 1 thread) | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        one = f"{r['speedup_1thread']:.2f}" if r["speedup_1thread"] else "-"
        lines.append(
            f"| {r['case']} | {r['engine']} | {'yes' if r['fallback'] else 'no'} | "
            f"{r['accuracy']:.4f} | {r['drop_pp']:.2f} | {r['agreement']:.4f} | "
            f"{r['fp32_right_int8_wrong']}/{r['int8_right_fp32_wrong']} of {r['test_samples']} | "
            f"{r['nodes_in_float']} | x{r['speedup']:.2f} / x{one} ({r['batch']}) | "
            f"{r['quantize_seconds']:.1f} |")
    return "\n".join(lines)


def qat_hard_table(hard: dict) -> str:
    """metrics/qat_hard.json (scripts/qat_hard.py): the PTQ-hard twin, PTQ plain, PTQ + ladder, QAT."""
    table = hard["rows"]
    lines = [f"Measured on {table[0]['cpu']}; FP32 test accuracy {table[0]['fp32_accuracy']:.4f}, "
             f"channel {hard['channel']} scaled x{hard['scale']:g}.", "",
             "| variant | how | test acc | drop pp | flips (lost/won) | nodes in float | "
             "speedup (all cores / 1 thread) | seconds |", "|---|---|---|---|---|---|---|---|"]
    for r in table:
        how = ("QAT, params.yaml settings" if r["variant"] == "qat" else
               "PTQ + recovery ladder" if r["ladder"] else "PTQ, plain")
        lines.append(
            f"| {r['variant']} | {how} | {r['accuracy']:.4f} | {r['drop_pp']:.2f} | "
            f"{r['fp32_right_int8_wrong']}/{r['int8_right_fp32_wrong']} of {r['test_samples']} | "
            f"{r['nodes_in_float']} | x{r['speedup']:.2f} / x{r['speedup_1thread']:.2f} "
            f"({r['batch']}) | {r['seconds']:.1f} |")
    return "\n".join(lines)


def _pipeline(row: dict) -> str:
    if row.get("pipeline_seconds") is None:
        return "—"
    train = row.get("train_seconds")
    return f"{row['pipeline_seconds']:.0f} s" + (f" (train {train:.0f} s)" if train else "")


def segmentation_table(record: dict) -> str:
    """metrics/segmentation.json (scripts/segmentation.py): the default segmenter on the
    embedded canvases and on the same canvases as a `masks` folder."""
    rows = record["rows"]
    sizes = sorted(rows[0]["latency_p50_ms"], key=lambda k: int(k[2:]))
    small, big = sizes[0], sizes[-1]
    head = ["data", "model", "variant", "mIoU", "pixel accuracy", "drop (points)",
            "pixel agreement", "size (MB)", f"speedup, 1 thread ({small} / {big})",
            f"speedup, all cores ({small} / {big})", "pipeline"]
    body = []
    for r in rows:
        one, every = r.get("speedup_1thread") or {}, r.get("speedup") or {}
        body.append([r["run"], r["model"], r["variant"], f"{r['miou']:.4f}",
                     f"{r['pixel_accuracy']:.4f}", f"{r['miou_drop_pts']:.2f}",
                     f"{r['agreement']:.4f}", f"{r['size_bytes'] / 1e6:.2f}",
                     f"{_x(one.get(small))} / {_x(one.get(big))}",
                     f"{_x(every.get(small))} / {_x(every.get(big))}", _pipeline(r)])
    note = (f"Measured on {rows[0]['cpu']}, {rows[0]['cores']} cores. mIoU (over the classes "
            "present, background included), pixel accuracy and the drop on the test split; "
            "pixel agreement: the share of test pixels whose class is FP32's. Speedups: FP32's "
            "p50 from the same interleaved rounds / the variant's, on ONNX Runtime. Pipeline: "
            "`dvc repro` from scratch.")
    return "\n".join(markdown_table(head, body) + ["", note])


def detection_table(record: dict) -> str:
    """metrics/detection.json (scripts/detection.py): the default detector, its decode quantized,
    a dark calibration set, and the same detector brought as a YOLO-layout ONNX."""
    rows = record["rows"]
    sizes = rows[0]["sizes"]
    big = sizes[-1]
    head = ["model", "variant", "mAP@[.5:.95]", "mAP@.5", "drop (points)", "agreement",
            f"model speedup, 1 thread (bs1 / {big})", f"model speedup, all cores ({big})",
            f"end to end, 1 thread (bs1 / {big})", "decode", "convs in float",
            "calibration warnings", "pipeline"]
    body = []
    for r in rows:
        pair = lambda d: "—" if not d else f"{_x(d.get('bs1'))} / {_x(d.get(big))}"  # noqa: E731
        decode = {True: "float", False: "INT8", None: "—"}[r.get("decode_in_float")]
        warnings = r.get("calibration_warnings") or []
        body.append([r["name"], r["variant"], f"{r['map_50_95']:.4f}", f"{r['map_50']:.4f}",
                     f"{r['map_drop_pts']:.2f}", f"{r['agreement']:.4f}",
                     pair(r.get("speedup_1thread")), _x(r.get("speedup", {}).get(big)),
                     pair(r.get("end_to_end_speedup_1thread")), decode,
                     "—" if r.get("nodes_in_float") is None else str(len(r["nodes_in_float"])),
                     "; ".join(w.split(": ", 1)[1].split(" averages")[0] for w in warnings) or
                     ("none" if r["variant"] == "static" else "—"),
                     _pipeline(r)])
    stages = record.get("stage_seconds", {})
    note = (f"Measured on {rows[0]['cpu']}. mAP and drop on the test split; agreement: matched "
            "detections with FP32 (IoU >= 0.5, same label; the lower of both directions). "
            "Speedups: FP32's p50 from the same interleaved rounds / the variant's. Pipeline: "
            "`dvc repro` from scratch (the dark-calibration row ran two stages by hand; the "
            "quantized-decode row re-ran the static branch only). Stage times of the default "
            f"run: train {stages.get('train', 0):.0f} s, quantize_static "
            f"{stages.get('quantize_static', 0):.0f} s"
            + (f", quantize_qat {stages['quantize_qat']:.0f} s" if stages.get("quantize_qat") else "")
            + ".")
    cut = record.get("faster_rcnn_cut")
    if cut:
        note += (" Faster R-CNN's fixed-shape graph against torchvision's own inference (the "
                 "RPN's proposals after NMS, every class's box) on the same weights and test "
                 f"split: mAP@[.5:.95] {cut['graph_map_50_95']:.4f} vs "
                 f"{cut['torchvision_map_50_95']:.4f}, mAP@.5 {cut['graph_map_50']:.4f} vs "
                 f"{cut['torchvision_map_50']:.4f}.")
    return "\n".join(markdown_table(head, body) + ["", note])


PEER_NAMES = {("fp32", "onnxruntime"): "quantpipe FP32, ONNX Runtime",
              ("static", "onnxruntime"): "quantpipe static INT8, ONNX Runtime",
              ("static", "openvino"): "quantpipe static INT8, OpenVINO",
              ("ultralytics_openvino_int8", "openvino"):
                  "Ultralytics OpenVINO INT8 (NNCF, calibrated on train)",
              ("ultralytics_openvino_int8_calib_val", "openvino"):
                  "Ultralytics OpenVINO INT8 (NNCF, its default: calibrated on val)",
              ("ultralytics_openvino_fp32", "openvino"): "Ultralytics OpenVINO FP32",
              ("nncf_mixed", "onnxruntime"):
                  "quantpipe static INT8, `nncf` engine (preset mixed), ONNX Runtime",
              ("nncf_mixed", "openvino"):
                  "quantpipe static INT8, `nncf` engine (preset mixed), OpenVINO",
              ("nncf_mixed_no_bc", "openvino"):
                  "quantpipe static INT8, `nncf` engine (preset mixed, bias correction none), "
                  "OpenVINO"}


PEER_REFERENCE = "ultralytics_openvino_int8"  # what each row's mAP interval is taken against


def yolo_peer_table(record: dict) -> str:
    """metrics/yolo_peer.json (scripts/yolo_peer.py): quantpipe's static against Ultralytics'
    own OpenVINO INT8 export, same model, same test images, same timing rounds."""
    if not record.get("models"):
        return "No run recorded yet: `python scripts/yolo_peer.py`, then `make docs`."
    out = []
    for family, m in record["models"].items():
        big = next(k for k in m["rows"][0] if k.startswith("p50_ms_all_bs")).rsplit("bs", 1)[1]
        head = ["model", "mAP@[.5:.95]", "drop (points)", "p50 1 thread bs1", "vs FP32",
                f"p50 {m['cores']} threads bs{big}", "vs FP32"]
        body = [[PEER_NAMES.get((r["variant"], r["runtime"]), f"{r['variant']}, {r['runtime']}"),
                 f"{r['map_50_95']:.4f}", f"{r['map_drop_pts']:.2f}",
                 _ms(r["p50_ms_1thread_bs1"]), _x(r["speedup_1thread_bs1"]),
                 _ms(r[f"p50_ms_all_bs{big}"]), _x(r[f"speedup_all_bs{big}"])] for r in m["rows"]]
        if "vs_ultralytics_int8_pts_90" in m["rows"][0]:  # runs before the bootstrap have none
            head.insert(3, "vs Ultralytics INT8, 90% (points)")
            for row, r in zip(body, m["rows"]):
                low, high = r["vs_ultralytics_int8_pts_90"]
                row.insert(3, "reference" if r["variant"] == PEER_REFERENCE
                           else f"{low:+.2f} to {high:+.2f}")
        val = m["ultralytics_validator"]["onnx"]
        gap = "" if "rect_false" not in val else (
            f" Ultralytics' validator on the same ONNX file and test images: mAP@[.5:.95] "
            f"{val['rect_false']['map_50_95']:.4f} at imgsz (rect=False), "
            f"{val['rect_true']['map_50_95']:.4f} by default (rect=True).")
        green = "green" if m["green_report"] else "failed its gates"
        kernels = m.get("ort_kernels_1thread_bs1")
        where = "" if not kernels else (
            "ONNX Runtime's kernel time at 1 thread, bs1, under its profiler (which adds a cost "
            "per node: compare the shares): FP32 "
            f"{describe_profile(kernels['fp32'], ops=4)}; static "
            f"{describe_profile(kernels['static'], ops=4)}.")
        out += [f"**{family}** ({m['params']:,} parameters, {m['epochs']} epochs at "
                f"{record['imgsz']} px): the README's recipe as written ran to a {green} report; "
                f"{m['mac_share_int8']:.2%} of static's MACs in INT8.{gap}", "",
                *markdown_table(head, body), "", *([where, ""] if where else [])]
    cpu = next(iter(record["models"].values()))["cpu"]
    out.append(f"Measured on {cpu}, in one run (scripts/yolo_peer.py). mAP on the dataset's test "
               "split, every model scored by quantpipe's decode and COCO evaluation; vs "
               "Ultralytics INT8: the row's mAP minus that of Ultralytics' INT8 calibrated on "
               "train, 5th to 95th percentile over 200 paired resamples of the test images "
               "(an interval that holds 0 is no measured difference); p50 from "
               "the same interleaved rounds, OpenVINO models compiled at each batch's static "
               "shape; vs FP32: FP32 on ONNX Runtime's p50 / the row's.")
    return "\n".join(out)


# (label, variant) rows of the precision table, each on every runtime that ran it.
PRECISIONS = (("FP32", "fp32"), ("BF16 (the FP32 file)", "bf16"), ("INT8 static", "static"),
              ("INT8 QAT", "qat"), ("INT8 dynamic", "dynamic"))


def precision_table(summary: dict, threads: int | None = None) -> str:
    """Which precision on which CPU: FP32, BF16 and INT8 on each runtime, at the headline thread
    count (all cores) against FP32 on ONNX Runtime (same rounds) and, for INT8 at its best,
    against BF16 at its best; or at `threads` (by_threads), without the best-vs-best columns
    (a best is over every thread count)."""
    sizes = _sizes(summary)
    titles = summary["runtimes"]
    reference = next(iter(titles))
    score, drop, unit, _ = score_keys(summary)
    rows = []
    for label, v in PRECISIONS:
        s = summary.get(v)
        if s is None:
            continue
        runtimes = {**({} if "runtime" in s else {reference: s}), **s.get("runtimes", {})}
        if threads:
            runtimes = {name: e["by_threads"][f"threads{threads}"] for name, e in runtimes.items()
                        if f"threads{threads}" in e.get("by_threads", {})}
        first = True
        for name, e in runtimes.items():
            if "latency_p50_ms" not in e:
                continue
            versus = s.get("speedup_vs_bf16", {}) if first else {}
            first = False
            speed = ["x1.00" if v == "fp32" and name == reference else _x(e.get("speedup", {}).get(k))
                     for k in sizes]
            rows.append([label + (" (failed)" if "failed" in s or "failed" in e else ""),
                         titles[name], f"{s[score]:.4f}",
                         "—" if drop not in s else f"{s[drop]:.2f}",
                         *[_ms(e["latency_p50_ms"][k]) for k in sizes], *speed,
                         *([] if threads else [_x(versus.get(k)) for k in sizes])])
    head = ["precision", "runtime", score, f"drop ({unit})", *[f"p50 {k}" for k in sizes],
            *[f"vs FP32 on {titles[reference]}, {k}" for k in sizes],
            *([] if threads else [f"INT8 best vs BF16 best, {k}" for k in sizes])]
    cores = summary["machine"]["cores"]
    skipped = summary.get("skipped", {}).get("bf16")
    if threads:
        note = (f"{threads} thread{'s' * (threads != 1)}. \"vs FP32\": FP32 on "
                f"{titles[reference]} at {threads} thread{'s' * (threads != 1)}, timed in the same "
                "interleaved rounds.")
    else:
        note = (f"All {cores} cores. \"vs FP32\": FP32 on {titles[reference]} timed in the same "
                "interleaved rounds. \"INT8 best vs BF16 best\": the variant at its fastest "
                "runtime and setting against the FP32 file in BF16 at its fastest, timed in the "
                "same rounds (one value per variant, on its first line).")
    if skipped:
        note += f" No BF16 row: {skipped}."
    return "\n".join([f"Measured on {describe(summary['machine'])}.", "", *markdown_table(head, rows), "",
                      note])


# How the files of scripts/ort_amx.py read in a table.
AMX_FILES = {"fp32": "FP32", "bf16": "FP32 file in BF16", "s8_symmetric": "INT8, S8 symmetric weights (quantpipe)",
             "s8_zero_points": "INT8, S8 weights with zero points (per tensor)", "u8_weights": "INT8, U8 weights"}


def ort_amx_table(record: dict) -> str:
    """scripts/ort_amx.py: each file on each runtime, its convolutions' kernel and ISA, p50 and
    the speedup against FP32 on ONNX Runtime from the same rounds, at every thread count."""
    threads = record["models"][0]["threads"]
    head = ["model", "runtime", "file", "convolutions ran on",
            *[h for t in threads for h in (f"p50, {t} thread{'s' * (t != 1)}", f"vs FP32 ORT, {t}")]]
    body = []
    for m in record["models"]:
        for row in m["rows"]:
            convs = sorted({f"{k['isa']} ({k['kernel']})" for k in row["kernels"].values() if "Conv" in k["layer"]})
            body.append([f"{m['model']} {m['image_size']} px bs{m['batch_size']}",
                         "ONNX Runtime" if row["runtime"] == "onnxruntime" else "OpenVINO",
                         AMX_FILES[row["file"]], "; ".join(convs),
                         *[c for t in threads for c in (_ms(row[f"threads{t}"]["p50_ms"]),
                                                        _x(row[f"threads{t}"]["speedup"]))]])
    return "\n".join([f"Measured on {describe(record['machine'])}. Random weights (speed only); "
                      "every row of a model timed in the same interleaved rounds.", "",
                      *markdown_table(head, body)])


SCALE_STAGES = ("prepare", "quantize_static", "evaluate@static")


def scale_table(record: dict) -> str:
    """metrics/scale.json (scripts/scale.py): per dataset size, each stage's wall time, images
    per second and peak RSS, and how the peak changed from the size above."""
    def peak(r: dict) -> float:  # the stage process or its largest worker
        return max(r["peak_rss_mb"], r.get("workers_peak_rss_mb") or 0.0)

    runs = sorted(record["runs"].values(), key=lambda r: r["images"])
    head = ["images", *[h for s in SCALE_STAGES for h in (f"{s}: wall", f"{s}: peak RSS")],
            "static accuracy"]
    body = []
    for before, run in zip([None, *runs], runs):
        cells = [f"{run['images']:,}"]
        for stage in SCALE_STAGES:
            r = run[stage]
            growth = "" if before is None else f" ({peak(r) / peak(before[stage]) - 1:+.0%})"
            cells += [f"{r['wall_seconds']:.0f} s ({r['images_per_second']:,.0f} img/s)",
                      f"{peak(r):,.0f} MB{growth}"]
        body.append(cells + [f"{run['static_accuracy']:.4f}"])
    return "\n".join([f"Measured on {record['machine']}; {record['size_px']} px RGB JPEGs. Wall: "
                      "`dvc repro -s <stage>` timed from outside (DVC's hashing and caching of the "
                      "outputs included); img/s: the stage's own count of images through a model "
                      "(prepare: decoded) per second of its work; peak RSS: the stage process or "
                      "its largest worker (VmHWM), in brackets the change from the size above.",
                      "", *markdown_table(head, body)])


# speedup_family (quantpipe/review.py) -> what it is, in the spread table.
SPREAD_FAMILIES = {
    "speedup": "`speedup.bsN` (ONNX Runtime, the first `bench.threads`)",
    "by_threads": "`by_threads.threadsT.speedup.bsN`",
    "best": "`best.latency.bsN.speedup` (the recommendation's)",
    "throughput": "`throughput_speedup`, `best.throughput.speedup`",
    "per_runtime": "`runtimes.<runtime>.*` (each runtime's own)",
    "vs_bf16": "`*_vs_bf16`",
}


def spread_table(record: dict) -> str:
    """metrics/spread.json (scripts/spread.py): how far what the gate compares moved with
    nothing changed but the run, the seed or the machine."""
    families = record["speedup"]["families"]
    body = []
    for family, title in SPREAD_FAMILIES.items():
        if family in families:
            worst = families[family]
            values = ", ".join(f"{v:.2f}" for v in worst["values"])
            body.append([f"speedups: {title}", "yes" if family in GATED_SPEEDUPS else "no",
                         f"-{worst['largest_fall']:.1%}", f"`{worst['path']}`: x{values}"])
    accuracy = record["accuracy"]

    def widest(pp: dict[str, float]) -> list[str]:
        path = max(pp, key=lambda k: abs(pp[k]))
        return [f"{abs(pp[path]):.2f} pp", f"`{path}`" if pp[path] else "every row"]

    body.append([f"accuracy: the pipeline re-run ({len(accuracy['rerun_pp'])} rows)", "yes",
                 *widest(accuracy["rerun_pp"])])
    seeds = ", ".join(map(str, accuracy["seeds"]))
    body.append([f"accuracy: seeds {seeds} (split and training)", "yes",
                 *widest(accuracy["seed_range_pp"])])
    other = accuracy.get("other_machine")
    if other:
        body.append([f"accuracy: measured on {other['machine'].split(';')[0]} ({other['rev']})", "yes",
                     *widest(other["diff_pp"])])
    return "\n".join([f"Measured on {record['machine']}: bench of unchanged models run "
                      f"{record['bench_runs']} times (largest fall between two runs, 1 - min/max, "
                      "with the values of the worst figure); accuracy re-run, re-trained with "
                      "other seeds (largest range) and measured on another machine (largest "
                      "difference).", "",
                      *markdown_table(["what", "gated", "largest change", "worst, values"], body)])


def ort_threads_table(record: dict) -> str:
    """scripts/ort_threads.py: each INT8 file's speedup over FP32 (same rounds, same session
    options) at every thread count, per batch size; then ONNX Runtime's time per op type at all
    cores and the largest batch."""
    machine, counts = record["machine"], record["threads"]
    out = [f"Measured on {describe(machine)} (scripts/ort_threads.py; FP32 under the same "
           "session options in the same rounds).", ""]
    for bs in reversed([f"bs{b}" for b in record["batch_sizes"]]):
        rows = []
        for model, option in _threads_rows(record["latency"]):
            by = record["latency"][option][model]
            if model != "fp32":
                rows.append([model, option] + [
                    f"{_x(by[f'threads{c}'][bs]['speedup'])} (p99 {_ms(by[f'threads{c}'][bs]['p99_ms'])})"
                    for c in counts])
        fp32 = record["latency"]["bench"]["fp32"]
        rows.insert(0, ["fp32", "bench"] + [f"{_ms(fp32[f'threads{c}'][bs]['p50_ms'])} (p99 "
                                            f"{_ms(fp32[f'threads{c}'][bs]['p99_ms'])})" for c in counts])
        head = ["file", "session options"] + [f"{c} thread{'s' * (c != 1)}" for c in counts]
        out += [f"Batch {bs[2:]}: speedup over FP32 (the fp32 row: its p50):", "", *markdown_table(head, rows), ""]
    largest = max(record["batch_sizes"])
    rows = []
    for model, option in _threads_rows(record["profile"]):
        prof = record["profile"][option][model]
        rows.append([model, option, f"{prof['kernel_ms']:.3f} ms",
                     describe_profile(prof, ops=4).split(" (", 1)[-1].rstrip(")")])
    out += [f"ONNX Runtime's kernel time at {machine['cores']} threads, batch {largest}:", "",
            *markdown_table(["file", "session options", "kernel time", "by op type"], rows)]
    if "node_scaling" in record:
        out += ["", *node_scaling_table(record["node_scaling"], machine["cores"], largest)]
    vino = record.get("openvino")
    if vino:
        bs = f"bs{largest}"
        rows = [[m] + [f"{_ms(by[f'threads{c}'][bs]['p50_ms'])}"
                       + (f" (x{by[f'threads{c}'][bs]['speedup']:.2f} static)" if "speedup" in by[f"threads{c}"][bs] else "")
                       for c in counts] for m, by in vino.items()]
        out += ["", f"The same static file and its NHWC-flatten rewrite on OpenVINO, batch {largest} "
                "(p50; the rewrite against static in the same rounds):", "",
                *markdown_table(["file", *[f"{c} thread{'s' * (c != 1)}" for c in counts]], rows)]
    if "batch_split" in record:
        out += ["", *batch_split_table(record["batch_split"], machine["cores"], largest)]
    return "\n".join(out)


def batch_split_table(split: dict, cores: int, batch: int) -> list[str]:
    """scripts/ort_threads.py's batch split: one session, a logic stream per slice of the batch,
    against static and FP32 at all cores in the same rounds, and the threads that ran its nodes."""
    lat = split["latency"]
    rows = [[m, _ms(lat[m]["p50_ms"]), _ms(lat[m]["p99_ms"]),
             "—" if m == "fp32" else _x(lat["fp32"]["p50_ms"] / lat[m]["p50_ms"])] for m in lat]
    threads = split["node_threads"]
    return [f"One session with the batch of {batch} cut into {split['parts']} slices, each a logic "
            f"stream of ONNX Runtime's parallel executor ({split['inter_op_threads']} inter-op "
            f"threads, {split['intra_op_threads']} intra-op thread{'s' * (split['intra_op_threads'] != 1)} "
            f"each), against static and FP32 at {cores} threads in the same rounds; its nodes ran on "
            f"{threads} thread{'s' * (threads != 1)} (ORT's profile):", "",
            *markdown_table(["file", "p50", "p99", "speedup over FP32"], rows)]


def node_scaling_table(scaling: dict[str, dict], cores: int, batch: int) -> list[str]:
    """scripts/ort_threads.py's per-node profiles: each file's nodes at 1 thread and at all cores
    and the ratio (how much each layer's kernel gains from the cores; below 1 it loses)."""
    rows = []
    for model, _ in _threads_rows({"bench": scaling}):
        one, many = (scaling[model][k] for k in ("threads1", f"threads{cores}"))
        times = [{n["node"]: n for n in p["top_nodes"]} for p in (one, many)]
        # Nodes with 2% of the time at either count: one that loses time with the cores too.
        nodes = sorted({name for t in times for name, n in t.items() if n["share"] >= 0.02},
                       key=lambda name: -times[0].get(name, {"ms": 0.0})["ms"])
        for name in nodes:
            a, b = (t.get(name) for t in times)
            op = (a or b)["op"]
            rows.append([model, f"{name} ({op})", *(f"{n['ms']:.3f} ms" if n else "—" for n in (a, b)),
                         f"x{a['ms'] / b['ms']:.2f}" if a and b and b["ms"] else "—"])
    return [f"Each node's kernel time at 1 thread and at {cores} threads, batch {batch} (bench's "
            "session options; each file's nodes with 2% or more of its time at either):", "",
            *markdown_table(["file", "node (op type)", "1 thread", f"{cores} threads",
                             "gain from the cores"], rows)]


def _threads_rows(by_option: dict[str, dict]) -> list[tuple[str, str]]:
    """(file, options) pairs of scripts/ort_threads.py's record, by file as the script lists
    them (FP32, then quantpipe's static first), then by option."""
    order = ("fp32", "static", "static_nhwc_flatten", "first_layer_float", "qoperator", "zero_points")
    options = ("bench", "spinning", "block_base_4")
    pairs = {(m, o) for o, models in by_option.items() for m in models}
    rank = lambda name, names: names.index(name) if name in names else len(names)  # noqa: E731
    return sorted(pairs, key=lambda mo: (rank(mo[0], order), mo[0], rank(mo[1], options), mo[1]))


def machine_tables(machines: list[tuple[str, dict, dict | None, dict | None]], root: Path) -> str:
    """A section per machine: INT8's speedup over FP32 at every thread count benched (each
    runtime; the largest and the smallest batch), what is recommended with its tail, the server
    configuration and, when it ran there, scripts/ort_threads.py's tables. machines: (where its
    files are, summary.json, ort_threads.json or None, models.json or None); root: the project,
    whose dvc.lock names the model files of its own metrics."""
    out = []
    locked = locked_models(root)
    for where, summary, threads, files in machines:
        machine = summary["machine"]
        sizes = _sizes(summary)
        counts = sorted(int(k.removeprefix("threads")) for k in summary["fp32"]["by_threads"])
        titles = summary["runtimes"]
        reference = next(iter(titles))
        out += [f"### {machine['cpu']}, {machine['cores']} cores (`{where}`)", "",
                f"Measured on {describe(machine)}.{_files_note(files, locked)}", ""]
        for bs in dict.fromkeys((sizes[-1], sizes[0])):
            rows = []
            for v in ("fp32", "dynamic", "static", "qat", "bf16"):
                if v not in summary:
                    continue
                s = summary[v]
                runtimes = {s.get("runtime", reference): s["by_threads"],
                            **{n: e["by_threads"] for n, e in s.get("runtimes", {}).items()
                               if "by_threads" in e}}
                for name, by in runtimes.items():
                    cells = []
                    for c in counts:
                        t = by.get(f"threads{c}")
                        if t is None:
                            cells.append("—")
                            continue
                        p50, p99 = t["latency_p50_ms"][bs], t["latency_p99_ms"][bs]
                        speed = f" {_x(t['speedup'][bs])}" if "speedup" in t else ""
                        cells.append(f"{_ms(p50)}{speed}, p99 {_ms(p99)}")
                    rows.append([v, titles[name], *cells])
            head = ["variant", "runtime", *[f"{c} thread{'s' * (c != 1)}"
                                           + (" (all)" if c == machine["cores"] else "") for c in counts]]
            out += [f"Batch {bs[2:]}: p50, speedup over FP32 on {titles[reference]} at the same "
                    "threads (same rounds), p99:", "", *markdown_table(head, rows), ""]
        for bs, r in summary.get("recommended", {}).items():
            gain = f", x{r['speedup']:.2f} the best FP32" if "speedup" in r else ""
            out.append(f"- Recommended at {bs}: `{r['variant']}` on {describe_setting(r, titles)}, "
                       f"p50 {_ms(r['p50_ms'])}, p99 {_ms(r['p99_ms'])}{gain}.")
        srv = summary.get("server")
        if srv:
            gain = f", x{srv['speedup']:.2f} FP32's best" if "speedup" in srv else ""
            out.append(f"- Server (bs{srv['batch_size']}): `{srv['variant']}` on "
                       f"{describe_setting(srv, titles)}, {round(srv['ips'], -2):,.0f} images/s{gain}.")
        out.append("")
        if threads is not None:
            out += [ort_threads_table(threads), ""]
    return "\n".join(out).rstrip()


def locked_models(root: Path) -> dict[str, str]:
    """models/<name>.onnx -> the md5 dvc.lock records for it."""
    lock = root / "dvc.lock"
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {}) if lock.exists() else {}
    return {Path(o["path"]).name: o.get("md5") for stage in stages.values()
            for o in stage.get("outs", []) if re.fullmatch(r"models/[^/]+\.onnx", o["path"])}


def _files_note(files: dict[str, str] | None, locked: dict[str, str]) -> str:
    """Which model files another machine measured (scripts/remote_bench.py's models.json: name
    -> md5), against dvc.lock's."""
    if files is None:
        return ""
    if files and all(locked.get(name) == md5 for name, md5 in files.items()):
        return " The model files of `dvc.lock`."
    return (" Other model files than `dvc.lock`'s (the pipeline re-run where they were packed, on"
            " another CPU: training differs across CPUs); accuracy and speedups are of those files.")


def render(name: str, root: Path) -> str:
    read = lambda rel: json.loads((root / rel).read_text())  # noqa: E731
    if name in ONE_FILE_BLOCKS:
        table, rel = ONE_FILE_BLOCKS[name]
        return table(read(rel))
    if name == "headline":
        spread = root / "metrics/spread.json"
        return headline_table(read("metrics/summary.json"),
                              json.loads(spread.read_text()) if spread.exists() else None)
    if name == "default":
        return default_tables(read("metrics/summary.json"), read("metrics/bench/static.json"))
    if name == "runtimes":
        summary = read("metrics/summary.json")
        return "\n".join(runtimes_table(read("metrics/bench/static.json"), _sizes(summary),
                                         summary["machine"]["cores"],
                                         summary["machine"].get("openvino", "")))
    if name == "precision_one_thread":
        return precision_table(read("metrics/summary.json"), threads=1)
    if name == "machines":
        # This machine's ort_threads tables are docs/runtimes.md's; another's are its section's.
        others = [p.parent for p in sorted((root / "metrics/machines").glob("*/summary.json"))]
        optional = lambda path: json.loads(path.read_text()) if path.exists() else None  # noqa: E731
        return machine_tables(
            [("metrics/summary.json", read("metrics/summary.json"), None, None)]
            + [(f"{d.relative_to(root)}/", json.loads((d / "summary.json").read_text()),
                optional(d / "ort_threads.json"), optional(d / "models.json")) for d in others], root)
    if name == "yolo_peer":
        path = root / "metrics/yolo_peer.json"
        return yolo_peer_table(read("metrics/yolo_peer.json") if path.exists() else {})
    raise ValueError(f"unknown generated block {name!r}")


# Blocks that are one function of one metrics file: block name -> (function, file).
ONE_FILE_BLOCKS = {
    "families": (families_table, "metrics/families.json"),
    "engines": (engines_table, "metrics/engines.json"),
    "qat_hard": (qat_hard_table, "metrics/qat_hard.json"),
    "detection": (detection_table, "metrics/detection.json"),
    "segmentation": (segmentation_table, "metrics/segmentation.json"),
    "precision": (precision_table, "metrics/summary.json"),
    "ort_amx": (ort_amx_table, "metrics/ort_amx.json"),
    "scale": (scale_table, "metrics/scale.json"),
    "spread": (spread_table, "metrics/spread.json"),
    "ort_threads": (ort_threads_table, "metrics/ort_threads.json"),
    "deploy_sizes": (deploy_sizes_table, "metrics/deploy_sizes.json"),
}


def regenerate(text: str, root: Path) -> str:
    """A document's text with every generated block rendered anew from root's metrics."""
    return BLOCK.sub(lambda m: f"{m.group(1)}{render(m.group(2), root)}\n{m.group(4)}", text)


def documents(root: Path) -> list[Path]:
    return [p for pattern in DOCUMENTS for p in sorted(root.glob(pattern))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a document differs")
    parser.add_argument("--root", type=Path, default=Path("."), help="the project (default: .)")
    args = parser.parse_args()
    stale = []
    for path in documents(args.root):
        text = path.read_text()
        new = regenerate(text, args.root)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    # Here, not at the top: the measuring scripts print their tables with this module on machines
    # that may lack matplotlib (scripts/remote_bench.py's target runs scripts/ort_threads.py).
    from quantpipe import pictures

    drawn = []
    for path, data in pictures.render(args.root).items():
        if not path.exists() or path.read_bytes() != data:
            drawn.append(path)
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
    if args.check and (stale or drawn):
        what = f"{stale[0]}: its tables" if stale else f"{drawn[0]}: the picture"
        print(f"{what} differ from metrics/; run `make docs` and commit it", file=sys.stderr)
        return 1
    for path in stale:
        print(f"rewrote the tables of {path}")
    for path in drawn:
        print(f"drew {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
