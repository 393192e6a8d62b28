"""The report stage's library, one module per concern: `summary` (metrics/summary.json from the
evaluate and bench JSON, its keys in docs/results.md), `recommend` (what to ship, and the
server configuration), `gates`, `notes` (where INT8 does not pay, with evidence) and `markdown`
(report.md). The names stages, scripts and docs use are here."""

from quantpipe.report.gates import check_gates, gate_failures
from quantpipe.report.markdown import (describe_config, describe_setting, markdown_table,
                                       recommended_lines, render_markdown)
from quantpipe.report.notes import slowdown_notes, thread_scaling_notes, tolerance_notes
from quantpipe.report.recommend import SAME_SPEED, recommend, serve
from quantpipe.report.summary import (CANDIDATES, CURVE_COLUMNS, QUANTIZED, RECORDS, build_summary,
                                      candidates_of, quantized_of, score_keys, threads_curve,
                                      variants_of)

__all__ = ["CANDIDATES", "CURVE_COLUMNS", "QUANTIZED", "RECORDS", "SAME_SPEED", "build_summary",
           "candidates_of", "check_gates", "describe_config", "describe_setting", "gate_failures",
           "markdown_table", "quantized_of",
           "recommend", "recommended_lines", "render_markdown", "score_keys", "serve",
           "slowdown_notes", "thread_scaling_notes", "threads_curve", "tolerance_notes",
           "variants_of"]
