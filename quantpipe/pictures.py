"""The pictures of README.md and docs/, drawn from the committed metrics by `make docs`
(quantpipe.docs) and checked like its tables: the same metrics give the same bytes
(matplotlib's SVG with text kept as text, a fixed hash salt and no date).

- docs/img/tradeoff.svg: what each INT8/BF16 variant buys (speedup over FP32 on ONNX Runtime,
  same rounds) against what it costs (the drop in the task's score), per runtime, at the largest
  batch and all cores, and at 1 thread;
- docs/img/speedup_threads.svg: speedup over FP32 against threads, per variant and runtime, at
  the smallest and the largest batch;
- docs/img/detection_example.svg: test canvases with the ground truth and FP32's and static
  INT8's detections (metrics/detection_example.json, scripts/detection_example.py).
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import numpy as np  # noqa: E402

from quantpipe.report import score_keys  # noqa: E402

STYLE = {"svg.hashsalt": "quantpipe", "svg.fonttype": "none", "font.size": 9,
         "axes.spines.top": False, "axes.spines.right": False}
VARIANTS = ("dynamic", "static", "qat", "bf16")
COLORS = {"dynamic": "#4c72b0", "static": "#dd8452", "qat": "#55a868", "bf16": "#c44e52"}
MARKERS = ("o", "s", "^", "D")  # per runtime, in summary["runtimes"] order
LINES = ("-", "--", ":", "-.")


def _entries(summary: dict, variant: str) -> dict[str, dict]:
    """A variant's figures per runtime: the row's own keys are its runtime's (the reference's,
    or for bf16 the one that ran it), the others under `runtimes`."""
    row = summary[variant]
    own = row.get("runtime", next(iter(summary["runtimes"])))
    return {own: row, **{name: e for name, e in row.get("runtimes", {}).items()
                         if "speedup" in e and not e.get("failed")}}


def _machine(summary: dict) -> str:
    machine = summary["machine"]
    return f"{machine['cpu']}, {machine['cores']} cores (metrics/machine.json)"


def _svg(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="svg", metadata={"Date": None})
    plt.close(fig)
    return buffer.getvalue()


def tradeoff(summary: dict) -> bytes:
    score, drop, unit, _ = score_keys(summary)
    largest = sorted(summary["fp32"]["latency_p50_ms"], key=lambda k: int(k[2:]))[-1]
    runtimes = list(summary["runtimes"])
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.4), sharey=True)
        for ax, threads in zip(axes, ("all", "threads1")):
            for variant in VARIANTS:
                if variant not in summary or drop not in summary[variant]:
                    continue
                for name, entry in _entries(summary, variant).items():
                    if threads != "all":
                        entry = entry.get("by_threads", {}).get(threads)
                        if entry is None:
                            continue
                    x = entry["speedup"].get(largest)
                    if x is None:
                        continue
                    ax.scatter(x, summary[variant][drop], s=40, color=COLORS[variant],
                               marker=MARKERS[runtimes.index(name) % len(MARKERS)],
                               label=f"{variant}, {summary['runtimes'][name]}")
            ax.axvline(1.0, color="grey", lw=0.8)
            ax.axhline(0.0, color="grey", lw=0.8)
            cores = summary["machine"]["cores"]
            ax.set_title(f"{largest}, {'all ' + str(cores) + ' cores' if threads == 'all' else '1 thread'}")
            ax.set_xlabel("speedup over FP32 on ONNX Runtime (same rounds)")
        axes[0].set_ylabel(f"{score} drop ({unit}; below 0 a gain)")
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
        fig.suptitle(f"Speed against {score}: {_machine(summary)}", fontsize=9)
        fig.tight_layout()
        return _svg(fig)


def speedup_threads(summary: dict) -> bytes:
    sizes = sorted(summary["fp32"]["latency_p50_ms"], key=lambda k: int(k[2:]))
    runtimes = list(summary["runtimes"])
    counts = sorted(int(k.removeprefix("threads")) for k in summary["fp32"]["by_threads"])
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.4), sharey=True)
        for ax, bs in zip(axes, (sizes[0], sizes[-1])):
            for variant in VARIANTS:
                if variant not in summary:
                    continue
                for name, entry in _entries(summary, variant).items():
                    points = [(c, entry["by_threads"][f"threads{c}"]["speedup"].get(bs))
                              for c in counts if f"threads{c}" in entry.get("by_threads", {})]
                    points = [(c, x) for c, x in points if x is not None]
                    if not points:
                        continue
                    ax.plot(*zip(*points), marker=MARKERS[runtimes.index(name) % len(MARKERS)],
                            ls=LINES[runtimes.index(name) % len(LINES)], color=COLORS[variant],
                            label=f"{variant}, {summary['runtimes'][name]}")
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xticks(counts, [str(c) for c in counts])
            ax.set_title(bs)
            ax.set_xlabel("threads")
        axes[0].set_ylabel("speedup over FP32 (ONNX Runtime)")
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
        fig.suptitle(f"Speedup by threads: {_machine(summary)}", fontsize=9)
        fig.tight_layout()
        return _svg(fig)


def detection_example(record: dict) -> bytes:
    """Test canvases with their ground truth, FP32's and static INT8's detections (the user's
    decode: detect.score_threshold and NMS), one panel per canvas."""
    from PIL import Image

    images = record["images"]
    names = record["class_names"]
    styles = {"truth": ("#2ca02c", "-", 2.2), "fp32": ("#4c72b0", "-", 1.2),
              "static": ("#dd8452", "--", 1.2)}
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, len(images), figsize=(2.1 * len(images), 2.6))
        for ax, image in zip(np.atleast_1d(axes), images):
            pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(image["png"]))))
            ax.imshow(pixels, cmap="gray" if pixels.ndim == 2 else None, vmin=0, vmax=255,
                      interpolation="nearest")
            for kind, (color, ls, lw) in styles.items():
                for x1, y1, x2, y2, label, *score in image[kind]:
                    ax.add_patch(plt.Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False,
                                               color=color, ls=ls, lw=lw))
                    if kind != "truth":  # FP32's label above the box, static's below
                        ax.text(x1, y1 - 1 if kind == "fp32" else y2 + 1, f"{names[label]} {score[0]:.2f}",
                                color=color, fontsize=6, va="bottom" if kind == "fp32" else "top")
            counts = ", ".join(f"{k} {len(image[k])}" for k in styles)
            ax.set_title(f"test #{image['index']}: {counts}", fontsize=7)
            ax.set_axis_off()
        handles = [plt.Line2D([], [], color=c, ls=ls, lw=lw) for c, ls, lw in styles.values()]
        fig.legend(handles, ["ground truth", "FP32 (fp32.onnx)", "static INT8 (static.onnx)"],
                   loc="lower center", ncol=3, frameon=False)
        fig.suptitle(f"Detections before and after INT8 ({record['pipeline']})", fontsize=8)
        fig.tight_layout(rect=(0, 0.08, 1, 1))
        return _svg(fig)


# Picture -> (how it is drawn, the metrics file it is drawn from).
PICTURES = {"docs/img/tradeoff.svg": (tradeoff, "metrics/summary.json"),
            "docs/img/speedup_threads.svg": (speedup_threads, "metrics/summary.json"),
            "docs/img/detection_example.svg": (detection_example, "metrics/detection_example.json")}


def render(root: Path) -> dict[Path, bytes]:
    """Every picture's path under `root` and its bytes, from the metrics file it shows."""
    return {root / rel: draw(json.loads((root / source).read_text()))
            for rel, (draw, source) in PICTURES.items() if (root / source).exists()}
