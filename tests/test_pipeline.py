"""The real `dvc repro` in a temporary git repo with tiny params: what runs, and what re-runs."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from dvc.repo import Repo

from conftest import PROBE, copy_project, dvc, reproduce, set_params
from quantpipe import isa, machine
from quantpipe.runtimes import ort as ort_runtime

# The ONNX files, and the bf16 row (fp32.onnx computed in BF16: measured where the CPU has
# native BF16, skipped with the reason elsewhere; test_runtimes forces both paths).
FILES = ("fp32", "dynamic", "static", "qat")
VARIANTS = (*FILES, "bf16")
NATIVE_BF16 = machine.bf16_missing(machine.probe()) is None
ROWS = VARIANTS if NATIVE_BF16 else FILES
ALL_STAGES = {PROBE, "prepare", "train", "export", "simplify", "quantize_dynamic", "quantize_static",
              "quantize_qat", *(f"{s}@{v}" for s in ("evaluate", "bench") for v in VARIANTS),
              "bench_torch", "report"}
STATIC_BRANCH = {PROBE, "quantize_static", "evaluate@static", "bench@static", "report"}
QAT_BRANCH = {PROBE, "quantize_qat", "evaluate@qat", "bench@qat", "report"}




def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def project(tiny_run, tmp_path_factory) -> tuple[Path, set[str]]:
    """A copy of the session's complete tiny run, and the stages that run made."""
    run, ran = tiny_run
    return copy_project(run, tmp_path_factory.mktemp("pipeline") / "repo"), ran


