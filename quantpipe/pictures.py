"""The pictures of README.md and docs/, drawn from the committed metrics/summary.json by `make
docs` (quantpipe.docs) and checked like its tables: the same metrics give the same bytes
(matplotlib's SVG with text kept as text, a fixed hash salt and no date).

- docs/img/tradeoff.svg: what each INT8/BF16 variant buys (speedup over FP32 on ONNX Runtime,
  same rounds) against what it costs (the drop in the task's score), per runtime, at the largest
  batch and all cores, and at 1 thread;
- docs/img/speedup_threads.svg: speedup over FP32 against threads, per variant and runtime, at
  the smallest and the largest batch.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

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


PICTURES = {"docs/img/tradeoff.svg": tradeoff, "docs/img/speedup_threads.svg": speedup_threads}


def render(root: Path) -> dict[Path, bytes]:
    """Every picture's path under `root` and its bytes, from root/metrics/summary.json."""
    summary = json.loads((root / "metrics/summary.json").read_text())
    return {root / rel: draw(summary) for rel, draw in PICTURES.items()}
