"""The gates: which figures fail `report` (gates.*)."""

from __future__ import annotations

from quantpipe import tasks
from quantpipe.report.summary import quantized_of, variants_of
from quantpipe.schemas.gates import GatesParams


def check_gates(summary: dict, gates: GatesParams) -> list[str]:
    """Human-readable gate failures; empty when all gates hold."""
    return list(gate_failures(summary, gates).values())


def gate_failures(summary: dict, gates: GatesParams) -> dict[str, str]:
    """The failed gates, '<variant> <gates key>' -> what failed: the key says which gate failed
    for which variant whatever the figures (`make gate` compares two revisions' keys)."""
    failures = {f"{variant} failed": f"{variant} failed: {summary[variant]['failed']}"
                for variant in quantized_of(summary) if "failed" in summary[variant]}
    task = tasks.for_summary(summary)
    score = task.score
    for variant in quantized_of(summary):
        drop = summary[variant][score.drop_key]
        if drop > getattr(gates, score.gate) and not task.drop_noise(summary[variant], gates):
            failures[f"{variant} gates.{score.gate}"] = (
                f"{variant} {score.label} drop {drop:.2f} {score.unit} > gates.{score.gate} = "
                f"{getattr(gates, score.gate)}" + (f"; {score.advice}" if score.advice else ""))
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