def test_first_repro_runs_every_stage_and_writes_the_contract(project):
    repo, ran = project
    assert ran == ALL_STAGES
    for name in ("model.pt", "exported.onnx", "fp32.onnx", "dynamic.onnx", "static.onnx", "qat.onnx"):
        assert (repo / "models" / name).stat().st_size > 0
    summary = json.loads((repo / "metrics/summary.json").read_text())
    assert set(summary) == {*ROWS, "torch", "machine", "runtimes", "recommended", "server",
                            *(() if NATIVE_BF16 else ("skipped",))}
    for row in summary["recommended"].values():  # the tail stated, the options written out
        assert row["p99_ms"] >= row["p50_ms"] and row["snippet"].startswith("import ")
    assert summary["server"]["streams"] * summary["server"]["threads"] == summary["machine"]["cores"]
    assert summary["runtimes"] == {"onnxruntime": "ONNX Runtime", "openvino": "OpenVINO"}
    for variant in ("dynamic", "static", "qat"):  # the speedup is the two same-rounds medians
        for bs, x in summary[variant]["speedup"].items():
            fp32, p50 = summary[variant]["baseline_p50_ms"][bs], summary[variant]["latency_p50_ms"][bs]
            assert fp32 / p50 == pytest.approx(x, rel=1e-3), (variant, bs)
    for bs, pick in summary["recommended"].items():  # never a variant slower than FP32
        if pick["variant"] != "fp32":
            entry = summary[pick["variant"]]
            assert all(row["speedup"][bs] >= 1.0 for row in entry["by_threads"].values())
            assert pick["speedup"] == entry["best"]["latency"][bs]["speedup"] >= 1.0
    cores = summary["machine"]["cores"]
    threads = {f"threads{2 ** i}" for i in range(cores.bit_length())} | {f"threads{cores}"}  # [all, powers]
    deploy = {"by_threads", "throughput_ips", "throughput_config", "peak_rss_mb", "load_ms",
              "best", "runtimes", "kernels"}
    tail = {"latency_p90_ms", "latency_p99_ms"}
    assert set(summary["fp32"]) == {"accuracy", "size_bytes", "latency_p50_ms"} | tail | deploy
    versus_bf16 = {"speedup_vs_bf16", "throughput_speedup_vs_bf16"} if NATIVE_BF16 else set()
    for variant in ("dynamic", "static", "qat"):
        assert set(summary[variant]) - {"speedup_range"} == {
            "accuracy", "accuracy_drop_pp", "agreement", "size_bytes", "size_ratio",
            "latency_p50_ms", "speedup", "baseline_p50_ms", "throughput_speedup", "test_flips",
            "mcnemar_p"} | tail | deploy | versus_bf16
        assert set(summary[variant]["speedup"]) == {"bs1", "bs8"}
        assert set(summary[variant]["by_threads"]) == threads
        # The headline is the first entry of bench.threads: all cores.
        assert summary[variant]["speedup"] == summary[variant]["by_threads"][f"threads{cores}"]["speedup"]
    # What the accuracy decision rests on: flips on val, agreement on the pool of train images
    # that did not calibrate (quantpipe.criterion).
    prepared = json.loads((repo / "metrics/prepare.json").read_text())
    q = json.loads((repo / "metrics/quantize_static.json").read_text())
    assert q["val"]["samples"] == prepared["val_samples"]
    assert set(q["val"]) == {"samples", "agreement", "fp32_right_int8_wrong", "int8_right_fp32_wrong",
                             "flips", "accuracy_drop_pp", "mcnemar_p"}
    assert q["val"]["flips"] == q["val"]["fp32_right_int8_wrong"] + q["val"]["int8_right_fp32_wrong"]
    assert q["pool"]["samples"] == min(2000, prepared["train_samples"] - prepared["calib_samples"])
    assert q["real_drop"] is False and q["verdict"].startswith("validation drop")
    assert q["max_drop_pts"] == 0.5  # a classifier's bar (quantize_static.max_drop_pts: null)
    assert all({"val", "pool", "real_drop", "verdict"} <= set(step) for step in q["fallback_steps"])
    static_eval = json.loads((repo / "metrics/eval/static.json").read_text())
    assert {"fp32_right_int8_wrong", "int8_right_fp32_wrong", "mcnemar_p"} <= set(static_eval)
    assert static_eval["pool"]["samples"] == min(2000, prepared["train_samples"])
    for variant in FILES:
        assert summary[variant]["throughput_ips"] > 0 and summary[variant]["load_ms"] > 0
        assert set(summary[variant]["peak_rss_mb"]) == {"bs1", "bs8"}
        config = summary[variant]["throughput_config"]
        assert config["streams"] * config["threads"] == cores
        evaluation = json.loads((repo / f"metrics/eval/{variant}.json").read_text())
        concurrent = evaluation["edge_checks"]["concurrent_requests"]
        assert concurrent["ok"] and concurrent["detail"].startswith(f"{2 * cores} threads")
    # Even one epoch of the tiny CNN learns the digits: far above the 10% of chance.
    assert summary["fp32"]["accuracy"] > 0.8
    assert summary["static"]["size_ratio"] < 0.5
    # QAT: the exported model is the fake-quant model (parity on the test split), INT8-sized.
    qat = json.loads((repo / "metrics/quantize_qat.json").read_text())
    assert qat["parity"]["samples"] == prepared["test_samples"]
    assert qat["parity"]["agreement"] >= 0.99 and qat["parity"]["batch_one_max_abs_diff"] < 1e-3
    assert qat["parity"]["deployed"]["level"] == "ORT_ENABLE_ALL"
    assert qat["steps"] > 0 and qat["ops"]["DequantizeLinear"] > 0
    assert summary["qat"]["size_ratio"] < 0.5 and summary["qat"]["accuracy"] > 0.8
    # OpenVINO runs every variant's file; it agrees with ONNX Runtime (bench.runtimes default).
    for variant in ROWS:
        ov = summary[variant]["runtimes"]["openvino"]
        assert "failed" not in ov, ov
        assert ov["parity"]["agreement"] >= 0.995 and ov["latency_p50_ms"]["bs8"] > 0
        best = summary[variant]["best"]
        assert set(best["latency"]) == {"bs1", "bs8"}
        assert {row["runtime"] for row in best["latency"].values()} <= {"onnxruntime", "openvino"}
        if variant != "fp32":
            assert best["throughput"]["speedup"] > 0 and "baseline" in best["throughput"]
    report_md = (repo / "metrics/report.md").read_text()
    assert "## Runtimes: the same files on each of them" in report_md
    assert "- **static**: at bs1 " in report_md and " at bs8 " in report_md
    latency = json.loads((repo / "metrics/plots/latency.json").read_text())
    assert [row["batch_size"] for row in latency] == [1, 8]
    assert all(row[v] > 0 for row in latency for v in (*ROWS, "torch"))
    # The bf16 row: fp32.onnx computed in BF16 by OpenVINO, no file of its own; or its skip.
    first = report_md.split("\n")[2]
    assert first.startswith("**INT8 against BF16 on this machine** (")
    if NATIVE_BF16:
        bf16 = summary["bf16"]
        assert bf16["runtime"] == "openvino" and bf16["inference_precision"] == "bf16"
        assert bf16["agreement"] >= 0.99 and bf16["size_ratio"] == 1.0
        assert set(bf16["runtimes"]) == {"openvino"} and "peak_rss_mb" not in bf16
        assert {k["precision"] for k in bf16["kernels"]["openvino"].values()} == {"bf16"}
        for variant in ("dynamic", "static", "qat"):
            row = summary[variant]["best"]["latency"]["bs8"]
            assert summary[variant]["speedup_vs_bf16"]["bs8"] == pytest.approx(
                row["bf16"]["p50_ms"] / row["p50_ms"], abs=1e-3)
        assert ("INT8 pays over BF16" in first or "INT8 does not pay over BF16" in first)
        assert "INT8" in report_md.split("**Kernels**: ")[1]
        concurrent = json.loads((repo / "metrics/eval/bf16.json").read_text())["edge_checks"]
        assert all(c["ok"] for c in concurrent.values()), concurrent
    else:
        assert summary["skipped"]["bf16"].startswith("this CPU has no native BF16")
        assert "not measured, this CPU has no native BF16" in first
    for name in ("onnxruntime", "openvino"):  # every engine names what ran the INT8 file
        assert {k["layer"] for k in summary["static"]["kernels"][name].values()}


