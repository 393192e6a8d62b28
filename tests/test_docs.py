"""The documents: measured tables are the committed metrics, rendered (quantpipe.docs, `make docs`);
every params key has its row; links between pages resolve; the README stays short."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
import shutil

import pytest

from conftest import ROOT
from quantpipe import docs
from quantpipe.schemas.all import Params

METRICS = ("metrics/summary.json", "metrics/bench/static.json", "metrics/families.json",
           "metrics/engines.json", "metrics/qat_hard.json", "metrics/detection.json",
           "metrics/segmentation.json",
           "metrics/ort_amx.json", "metrics/scale.json",
           "metrics/spread.json", "metrics/yolo_peer.json", "metrics/ort_threads.json",
           "metrics/detection_example.json",
           # Other machines' sections, and the model files their note compares with.
           "metrics/machines", "dvc.lock")


def test_every_generated_table_is_the_committed_metrics():
    found = set()
    for path in docs.documents(ROOT):
        text = path.read_text()
        found |= {m.group(2) for m in docs.BLOCK.finditer(text)}
        assert docs.regenerate(text, ROOT) == text, f"run `make docs` and commit {path.name}"
    assert {"headline", "default", "runtimes", "families", "engines", "qat_hard", "detection",
            "precision", "precision_one_thread", "ort_amx", "scale", "spread",
            "yolo_peer", "ort_threads", "machines"} <= found, found


def test_the_committed_pipeline_metrics_are_one_machines():
    """The pipeline's committed metrics are one run's: machine.json, the int8.json the machine
    stage derives from it, and the machine each bench and the summary name agree. A run on
    another machine restored only in part would mix them (int8.json once said this project's
    INT8 saturates beside an AMX Xeon's machine.json)."""
    from quantpipe import isa

    machine = json.loads((ROOT / "metrics/machine.json").read_text())
    assert json.loads((ROOT / "metrics/int8.json").read_text()) == isa.int8_record(machine)
    named = {p.relative_to(ROOT).as_posix(): json.loads(p.read_text()).get("machine")
             for p in [ROOT / "metrics/summary.json", *(ROOT / "metrics/bench").glob("*.json")]}
    assert {p: m for p, m in named.items() if m != machine} == {}


def test_every_picture_is_the_committed_metrics_and_is_shown():
    """docs/img/*.svg are drawn from the committed metrics (quantpipe.pictures), byte for byte,
    and every one is referenced from README.md or docs/."""
    from quantpipe import pictures
    drawn = pictures.render(ROOT)
    assert drawn and all(path.read_bytes() == data for path, data in drawn.items()), \
        "run `make docs` and commit docs/img/"
    assert drawn == pictures.render(ROOT)  # the same bytes every time
    text = "".join(p.read_text() for p in docs.documents(ROOT))
    for path in drawn:
        rel = path.relative_to(ROOT)
        assert f"]({rel})" in text or f"]({rel.relative_to('docs')})" in text, f"{rel} is shown nowhere"


def test_a_changed_metric_redraws_the_pictures(copy):
    from quantpipe import pictures
    path = copy / "metrics/summary.json"
    summary = json.loads(path.read_text())
    summary["static"]["speedup"]["bs64"] = 9.87  # the all-cores point of the trade-off
    path.write_text(json.dumps(summary))
    redrawn = {p.relative_to(copy): data for p, data in pictures.render(copy).items()}
    assert redrawn[Path("docs/img/tradeoff.svg")] != (ROOT / "docs/img/tradeoff.svg").read_bytes()
    assert redrawn[Path("docs/img/speedup_threads.svg")] == (ROOT / "docs/img/speedup_threads.svg").read_bytes()


@pytest.fixture
def copy(tmp_path):
    """The documents and the metrics they are rendered from, in a scratch project."""
    for rel in ("README.md", "docs", *METRICS):
        src, dest = ROOT / rel, tmp_path / rel
        if rel == "metrics/machines" and not src.exists():  # none collected yet
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dest)
    return tmp_path


def test_a_number_changed_by_hand_in_a_table_fails_the_check(copy, monkeypatch, capsys):
    page = copy / "docs/results.md"
    text = page.read_text()
    edited = re.sub(r"\| x(\d)\.(\d\d) \|", lambda m: f"| x{m.group(1)}.{(int(m.group(2)) + 1) % 100:02d} |",
                    text, count=1)
    assert edited != text
    page.write_text(edited)
    monkeypatch.setattr("sys.argv", ["docs", "--check", "--root", str(copy)])
    assert docs.main() == 1
    assert "docs/results.md: its tables differ from metrics/" in capsys.readouterr().err
    monkeypatch.setattr("sys.argv", ["docs", "--root", str(copy)])  # `make docs` puts it back
    assert docs.main() == 0 and page.read_text() == text


