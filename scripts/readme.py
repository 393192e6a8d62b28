#!/usr/bin/env python3
"""README.md's measured tables, written from the committed metrics (never typed).

Each table stands between two marker lines, `<!-- generated: NAME -->` and
`<!-- end: NAME -->`, and is rendered from:

- `default`: metrics/summary.json, metrics/bench/static.json and metrics/machine.json (the
  default pipeline: all cores, one thread, throughput and memory, ONNX Runtime vs OpenVINO);
- `families`: metrics/families.json (scripts/families.py).

    python scripts/readme.py            # rewrite README.md's tables from metrics/
    python scripts/readme.py --check    # exit 1 if any table differs (tests/test_docs.py)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import families  # noqa: E402
from quantpipe.machine import describe  # noqa: E402
from quantpipe.report import _table  # noqa: E402  (report.md's table layout)

BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end: \2 -->)", re.S)


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g} ms"


def _x(value: float | None) -> str:
    return "—" if value is None else f"x{value:.2f}"


def _sizes(summary: dict) -> list[str]:
    return sorted(summary["fp32"]["latency_p50_ms"], key=lambda k: int(k[2:]))


def default_tables(summary: dict, static_bench: dict) -> str:
    """The default pipeline's tables, as the README shows them."""
    machine = summary["machine"]
    sizes = _sizes(summary)
    names = [v for v in ("fp32", "dynamic", "static", "qat", "torch") if v in summary]
    label = {"torch": "torch (eager)"}
    cores = machine["cores"]
    out = [f"Measured on {describe(machine)}.", "",
           f"**All cores** ({cores} intra-op threads: ORT's default and what you deploy with; "
           "the headline of `metrics/summary.json`):", ""]
    rows = []
    for v in names:
        s = summary[v]
        rows.append([label.get(v, v) + (" (failed)" if "failed" in s else ""), f"{s['accuracy']:.3f}",
                     "—" if "accuracy_drop_pp" not in s else f"{s['accuracy_drop_pp']:.1f}",
                     "—" if "agreement" not in s else f"{s['agreement']:.3f}",
                     f"{s['size_bytes'] / 1e6:.2f} MB",
                     *[_ms(s["latency_p50_ms"][k]) for k in sizes],
                     *[_x(s.get("speedup", {}).get(k)) for k in sizes]])
    out += _table(["variant", "accuracy", "drop (pp)", "agreement", "size",
                   *[f"p50 {k}" for k in sizes], *[f"speedup {k}" for k in sizes]], rows)
    out += ["", "**One thread** (`by_threads.threads1`): the gain per core.", ""]
    rows = []
    for v in names:
        one = summary[v]["by_threads"]["threads1"]
        rows.append([label.get(v, v), *[_ms(one["latency_p50_ms"][k]) for k in sizes],
                     *[_x(one.get("speedup", {}).get(k)) for k in sizes]])
    out += _table(["variant", *[f"p50 {k}" for k in sizes], *[f"speedup {k}" for k in sizes]], rows)
    largest = sizes[-1]
    out += ["", f"**Every core busy, and memory** (batch {largest[2:]}; a fresh process per batch "
            "size for memory):", ""]
    rows = []
    for v in names:
        s = summary[v]
        if "throughput_ips" not in s:
            continue
        config = s["throughput_config"]
        rows.append([v, f"{config['streams']} stream{'s' * (config['streams'] != 1)} x "
                        f"{config['threads']} thread{'s' * (config['threads'] != 1)}",
                     f"{round(s['throughput_ips'], -2):,.0f}", _x(s.get("throughput_speedup")),
                     *[f"{s['peak_rss_mb'][k]:.0f} MB" for k in sizes], f"{s['load_ms']:.0f} ms"])
    out += _table(["variant", "best configuration", "images/s", "vs FP32's best",
                   *[f"peak RSS {k}" for k in sizes], "session load"], rows)
    out += ["", *engines_table(static_bench, sizes, cores, machine.get("openvino", ""))]
    return "\n".join(out)


def engines_table(bench: dict, sizes: list[str], cores: int, version: str) -> list[str]:
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
    return ["**Which engine** (`bench.runtimes`: the same `.onnx` files on ONNX Runtime and "
            f"OpenVINO {version}, timed in the same rounds; speedups against FP32 on ONNX "
            "Runtime from those rounds):", "",
            *_table(["batch, threads", "FP32, ONNX Runtime", "static, ONNX Runtime",
                     "static, OpenVINO", "FP32, OpenVINO"], rows)]


def render(name: str, root: Path = ROOT) -> str:
    read = lambda rel: json.loads((root / rel).read_text())  # noqa: E731
    if name == "default":
        return default_tables(read("metrics/summary.json"), read("metrics/bench/static.json"))
    if name == "families":
        return families.markdown(read("metrics/families.json")["rows"])
    raise SystemExit(f"README.md: unknown generated block {name!r}")


def regenerate(text: str, root: Path = ROOT) -> str:
    """README text with every generated block rendered anew from root's metrics."""
    return BLOCK.sub(lambda m: f"{m.group(1)}{render(m.group(2), root)}\n{m.group(4)}", text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when README.md differs")
    args = parser.parse_args()
    path = ROOT / "README.md"
    text = path.read_text()
    new = regenerate(text)
    if args.check:
        if new != text:
            print("README.md: its tables differ from metrics/; run `python scripts/readme.py`",
                  file=sys.stderr)
            return 1
        return 0
    path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