def test_metrics_show_carries_every_value_of_the_summary(project):
    # DVC's metrics commands drop lists (and whatever is not a number, string or bool): anything
    # the summary keeps in one would never reach `dvc metrics diff` in review.
    repo, _ = project
    shown = json.loads(dvc(repo, "metrics", "show", "--json").stdout)
    summary = json.loads((repo / "metrics/summary.json").read_text())
    assert shown[""]["data"]["metrics/summary.json"]["data"] == summary


def test_second_repro_runs_nothing(project):
    repo, _ = project
    assert reproduce(repo) == {PROBE}


def test_forced_train_reproduces_identical_model(project):
    repo, _ = project
    before = md5(repo / "models/model.pt")
    assert "train" in reproduce(repo, "train", force=True)
    assert md5(repo / "models/model.pt") == before
    # Identical weights -> identical hashes downstream: nothing is out of date.
    assert reproduce(repo) == {PROBE}


def test_calibrate_method_change_reruns_only_the_static_branch(project):
    repo, _ = project
    set_params(repo, {"quantize_static": {"calibrate_method": "Percentile"}})
    assert reproduce(repo) == STATIC_BRANCH


def test_calib_size_change_reruns_prepare_and_both_calibrated_branches_not_train(project):
    repo, _ = project
    set_params(repo, {"prepare": {"calib_size": 32}})
    assert reproduce(repo) == {"prepare"} | STATIC_BRANCH | QAT_BRANCH


def test_qat_params_change_reruns_only_the_qat_branch(project):
    repo, _ = project
    set_params(repo, {"quantize_qat": {"lr": 2e-4, "freeze_bn_after": 10}})
    assert reproduce(repo) == QAT_BRANCH