def test_a_changed_metric_shows_in_the_tables(copy):
    summary = (copy / "metrics/summary.json").read_text()
    edited = re.sub(r'("speedup": \{\s*"bs1": )[0-9.]+', r"\g<1>9.87", summary, count=1)
    assert edited != summary
    (copy / "metrics/summary.json").write_text(edited)
    text = (copy / "docs/results.md").read_text()
    assert "x9.87" in docs.regenerate(text, copy) and "x9.87" not in text


def test_every_speedup_column_shows_the_fp32_time_it_divides():
    """speedup = FP32's p50 from the same rounds / the variant's p50, both in the table."""
    table = docs.headline_table(__import__("json").loads((ROOT / "metrics/summary.json").read_text()))
    head, _, *rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ")]
    for row in rows[1:]:  # the quantized variants
        for i, name in enumerate(head):
            if name.startswith("speedup"):
                p50, fp32, x = (float(re.sub(r"[^\d.]", "", c)) for c in row[i - 2:i + 1])
                assert fp32 / p50 == pytest.approx(x, rel=0.02), (name, row)


def test_the_headline_shows_each_speedups_range_over_runs_on_its_machine():
    """Noise next to each headline figure: lowest-highest over scripts/spread.py's runs, only
    when they were measured on the machine that measured summary.json."""
    from quantpipe.machine import describe

    summary = json.loads((ROOT / "metrics/summary.json").read_text())
    bs = sorted(summary["fp32"]["latency_p50_ms"], key=lambda k: int(k[2:]))[-1]
    spread = {"machine": describe(summary["machine"]), "bench_runs": 3,
              "speedup": {"values": {f"static.speedup.{bs}": [1.5, 1.25, 2.5],
                                     f"static.by_threads.threads1.speedup.{bs}": [2.0, 2.25, 2.125]}},
              "accuracy": {"seeds": [0, 1, 2], "seed_range_pp": {"static.accuracy": 0.75}}}
    table = docs.headline_table(summary, spread)
    static = next(line for line in table.splitlines() if line.startswith("| static |"))
    assert f"x{summary['static']['speedup'][bs]:.2f} (1.25–2.50)" in static
    assert "(2.00–2.25)" in static
    assert "over 3 runs of the same models" in table and "up to 0.8 points" in table
    elsewhere = docs.headline_table(summary, {**spread, "machine": "another CPU, 64 cores"})
    assert "–" not in elsewhere.split("| static |")[1].splitlines()[0]
    assert "No spread over repeated runs was measured on this machine" in elsewhere


def _example(static_box: list[float]) -> dict:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(__import__("numpy").zeros((16, 16), "uint8")).save(buffer, format="PNG")
    image = {"index": 3, "png": base64.b64encode(buffer.getvalue()).decode(),
             "truth": [[2.0, 2.0, 9.0, 9.0, 1]], "fp32": [[2.0, 2.5, 9.0, 9.0, 1, 0.9]],
             "static": [static_box]}
    return {"class_names": ["digit0", "digit1"], "pipeline": "test", "images": [image, image]}


def test_the_detection_example_draws_both_models_boxes_and_follows_the_metrics():
    from quantpipe import pictures

    svg = pictures.detection_example(_example([2.0, 2.5, 9.5, 9.0, 1, 0.8])).decode()
    assert "digit1 0.90" in svg and "digit1 0.80" in svg and "test #3: truth 1, fp32 1, static 1" in svg
    assert svg == pictures.detection_example(_example([2.0, 2.5, 9.5, 9.0, 1, 0.8])).decode()
    assert svg != pictures.detection_example(_example([4.0, 2.5, 9.5, 9.0, 0, 0.8])).decode()


def test_the_one_thread_precision_table_reads_every_engine_at_one_thread():
    summary = __import__("json").loads((ROOT / "metrics/summary.json").read_text())
    table = docs.precision_table(summary, threads=1)
    rows = {tuple(r[:2]): r for r in (line.strip("| ").split(" | ") for line in table.splitlines()
                                      if line.startswith("| INT8 static"))}
    sizes = list(summary["static"]["latency_p50_ms"])
    for name, title in summary["runtimes"].items():
        engine = summary["static"] if name == "onnxruntime" else summary["static"]["runtimes"][name]
        one = engine["by_threads"]["threads1"]
        row = rows[("INT8 static", title)]
        assert row[-len(sizes):] == [f"x{one['speedup'][k]:.2f}" for k in sizes]
        assert "INT8 best vs BF16 best" not in table  # a best spans thread counts