EVALUATE = {f"evaluate@{v}" for v in VARIANTS}
BENCH = {f"bench@{v}" for v in VARIANTS}
# Each params schema module, and the stages that read its section (and nothing else runs it).
SCHEMA_READERS = {
    "prepare": {"prepare", "quantize_static"},  # quantize_static: val_fraction, in a warning
    # prepare: train.model, a brought model's stated preprocessing
    "train": {"prepare", "train", "export", "quantize_qat", "bench_torch"},
    "export": {"export", "quantize_qat"},
    "simplify": {"simplify"},
    "quantize_dynamic": {"quantize_dynamic"},
    "quantize_static": {"quantize_static"},
    "quantize_qat": {"quantize_qat"},
    "runtime": {"export", "simplify", "quantize_static", "quantize_qat", *EVALUATE, *BENCH,
                "bench_torch"},
    "evaluate": EVALUATE,
    "bench": {*BENCH, "bench_torch", *EVALUATE},  # evaluate: bench.runtimes, bf16's engine
    "gates": {"report"},
    # The memory budget: every stage that sizes batches, sessions or streams to it.
    "resources": {"train", "export", "simplify", "quantize_static", "quantize_qat", *EVALUATE,
                  *BENCH, "bench_torch"},
    "review": set(),  # make gate's tolerances: no stage reads them
    "detect": {"train", "export", "simplify", "quantize_static", "quantize_qat", *EVALUATE,
               *BENCH, "bench_torch"},
}


def out_of_date(repo: Path, edited: Path) -> set[str]:
    """The stages `dvc status` finds out of date with a comment appended to `edited` (the file
    is restored afterwards); the machine probe, always changed, left out."""
    original = edited.read_text()
    try:
        edited.write_text(original + "# a comment\n")
        cwd = os.getcwd()
        os.chdir(repo)
        try:
            with Repo(str(repo)) as project:  # `dvc status`, in this process
                stale = project.status()
        finally:
            os.chdir(cwd)
    finally:
        edited.write_text(original)
    return set(stale) - {PROBE}


def test_a_comment_in_a_schema_module_re_runs_exactly_the_stages_that_read_it(project):
    repo, _ = project
    assert reproduce(repo) == {PROBE}
    schemas = {p.stem for p in (repo / "quantpipe/schemas").glob("*.py")} - {"__init__", "all"}
    assert schemas == set(SCHEMA_READERS)  # a new section gets its row here
    for section, readers in SCHEMA_READERS.items():
        assert out_of_date(repo, repo / f"quantpipe/schemas/{section}.py") == readers, section


def test_a_comment_in_the_benchmark_code_re_runs_no_evaluate(project):
    repo, _ = project
    assert out_of_date(repo, repo / "quantpipe/bench.py") == {*BENCH, "bench_torch"}


def test_plots_show_renders_every_plot(project, tmp_path):
    repo, _ = project
    out = tmp_path / "plots"
    subprocess.run(["dvc", "plots", "show", "-o", str(out)], cwd=repo, check=True,
                   capture_output=True, text=True)
    html = (out / "index.html").read_text()
    for title in ("training curves", "latency vs batch size", "accuracy vs size",
                  "metrics/plots/confusion_fp32.json", "metrics/plots/confusion_dynamic.json",
                  "metrics/plots/confusion_static.json", "metrics/plots/confusion_qat.json",
                  "metrics/plots/sensitivity.json"):
        assert f'"text": "{title}"' in html, title


def test_gates_fail_report_unless_not_enforced(project):
    repo, _ = project
    set_params(repo, {"gates": {"min_static_speedup": 1000.0, "enforce": True}})
    run = subprocess.run(["dvc", "repro"], cwd=repo, capture_output=True, text=True)
    assert run.returncode != 0
    assert "gates.min_static_speedup = 1000.0" in run.stderr + run.stdout
    set_params(repo, {"gates": {"enforce": False}})
    run = subprocess.run(["dvc", "repro"], cwd=repo, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "gate: static speedup" in run.stderr + run.stdout  # still reported, as a warning


def test_a_failed_variant_is_reported_then_fails_the_gates(project):
    """A static model the criterion rejects is written (here the same bytes as before: only
    the verdict changes), measured and shown as failed; report.md is written before the gates
    stop the run."""
    repo, _ = project
    original = (repo / "params.yaml").read_text()
    pool = json.loads((repo / "metrics/quantize_static.json").read_text())["pool"]
    # The images FP32 decides by more than static's typical error (criterion.decided): not all
    # agree on this tiny model, what makes a floor of 100% fire.
    counted = pool.get("decided_agreement", pool["agreement"])
    assert counted < 1.0
    try:
        set_params(repo, {"quantize_static": {"min_pool_agreement": 1.0, "agreement_floor": 1.0,
                                              "max_fallback_steps": 0},
                          "gates": {"enforce": True}})
        (repo / "metrics/report.md").unlink()
        run = subprocess.run(["dvc", "repro"], cwd=repo, capture_output=True, text=True)
        out = run.stdout + run.stderr
        assert run.returncode != 0, out
        q = json.loads((repo / "metrics/quantize_static.json").read_text())
        assert q["rule"] == "agreement_floor" and q["real_drop"] is True
        assert q["failed"].startswith("agreement with FP32 on ")
        assert f"pool images {counted:.2%} < agreement_floor 100.00%" in q["failed"] or \
            f"(all: {pool['agreement']:.2%}) {counted:.2%} < agreement_floor 100.00%" in q["failed"]
        assert "(rule: quantize_static.agreement_floor)" in q["failed"]
        summary = json.loads((repo / "metrics/summary.json").read_text())
        assert summary["static"]["failed"] == q["failed"]
        assert summary["static"]["accuracy"] and summary["static"]["speedup"]  # still measured
        assert all(r["variant"] != "static" for r in summary["recommended"].values())
        text = (repo / "metrics/report.md").read_text()
        assert f"- `static`: {q['failed']}" in text
        assert f"gate: static failed: {q['failed']}" in run.stderr
        assert "ERROR: failed to reproduce 'report'" in run.stderr
    finally:
        (repo / "params.yaml").write_text(original)
    assert "quantize_static" in reproduce(repo)  # back as it was (the run cache restores it)


def test_another_machine_re_measures_what_depends_on_it(project):
    """Metrics committed on another machine: `dvc repro` here re-runs evaluate, bench,
    bench_torch and report (not train or quantize), and then the report names this machine."""
    repo, _ = project
    assert reproduce(repo) == {PROBE}
    here = json.loads((repo / "metrics/machine.json").read_text())
    assert here == machine.probe()
    elsewhere = {**here, "cpu": "Another CPU", "cores": here["cores"] + 2,
                 "cpu_flags": {**here["cpu_flags"], "amx_int8": not here["cpu_flags"]["amx_int8"]}}
    (repo / "metrics/machine.json").write_text(json.dumps(elsewhere))
    # As if that machine had written dvc.lock: every stage records its machine.json.
    subprocess.run(["dvc", "commit", "-f", "-q"], cwd=repo, check=True, capture_output=True)

    # No run cache: a clone on that machine would not have this one's (the run cache would
    # otherwise restore the measurements this repo already made here, which is fine in use).
    ran = reproduce(repo, run_cache=False)
    assert ran == {PROBE, "bench_torch", "report",
                   *(f"{s}@{v}" for s in ("evaluate", "bench") for v in VARIANTS)}
    assert json.loads((repo / "metrics/machine.json").read_text()) == here
    for variant in (*VARIANTS, "torch"):
        bench = json.loads((repo / f"metrics/bench/{variant}.json").read_text())
        if "skipped" in bench:  # bf16 on a CPU without native BF16, with the reason
            assert variant == "bf16" and machine.bf16_missing(here)
            continue
        assert bench["machine"] == here
        assert bench["threads"] == ([here["cores"], 1] if here["cores"] > 1 else [1])
    assert json.loads((repo / "metrics/summary.json").read_text())["machine"] == here
    report_md = (repo / "metrics/report.md").read_text()
    assert f"Measured on {machine.describe(here)}." in report_md and "Another CPU" not in report_md
    assert reproduce(repo) == {PROBE}  # and back to a no-op


def test_a_machine_of_another_int8_kind_re_quantizes(project):
    """reduce_range: auto decides by metrics/int8.json alone: where it changes (8-bit weights
    overflow the INT8 kernels there, or no longer do), the three quantize stages are out of
    date and nothing before them; the test above changed machine.json and not this."""
    repo, _ = project
    path = repo / "metrics/int8.json"
    here = path.read_text()
    assert json.loads(here) == isa.int8_record(machine.probe())
    try:
        path.write_text(json.dumps({"int8_saturates": not json.loads(here)["int8_saturates"]}))
        status = json.loads(dvc(repo, "status", "--json").stdout)
        assert set(status) - {PROBE} == {"quantize_dynamic", "quantize_static", "quantize_qat"}
    finally:
        path.write_text(here)


def test_the_bf16_row_with_and_without_native_bf16(project, tmp_path):
    """Both paths on every machine: evaluate@bf16 and bench@bf16 run on machine records whose
    BF16 flags are forced off, then on (on a CPU without native BF16, OpenVINO then keeps f32
    whatever the hint, and says so), and the report's first line follows."""
    repo, _ = project
    here = json.loads((repo / "metrics/machine.json").read_text())
    metrics = tmp_path / "metrics"
    shutil.copytree(repo / "metrics", metrics)
    for native in (False, True):
        flags = {**here["cpu_flags"], "avx512_bf16": native, "amx_bf16": native}
        (tmp_path / "machine.json").write_text(json.dumps({**here, "cpu_flags": flags}))
        common = ["--fp32", "models/fp32.onnx", "--data", "data/prepared",
                  "--machine", str(tmp_path / "machine.json")]
        for stage, outs in (("evaluate", ["--metrics", metrics / "eval/bf16.json",
                                          "--confusion", tmp_path / "confusion.json",
                                          "--predictions", tmp_path / "predictions.json"]),
                            ("bench", ["--metrics", metrics / "bench/bf16.json"])):
            subprocess.run(["python", "-m", f"stages.{stage}", "bf16", "--model", "models/fp32.onnx",
                            *common, *map(str, outs)], cwd=repo, check=True, capture_output=True)
        evaluation = json.loads((metrics / "eval/bf16.json").read_text())
        timed = json.loads((metrics / "bench/bf16.json").read_text())
        # The report of the same metrics, as if every bench had been measured on that machine.
        for name in ("fp32", "dynamic", "static", "qat"):
            path = metrics / f"bench/{name}.json"
            path.write_text(json.dumps({**json.loads(path.read_text()),
                                        "machine": {**here, "cpu_flags": flags}}))
        run = subprocess.run(["python", "-m", "stages.report", "--metrics", str(metrics)],
                             cwd=repo, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        first = (metrics / "report.md").read_text().split("\n")[2]
        if not native:
            why = machine.bf16_missing({"cpu_flags": flags})
            assert evaluation["skipped"] == timed["skipped"] == why
            assert first.endswith(f"not measured, {why}; INT8 is weighed against FP32 only.")
            continue
        assert evaluation["runtime"] == "openvino" and evaluation["agreement"] >= 0.99
        assert evaluation["inference_precision"] == ("bf16" if NATIVE_BF16 else "f32")
        assert all(c["ok"] for c in evaluation["edge_checks"].values())
        assert timed["runtime"] == "openvino"
        assert timed["unsupported"] == {"onnxruntime": ort_runtime.NO_BF16}
        assert set(timed["latency"]) == {f"threads{here['cores']}", "threads1"}
        assert "memory" not in timed and "kernel_profile" not in timed
        assert "BF16 (the FP32 file on OpenVINO, no calibration) runs x" in first