def _keys(cls, prefix=""):
    for f in dataclasses.fields(cls):
        value = getattr(cls(), f.name) if dataclasses.is_dataclass(cls) else None
        if dataclasses.is_dataclass(value) and f.name != "batch_consistency_atol":
            yield from _keys(type(value), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_every_params_key_has_a_row_in_the_reference():
    text = (ROOT / "docs/params.md").read_text()
    cells = " ".join(re.findall(r"^\| (`[^|]*) \|", text, re.M))
    named = set(re.findall(r"`([\w.]+)`", cells))
    # `a.b`, `.c` on one row: .c continues a's section.
    for row in re.findall(r"^\| (`[^|]*) \|", text, re.M):
        names = re.findall(r"`([\w.]+)`", row)
        section = names[0].rsplit(".", 1)[0] if "." in names[0] else ""
        named |= {section + n for n in names if n.startswith(".")}
    missing = [k for k in _keys(Params) if k not in named]
    assert not missing, f"docs/params.md has no row for {missing}"
    unknown = [k for k in named if "." in k and k.split(".")[0] in Params.__dataclass_fields__
               and k not in set(_keys(Params))]
    assert not unknown, f"docs/params.md names keys params.yaml does not have: {unknown}"


def test_links_between_pages_resolve():
    pages = {p.name: p.read_text() for p in (ROOT / "docs").glob("*.md")}
    pages_and_readme = {**{f"docs/{k}": v for k, v in pages.items()}, "README.md": (ROOT / "README.md").read_text()}
    for name, text in pages_and_readme.items():
        base = (ROOT / name).parent
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[\w-]+)?\)", text):
            assert (base / target).is_file(), f"{name} links to {target}, which does not exist"


def test_readme_is_short_and_the_docs_carry_the_design():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert (ROOT / "docs/design.md").is_file()
    outside = "DESIGN" + ".md"  # the team's guide, which lives outside the repository
    for path in [ROOT / "README.md", ROOT / "dvc.yaml", ROOT / "requirements.txt",
                 *(ROOT / "docs").glob("*.md"), *ROOT.glob("quantpipe/**/*.py"),
                 *ROOT.glob("stages/*.py"), *ROOT.glob("scripts/*.*"), *ROOT.glob("tests/*.py")]:
        assert outside not in path.read_text(), f"{path} cites a document outside the repository"


def test_the_package_is_installed_and_nothing_edits_sys_path():
    """`make env` installs quantpipe (editable); stages and scripts import it, never patch the path."""
    from importlib.metadata import distribution

    assert distribution("quantpipe").metadata["Name"] == "quantpipe"
    needle = "sys" + ".path"
    hits = [str(p.relative_to(ROOT)) for folder in ("stages", "scripts", "quantpipe")
            for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in (".py", ".sh", "")
            and needle in p.read_text(errors="replace")]
    assert not hits, hits


def test_the_peer_table_names_nncf_rows_and_where_the_int8_time_goes():
    row = lambda variant, runtime: {"variant": variant, "runtime": runtime, "map_50_95": 0.9,  # noqa: E731
                                    "map_drop_pts": 0.1, "p50_ms_1thread_bs1": 2.0,
                                    "speedup_1thread_bs1": 1.2, "p50_ms_all_bs16": 20.0,
                                    "speedup_all_bs16": 1.1}
    profile = lambda ops: {"kernel_ms": 2.0, "by_op_ms": ops}  # noqa: E731
    model = {"params": 1000, "epochs": 3, "green_report": True, "mac_share_int8": 0.99,
             "ultralytics_validator": {"onnx": {}}, "cpu": "CPU X", "cores": 2,
             "rows": [row("fp32", "onnxruntime"), row("nncf_mixed", "openvino")]}
    text = docs.yolo_peer_table({"imgsz": 128, "models": {"yolo11n": model}})
    assert "`nncf` engine (preset mixed), OpenVINO" in text
    assert "kernel time" not in text  # a record from before the profiles: no line
    model["ort_kernels_1thread_bs1"] = {"fp32": profile({"Conv": 1.5, "QuickGelu": 0.5}),
                                        "static": profile({"QLinearConv": 1.0, "QLinearMul": 0.6,
                                                           "QLinearSigmoid": 0.4})}
    text = docs.yolo_peer_table({"imgsz": 128, "models": {"yolo11n": model}})
    assert "FP32 2.00 ms (Conv 75%, QuickGelu 25%); static 2.00 ms (QLinearConv 50%, " \
           "QLinearMul 30%, QLinearSigmoid 20%)" in text
    assert "90% (points)" not in text  # a record from before the bootstrap: no column
    model["rows"].append(row("ultralytics_openvino_int8", "openvino"))
    for r, interval in zip(model["rows"], ([-0.58, 0.25], [-0.79, 0.08], [0.0, 0.0])):
        r["vs_ultralytics_int8_pts_90"] = interval
    text = docs.yolo_peer_table({"imgsz": 128, "models": {"yolo11n": model}})
    assert "| vs Ultralytics INT8, 90% (points) |" in text
    assert "| 0.10 | -0.79 to +0.08 | 2.00 ms |" in text
    assert "| 0.10 | reference | 2.00 ms |" in text
