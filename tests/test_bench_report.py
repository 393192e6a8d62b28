"""quantpipe.bench (timing statistics, interleaved measurement) and quantpipe.report (summary.json
contract, gates, slowdown notes, markdown)."""

from __future__ import annotations

import json
import time

import numpy as np
import onnxruntime as ort
import pytest
import torch
from helpers import TwoConvNet, export_to, info_for, structured_images

from quantpipe import bench, concurrency, data, machine, onnxutil, profiling, report, serving, tails
from quantpipe.errors import UserError
from quantpipe.bench import StreamConfig
from quantpipe.runtimes.base import kernel_table
from quantpipe.schemas.bench import BenchParams
from quantpipe.schemas.gates import GatesParams

VNNI_MACHINE = {"cpu": "Test CPU", "cpu_flags": {f: f in ("avx2", "avx512f", "avx512_vnni")
                                                for f in machine.CPU_FLAGS},
                "cores": 2, "logical_cpus": 2, "onnxruntime": "1.32.0", "python": "3.11"}
NO_VNNI_MACHINE = {**VNNI_MACHINE, "cpu_flags": {f: f == "avx2" for f in machine.CPU_FLAGS}}

# --- summarize --------------------------------------------------------------------------------


def test_summarize_known_timings():
    seconds = [i / 1000 for i in range(10, 0, -1)]  # 10 ms .. 1 ms, unsorted on purpose
    lat = bench.summarize(seconds, batch_size=4)
    # Linear interpolation between order statistics (numpy's default percentile).
    assert lat.p50_ms == pytest.approx(5.5)          # (5 + 6) / 2
    assert lat.p90_ms == pytest.approx(9.1)          # 9 + 0.1 * (10 - 9)
    assert lat.p99_ms == pytest.approx(9.91)
    assert lat.mean_ms == pytest.approx(5.5)
    assert lat.std_ms == pytest.approx(np.sqrt(8.25), abs=1e-5)  # population std of 1..10
    assert lat.throughput == pytest.approx(4 / 0.0055, abs=0.1)  # samples/s at the median
    assert lat.runs == 10


def test_summarize_single_value_and_dict():
    lat = bench.summarize([0.002], batch_size=64)
    assert lat.p50_ms == lat.p90_ms == lat.p99_ms == lat.mean_ms == pytest.approx(2.0)
    assert lat.std_ms == 0 and lat.throughput == pytest.approx(32000.0)
    d = bench.as_dict(lat)
    assert set(d) == {"p50_ms", "p90_ms", "p99_ms", "mean_ms", "std_ms", "throughput", "runs",
                      "round_p50_ms"}
    assert d["round_p50_ms"] == []  # one list of timings: no rounds to tell apart
    json.dumps(d)  # plain JSON types
    by_round = bench.summarize([[0.001, 0.003], [0.002, 0.002, 0.004]], batch_size=1)
    assert by_round.runs == 5 and by_round.p50_ms == pytest.approx(2.0)
    assert by_round.round_p50_ms == (2.0, 2.0)


def test_runs_and_rounds_follow_the_first_runs_cost():
    # Fits: exactly bench.runs in bench.rounds.
    assert bench.plan_runs(300, 6, 0.001, budget=5.0) == (300, 6)
    assert bench.plan_runs(300, 6, 10.0, budget=None) == (300, 6)  # no budget
    # A 0.1 s batch in a 3 s share: 30 runs, still 6 rounds.
    assert bench.plan_runs(300, 6, 0.1, budget=3.0) == (30, 6)
    # A 3 s batch with no time left: the fewest rounds of one run, not bench.runs.
    assert bench.plan_runs(300, 6, 3.0, budget=0.0) == (bench.MIN_ROUNDS, bench.MIN_ROUNDS)
    # A 10 ms batch with no time left still gets MIN_SECONDS of runs (a p99 of some meaning).
    assert bench.plan_runs(300, 6, 0.01, budget=0.0) == (int(bench.MIN_SECONDS / 0.01), 6)


def test_the_time_budget_hands_each_measurement_a_share_of_what_is_left():
    clock = bench.TimeBudget(10.0, 4)
    assert clock.share() == pytest.approx(2.5, abs=0.05)
    time.sleep(0.2)  # the first measurement used less than its share: the others get it
    assert clock.share() == pytest.approx((10.0 - 0.2) / 3, abs=0.05)
    assert clock.over() == 0.0
    assert bench.TimeBudget(None, 3).share() is None


def test_a_slow_model_is_timed_within_its_budget_with_a_speedup_range_over_rounds():
    """Runs of 50 and 150 ms in a 0.3 s budget: MIN_SECONDS of runs, not 300, and each round's
    median beside the overall one; the rows carry the speedup's lowest and highest round."""
    calls = []

    def slow(seconds):
        def run(batch):
            calls.append(seconds)
            time.sleep(seconds)
        return run

    start = time.perf_counter()
    lat = bench.measure({"int8": slow(0.05), "fp32": slow(0.15)}, np.zeros(1), warmup=10,
                        runs=300, rounds=6, budget=0.3)
    assert time.perf_counter() - start < 6.0  # a second of warm-up each, then 2 s of runs
    least = int(bench.MIN_SECONDS / 0.2)  # one run of each takes 0.2 s, and a little more
    assert lat["int8"].runs == lat["fp32"].runs and least - 1 <= lat["int8"].runs <= least
    assert len(lat["int8"].round_p50_ms) == 6
    rows = bench.rows_against({"threads1": {"bs1": lat}}, "int8", "fp32")
    low, high = rows["threads1"]["bs1"]["speedup_range"].values()
    assert low <= rows["threads1"]["bs1"]["speedup"] <= high and 2.0 < low and high < 4.0


def test_one_stream_of_every_core_comes_from_the_latency_grid():
    lat = bench.summarize([0.5], batch_size=64)
    grid = {"threads2": {"bs1": {"m": lat}, "bs64": {"m": lat}}}
    assert bench.from_latency(grid, cores=2, batch_size=64) == {
        "m": {bench.StreamConfig(1, 2): pytest.approx(128.0)}}
    assert bench.from_latency(grid, cores=4, batch_size=64) == {}  # 4 threads were not timed


# --- measure ----------------------------------------------------------------------------------

def _recorders(names, calls):
    return {name: (lambda x, name=name: calls.append(name)) for name in names}


def test_measure_times_each_runner_the_requested_runs_interleaved():
    calls, ticks = [], []
    result = bench.measure(_recorders("ab", calls), np.zeros((2, 1)), warmup=2, runs=6, rounds=3,
                           tick=lambda: ticks.append(len(calls)))
    # Warm-up: each runner its `warmup` calls, before any timed call.
    assert calls[:4] == ["a", "a", "b", "b"]
    timed = calls[4:]
    # 3 rounds of 2 timed runs each, each turn after min(ROUND_WARMUP, warmup) = 2 untimed
    # ones (the first runs after another model's turn); the order alternates between rounds.
    assert bench.ROUND_WARMUP >= 2
    assert timed == ["a"] * 4 + ["b"] * 8 + ["a"] * 8 + ["b"] * 4
    assert ticks == [12, 20, 28]  # one tick after each round
    assert set(result) == {"a", "b"}
    assert result["a"].runs == result["b"].runs == 6
    # Without warm-up (warmup 0) no untimed run at all.
    calls.clear()
    bench.measure(_recorders("ab", calls), np.zeros((2, 1)), warmup=0, runs=6, rounds=3)
    assert calls == ["a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"]


def test_measure_passes_the_batch_and_reports_its_size():
    seen = []
    x = np.zeros((5, 1, 2, 2), np.float32)

    def run(batch):
        seen.append(batch)
        time.sleep(0.001)  # long enough that p50_ms's 5-decimal rounding is negligible

    result = bench.measure({"m": run}, x, warmup=1, runs=4, rounds=2)
    # 1 warm-up, 4 timed, 1 untimed at the start of each of the 2 rounds
    assert all(b is x for b in seen) and len(seen) == 1 + 4 + 2
    lat = result["m"]
    assert lat.throughput == pytest.approx(5 / (lat.p50_ms / 1e3), rel=1e-3)


def test_measure_measures_the_call_time():
    result = bench.measure({"slow": lambda x: time.sleep(0.003), "fast": lambda x: None},
                           np.zeros(1), warmup=0, runs=4, rounds=2)
    assert result["slow"].p50_ms >= 3.0
    assert result["fast"].p50_ms < 1.0


def test_measure_runs_exactly_runs_when_not_divisible_by_rounds():
    calls = []
    result = bench.measure(_recorders("ab", calls), np.zeros(1), warmup=0, runs=10, rounds=3)
    assert calls.count("a") == calls.count("b") == 10
    assert result["a"].runs == 10


# --- batch_of ---------------------------------------------------------------------------------

def test_batch_of_repeats_when_short():
    x = np.arange(3).reshape(3, 1, 1, 1).astype(np.float32)
    out = bench.batch_of(x, 7)
    assert out.shape == (7, 1, 1, 1)
    assert out.ravel().tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert out.flags["C_CONTIGUOUS"]


def test_batch_of_takes_the_first_samples():
    x = np.arange(10).reshape(10, 1).astype(np.float32)
    assert bench.batch_of(x, 4).ravel().tolist() == [0, 1, 2, 3]
    assert bench.batch_of(x, 10).ravel().tolist() == list(range(10))


# --- threads, throughput, memory --------------------------------------------------------------

def test_resolve_threads_turns_all_into_the_cores_and_drops_repeats():
    assert bench.resolve_threads(("all", 1), cores=8) == (8, 1)
    assert bench.resolve_threads(("all", 1), cores=1) == (1,)  # one core: one thread count
    # The threads curve: powers of two below the cores, after the headline.
    assert bench.resolve_threads(("all", "powers"), cores=16) == (16, 1, 2, 4, 8)
    assert bench.resolve_threads(("all", "powers"), cores=12) == (12, 1, 2, 4, 8)
    assert bench.resolve_threads(("all", "powers"), cores=2) == (2, 1)
    assert bench.resolve_threads(("powers", "all"), cores=1) == (1,)
    assert bench.resolve_threads((4, "all", 2, 4), cores=2) == (4, 2)


@pytest.mark.parametrize("cores, expected", [
    (1, [(1, 1)]),
    (2, [(1, 2), (2, 1)]),
    (6, [(1, 6), (2, 3), (6, 1)]),
    (64, [(1, 64), (2, 32), (4, 16), (8, 8), (16, 4), (32, 2), (64, 1)]),
])
def test_stream_configs_fill_every_core(cores, expected):
    configs = bench.stream_configs(cores)
    assert [(c.streams, c.threads) for c in configs] == expected
    assert all(c.streams * c.threads == cores for c in configs)
    assert configs[0].key == f"streams1_threads{cores}"


def test_run_concurrently_overlaps_jobs_and_keeps_their_order():
    results, seconds = concurrency.run_concurrently([lambda i=i: (time.sleep(0.05), i)[1] for i in range(4)])
    assert results == [0, 1, 2, 3]
    assert 0.05 <= seconds < 0.15  # four 50 ms sleeps at once, not one after another


def test_run_concurrently_reraises_a_jobs_exception():
    def boom():
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        concurrency.run_concurrently([lambda: None, boom])


def test_measure_throughput_counts_images_per_second_of_concurrent_streams():
    x = np.zeros((8, 1))  # a batch of 8 images
    calls = []

    def sleeper(name):
        def run(batch):
            calls.append(name)
            time.sleep(0.01)  # releases the GIL, as session.run does
        return run

    # One stream vs two: two streams do twice the batches in the same wall time.
    rates = bench.measure_throughput({"one": [sleeper("one")], "two": [sleeper("a"), sleeper("b")]},
                                     x, batches=4, warmup=1, rounds=2)
    assert rates["one"] == pytest.approx(8 / 0.01, rel=0.3)  # 800 images/s
    assert rates["two"] == pytest.approx(2 * rates["one"], rel=0.3)
    # Warm-up once per runner (a pool's streams side by side), then 2 rounds of 4 batches per
    # pool, split across its streams.
    assert calls.count("one") == 1 + 2 * 4
    assert calls.count("a") == calls.count("b") == 1 + 2 * 2


def test_throughput_compares_each_side_at_its_own_best_configuration():
    # fp32 is fastest as one session with both threads (its streams contend: 5 ms a batch);
    # "int8" takes 2 ms a batch however it runs, so two streams double its throughput.
    def pools_for(config):
        def run_for(model):
            per_batch = (0.002 if config.streams == 1 else 0.005) if model == "fp32" else 0.002
            return lambda batch: time.sleep(per_batch)
        return {m: [run_for(m) for _ in range(config.streams)] for m in ("int8", "fp32")}

    p = BenchParams(batch_sizes=(1, 16), warmup=0, runs=8, rounds=2)
    x = np.zeros((4, 1, 2, 2), np.float32)
    ips = bench.throughput_grid(pools_for, x, cores=2, p=p, desc="test")
    result = bench.throughput_against(ips, "int8", "fp32", batch_size=16, cores=2)
    assert result["batch_size"] == 16 and result["cores"] == 2
    assert set(result["ips"]) == set(result["baseline_ips"]) == {"streams1_threads2",
                                                                 "streams2_threads1"}
    assert (result["best"]["streams"], result["best"]["threads"]) == (2, 1)
    assert (result["baseline_best"]["streams"], result["baseline_best"]["threads"]) == (1, 2)
    assert result["baseline_best"]["ips"] == max(result["baseline_ips"].values())
    # int8 at 2 streams: 2 x 16 images / 2 ms; fp32 at its best, 16 images / 2 ms: about x2.
    assert result["speedup"] == pytest.approx(2.0, rel=0.35)
    assert result["speedup"] == pytest.approx(result["best"]["ips"] / result["baseline_best"]["ips"],
                                              abs=1e-3)
    fp32_only = bench.throughput_against(ips, "fp32", "fp32", batch_size=16, cores=2)
    assert set(fp32_only) == {"batch_size", "cores", "ips", "best"}
    assert fp32_only["best"]["streams"] == 1  # fp32 here scales with threads in one session


def test_memory_profile_of_a_fresh_process(tmp_path):
    torch.manual_seed(0)
    path = export_to(TwoConvNet().eval(), (1, 12, 12), tmp_path / "m.onnx")
    mem = bench.memory_profile(path, (1, 12, 12), (1, 256), threads=1,
                               level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL, repeats=2)
    assert mem["threads"] == 1 and mem["repeats"] == 2
    assert set(mem["peak_rss_mb"]) == set(mem["first_run_ms"]) == {"bs1", "bs256"}
    # Python + numpy + onnxruntime: tens of MB, and a model run only adds to it.
    assert 10 < mem["runtime_rss_mb"] < mem["peak_rss_mb"]["bs1"] <= mem["peak_rss_mb"]["bs256"]
    assert mem["load_ms"] > 0 and all(ms > 0 for ms in mem["first_run_ms"].values())


def test_memory_profile_keeps_one_process_per_batch_size_when_out_of_time(tmp_path):
    torch.manual_seed(0)
    path = export_to(TwoConvNet().eval(), (1, 12, 12), tmp_path / "m.onnx")
    mem = bench.memory_profile(path, (1, 12, 12), (1, 8), threads=1, runs=1,
                               level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL, budget=0.0)
    assert mem["repeats"] == 1 and set(mem["peak_rss_mb"]) == {"bs1", "bs8"}


def test_bench_sessions_that_do_not_fit_stop_in_one_line_and_streams_shrink_to_fit(tmp_path):
    from quantpipe import budget

    torch.manual_seed(0)
    path = export_to(TwoConvNet().eval(), (1, 12, 12), tmp_path / "m.onnx")
    models = {"static": path, "fp32": path}
    runtimes = {"static": {"onnxruntime": None, "openvino": None}, "fp32": {"onnxruntime": None}}
    p = BenchParams(batch_sizes=(1, 4096))
    held = budget.rss_bytes() / budget.MB
    # Plenty: every stream of a 16-core machine.
    assert bench.check_memory(budget.Budget(held + 4096, "t"), models, runtimes, (1, 12, 12), p,
                              16) == 16
    # Three sessions at batch 4,096 (~55 MiB in all) fit in 100 MiB, two streams of them not.
    assert bench.check_memory(budget.Budget(held + 100, "t"), models, runtimes, (1, 12, 12),
                              p, 16) == 1
    with pytest.raises(UserError, match=r"bench: 3 sessions at batch 4096 need about .* lower "
                                        r"bench.batch_sizes, drop a runtime of bench.runtimes "
                                        r"or raise resources.memory_mb"):
        bench.check_memory(budget.Budget(held + 1, "t"), models, runtimes, (1, 12, 12), p, 16)


def test_parity_counts_the_samples_the_reference_decides():
    """INT8 logits of two runtimes a rounding apart (~1): the reference's near-ties flip with it,
    which says nothing of the kernels; a flip of a sample the reference decides still counts."""
    from quantpipe.runtimes import base

    rng = np.random.default_rng(0)
    ref = rng.uniform(-300, 300, (100, 6)).astype(np.float32)
    ref[:2, 0], ref[:2, 1] = 300.2, 300.0  # two near-ties
    out = ref + 1.0
    out[:2, 0] -= 3  # flipped, by a rounding
    fine = base.parity(lambda b: ref[b[:, 0].astype(int)], lambda b: out[b[:, 0].astype(int)],
                       np.arange(100).reshape(-1, 1), None, batch_size=50, min_agreement=0.995)
    assert fine.agreement == 0.98 and fine.decided_agreement == 1.0 and fine.passed
    assert fine.as_dict()["decided_samples"] == 98
    wrong = out.copy()
    wrong[50] = ref[50][::-1]  # a decided sample's answer changed: a wrong kernel
    failed = base.parity(lambda b: ref[b[:, 0].astype(int)], lambda b: wrong[b[:, 0].astype(int)],
                         np.arange(100).reshape(-1, 1), None, batch_size=50, min_agreement=0.995)
    assert not failed.passed and "of the 98 it decides" in failed.failure("ORT")


def test_a_runtime_as_faithful_to_fp32_as_the_reference_is_trusted():
    """Two INT8 executions that disagree with each other on 1 sample in 5 (classes a rounding
    apart), each agreeing with FP32 as well as the other: the candidate is trusted; one that
    agrees with FP32 less is not."""
    from quantpipe.runtimes import base

    fp32 = np.eye(5, dtype=np.float32)[[0, 1, 2, 3, 4] * 4] * 10  # 20 samples, classes 0..4
    ref, out = fp32.copy(), fp32.copy()
    ref[[0, 5], 1] = 10.5   # the reference runtime flips two samples of class 0 to 1 ...
    out[[2, 7], 3] = 10.5   # ... the candidate two of class 2: as faithful, 80% with each other
    x = np.arange(20).reshape(-1, 1)
    run = lambda logits: (lambda b: logits[b[:, 0]])  # noqa: E731
    ok = base.parity(run(ref), run(out), x, None, batch_size=20, min_agreement=0.995, fp32=fp32)
    assert ok.agreement == 0.8 and ok.fp32_agreement == ok.reference_fp32_agreement == 0.9
    assert ok.as_faithful and ok.passed
    worse = out.copy()
    worse[[12, 17], 4] = 10.5
    bad = base.parity(run(ref), run(worse), x, None, batch_size=20, min_agreement=0.995, fp32=fp32)
    assert not bad.passed and "with FP32 80.00% against ORT's 90.00%" in bad.failure("ORT")


def test_memory_profile_names_the_model_that_fails(tmp_path):
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(UserError, match=r"broken\.onnx: the memory probe failed at batch 1"):
        bench.memory_profile(bad, (1, 12, 12), (1,), threads=1, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                             config={}, repeats=1)


def test_memory_profile_sessions_take_the_deployed_config(tmp_path):
    # The probe's session gets the entries the bench's sessions have (ORT rejects this value).
    torch.manual_seed(0)
    path = export_to(TwoConvNet().eval(), (1, 12, 12), tmp_path / "m.onnx")
    with pytest.raises(UserError, match="stoi"):
        bench.memory_profile(path, (1, 12, 12), (1,), threads=1, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                             config={"session.dynamic_block_base": "abc"}, repeats=1)


# --- kernel profile ---------------------------------------------------------------------------

def test_kernel_profile_accounts_for_every_kernel_of_the_model(tmp_path):
    torch.manual_seed(0)
    path = export_to(TwoConvNet().eval(), (1, 12, 12), tmp_path / "m.onnx")
    level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # no fusion: one kernel per ONNX node
    session = onnxutil.make_session(path, level=level, threads=1,
                                    profile_prefix=str(tmp_path / "ort"))
    x = np.random.default_rng(0).standard_normal((8, 1, 12, 12)).astype(np.float32)
    profile = profiling.kernel_profile(session, x, runs=5, top=2)

    assert profile["batch_size"] == 8 and profile["runs"] == 5
    assert profile["by_op_ms"].keys() == {"Conv", "Relu", "Reshape", "Gemm"}
    assert sum(profile["by_op_ms"].values()) == pytest.approx(profile["kernel_ms"], abs=1e-3)
    assert list(profile["by_op_ms"].values()) == sorted(profile["by_op_ms"].values(), reverse=True)
    top = profile["top_nodes"]
    assert len(top) == 2 and top[0]["ms"] >= top[1]["ms"] > 0
    assert top[0]["share"] == pytest.approx(top[0]["ms"] / profile["kernel_ms"], abs=1e-3)
    assert top[0]["op"] in profile["by_op_ms"]
    line = profiling.describe_profile(profile, ops=2)
    assert line.startswith(f"{profile['kernel_ms']:.2f} ms (") and line.count("%") == 2
    # The largest op type first whatever the key order (write_json sorts keys); under 1% left out.
    assert profiling.describe_profile({"kernel_ms": 10.0, "by_op_ms": {"Add": 0.04, "Conv": 0.96,
                                                                   "Gemm": 9.0}}) == \
        "10.00 ms (Gemm 90%, Conv 10%)"


def test_kernel_profile_of_a_qdq_model_names_the_fused_int8_kernels(tmp_path):
    from onnxruntime.quantization import QuantFormat, quantize_static

    from quantpipe.engines.ort_static import CalibrationReader

    torch.manual_seed(0)
    fp32 = export_to(TwoConvNet().eval(), (1, 12, 12), tmp_path / "fp32.onnx")
    images = structured_images(16)
    info = info_for(images)
    int8 = tmp_path / "int8.onnx"
    quantize_static(str(fp32), str(int8),
                    CalibrationReader(images.x, info, onnxutil.INPUT_NAME, batch_size=8),
                    quant_format=QuantFormat.QDQ, per_channel=True)
    x = data.normalize(images.x, info)
    session = onnxutil.make_session(int8, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                                    threads=1, profile_prefix=str(tmp_path / "ort"))
    profile = profiling.kernel_profile(session, x, runs=3)
    assert "QLinearConv" in profile["by_op_ms"]  # what the QDQ pairs became at ENABLE_ALL
    assert "Conv" not in profile["by_op_ms"]


# --- report: inputs shaped like stages/evaluate.py and stages/bench.py write them -------------

def _eval(variant, accuracy, agreement, size_bytes, ops=None):
    return {"variant": variant, "accuracy": accuracy, "agreement": agreement,
            "max_abs_logit_error": 0.1, "mean_abs_logit_error": 0.01,
            "per_class_accuracy": {"0": accuracy}, "samples": 1000, "size_bytes": size_bytes,
            "ops": ops or {"Conv": 2, "Gemm": 2}, "graph_optimization_level": "ORT_ENABLE_ALL",
            "edge_checks": {"batch_1": {"ok": True, "detail": "..."}}}


def _row(p50, fp32_p50=None):
    row = {"p50_ms": p50, "p90_ms": p50 * 1.1, "p99_ms": p50 * 1.2, "mean_ms": p50,
           "std_ms": 0.01, "throughput": 1000 / p50, "runs": 200}
    if fp32_p50 is not None:  # what stages/bench.py adds for a quantized variant
        row["baseline_p50_ms"] = fp32_p50
        row["speedup"] = round(fp32_p50 / p50, 4)
    return row


FP32_P50 = {"bs1": 0.2, "bs64": 8.0}


FP32_IPS = 20000.0


def _bench(variant, p50s, threads=(1, 2), fp32_p50=FP32_P50, ips=None, peak=None,
           openvino=0.8, openvino_agreement=1.0):
    """A bench JSON as stages/bench.py writes it; OpenVINO takes `openvino` times ONNX Runtime's
    latency and agrees with it on `openvino_agreement` of the test samples."""
    latency = {}
    for t in threads:
        scale = 1 / t  # more threads, faster: a different, recognisable number per thread count
        latency[f"threads{t}"] = {
            bs: _row(p50 * scale, None if variant == "fp32" else fp32_p50[bs] * scale)
            for bs, p50 in p50s.items()}
    ips = ips or (FP32_IPS if variant == "fp32" else 2.5 * FP32_IPS)
    throughput = {"batch_size": 64, "cores": 2,
                  "ips": {"streams1_threads2": ips * 0.8, "streams2_threads1": ips},
                  "best": {"streams": 2, "threads": 1, "ips": ips}}
    if variant != "fp32":
        throughput.update({"baseline_ips": {"streams1_threads2": FP32_IPS * 0.8,
                                            "streams2_threads1": FP32_IPS},
                           "baseline_best": {"streams": 2, "threads": 1, "ips": FP32_IPS},
                           "speedup": round(ips / FP32_IPS, 4)})
    peak = peak or {"bs1": 60.0, "bs64": 80.0}
    memory = {"threads": threads[0], "repeats": 3, "runtime_rss_mb": 45.0, "load_ms": 6.5,
              "peak_rss_mb": peak, "first_run_ms": {bs: 1.0 for bs in peak}}
    return {"variant": variant, "graph_optimization_level": "ORT_ENABLE_ALL",
            "machine": VNNI_MACHINE, "threads": list(threads), "latency": latency,
            "throughput": throughput,
            **_runtimes(variant, latency, throughput, openvino, openvino_agreement),
            "memory": memory}


def _runtimes(variant, latency, throughput, factor, agreement):
    """"runtimes" and "best" beside ONNX Runtime's rows, as quantpipe.runtimes.timing makes
    them: OpenVINO at `factor` times ONNX Runtime's latency (FP32 only on ONNX Runtime)."""
    ort, ov, fp32 = (variant, "onnxruntime"), (variant, "openvino"), ("fp32", "onnxruntime")
    grid = {count: {bs: {ort: _lat(r["p50_ms"]), ov: _lat(r["p50_ms"] * factor),
                         fp32: _lat(r.get("baseline_p50_ms", r["p50_ms"]))}
                    for bs, r in rows.items()} for count, rows in latency.items()}
    configs = {StreamConfig(1, 2): "streams1_threads2", StreamConfig(2, 1): "streams2_threads1"}
    ips = {ort: {c: throughput["ips"][k] for c, k in configs.items()},
           ov: {c: throughput["ips"][k] / factor for c, k in configs.items()},
           fp32: {c: throughput.get("baseline_ips", throughput["ips"])[k] for c, k in configs.items()}}
    passed = agreement >= 0.995
    openvino = {"title": "OpenVINO", "version": "2026.4.1",
                "parity": {"samples": 1000, "agreement": agreement, "max_abs_diff": 0.01,
                           "mean_abs_diff": 0.001, "min_agreement": 0.995, "passed": passed},
                "latency": bench.rows_against(grid, ov, fp32),
                "throughput": bench.throughput_against(ips, ov, fp32, 64, 2)}
    if not passed:
        openvino["failed"] = (f"models/{variant}.onnx on OpenVINO: its predictions agree with ONNX "
                              f"Runtime's on {agreement:.2%} of 1000 test samples")
    trusted = ["onnxruntime"] + ["openvino"] * passed
    return {"runtimes": {"onnxruntime": {"title": "ONNX Runtime", "version": "1.32.0", "reference": True},
                         "openvino": openvino},
            "best": bench.best_configuration(grid, ips, variant, trusted, "fp32", ["onnxruntime"])}


def _lat(p50):
    return bench.Latency(p50_ms=round(p50, 5), p90_ms=p50, p99_ms=p50, mean_ms=p50, std_ms=0.0,
                         throughput=1.0, runs=1)


@pytest.fixture
def evals():
    return {"fp32": _eval("fp32", 0.98, 1.0, 4_000_000),
            "dynamic": _eval("dynamic", 0.975, 0.99, 1_040_000),
            "static": _eval("static", 0.97, 0.985, 1_000_000),
            "qat": _eval("qat", 0.975, 0.99, 1_000_000)}


@pytest.fixture
def benches():
    return {"fp32": _bench("fp32", FP32_P50, threads=(1, 2)),
            "dynamic": _bench("dynamic", {"bs1": 0.16, "bs64": 7.5}, threads=(1, 2)),
            "static": _bench("static", {"bs1": 0.1, "bs64": 3.2}, threads=(1, 2)),
            "qat": _bench("qat", {"bs1": 0.1, "bs64": 3.3}, threads=(1, 2))}


FP32_KEYS = {"accuracy", "size_bytes", "latency_p50_ms", "latency_p90_ms", "latency_p99_ms", "by_threads", "throughput_ips",
             "throughput_config", "peak_rss_mb", "load_ms", "best", "runtimes", "kernels"}
QUANTIZED_KEYS = FP32_KEYS | {"accuracy_drop_pp", "agreement", "size_ratio", "speedup", "baseline_p50_ms",
                              "throughput_speedup"}


def test_summary_has_exactly_the_contract_keys(evals, benches):
    summary = report.build_summary(evals, benches)
    assert set(summary) == {"fp32", "dynamic", "static", "qat", "machine", "runtimes"}
    assert summary["machine"] == VNNI_MACHINE
    assert set(summary["fp32"]) == FP32_KEYS
    assert set(summary["dynamic"]) == set(summary["static"]) == set(summary["qat"]) == QUANTIZED_KEYS
    for variant in ("fp32", "dynamic", "static", "qat"):
        entry = summary[variant]
        assert set(entry["latency_p50_ms"]) == set(entry["peak_rss_mb"]) == {"bs1", "bs64"}
        assert set(entry["by_threads"]) == {"threads1", "threads2"}
        for row in entry["by_threads"].values():
            tail = {"latency_p50_ms", "latency_p90_ms", "latency_p99_ms"}
            assert set(row) == (tail if variant == "fp32" else tail | {"speedup", "baseline_p50_ms"})
    assert set(summary["static"]["speedup"]) == {"bs1", "bs64"}
    json.dumps(summary)


def test_summary_arithmetic(evals, benches):
    s = report.build_summary(evals, benches)
    assert {k: s["fp32"][k] for k in ("accuracy", "size_bytes", "latency_p50_ms")} == {
        "accuracy": 0.98, "size_bytes": 4_000_000, "latency_p50_ms": {"bs1": 0.2, "bs64": 8.0}}
    assert s["dynamic"]["accuracy_drop_pp"] == pytest.approx(0.5)   # (0.98 - 0.975) * 100
    assert s["static"]["accuracy_drop_pp"] == pytest.approx(1.0)
    assert s["dynamic"]["agreement"] == 0.99 and s["static"]["agreement"] == 0.985
    assert s["dynamic"]["size_ratio"] == pytest.approx(0.26)
    assert s["static"]["size_ratio"] == pytest.approx(0.25)
    assert s["static"]["latency_p50_ms"] == {"bs1": 0.1, "bs64": 3.2}
    assert s["static"]["speedup"] == {"bs1": pytest.approx(2.0), "bs64": pytest.approx(2.5)}
    assert s["dynamic"]["speedup"]["bs1"] == pytest.approx(1.25)


def test_summary_headline_is_the_first_thread_count_benched(evals, benches):
    s = report.build_summary(evals, benches)  # benched at threads (1, 2): 1 first
    assert s["static"]["latency_p50_ms"] == s["static"]["by_threads"]["threads1"]["latency_p50_ms"]
    for b in benches.values():
        b["threads"] = [2, 1]  # bench.threads: [all, 1] on 2 cores
    s = report.build_summary(evals, benches)
    assert s["fp32"]["latency_p50_ms"] == {"bs1": pytest.approx(0.1), "bs64": pytest.approx(4.0)}
    assert s["static"]["latency_p50_ms"]["bs64"] == pytest.approx(1.6)
    assert s["static"]["speedup"] == s["static"]["by_threads"]["threads2"]["speedup"]
    assert s["static"]["by_threads"]["threads1"]["latency_p50_ms"]["bs64"] == pytest.approx(3.2)
    assert list(s["static"]["by_threads"]) == ["threads2", "threads1"]


def test_summary_throughput_and_memory(evals, benches):
    benches["static"] = _bench("static", {"bs1": 0.1, "bs64": 3.2}, threads=(1, 2),
                               ips=2.2 * FP32_IPS, peak={"bs1": 61.5, "bs64": 70.25})
    s = report.build_summary(evals, benches)
    assert s["static"]["throughput_ips"] == pytest.approx(44000.0)
    assert s["static"]["throughput_speedup"] == pytest.approx(2.2)
    assert s["static"]["throughput_config"] == {"streams": 2, "threads": 1}
    assert s["fp32"]["throughput_ips"] == FP32_IPS and "throughput_speedup" not in s["fp32"]
    assert s["static"]["peak_rss_mb"] == {"bs1": 61.5, "bs64": 70.25}
    assert s["static"]["load_ms"] == 6.5


def test_summary_has_the_best_engine_and_the_other_runtimes(evals, benches):
    for b in benches.values():
        b["threads"] = [2, 1]
    benches["static"] = _bench("static", {"bs1": 0.1, "bs64": 3.2}, threads=(2, 1), openvino=0.5)
    s = report.build_summary(evals, benches)
    best = s["static"]["best"]
    # OpenVINO at half ONNX Runtime's latency, 2 threads; FP32's best is ONNX Runtime's, 2 threads.
    assert best["latency"]["bs64"] == {"runtime": "openvino", "threads": 2, "p50_ms": 0.8,
                                       "p90_ms": 0.8, "p99_ms": 0.8, "speedup": 5.0,
                                       "baseline": {"runtime": "onnxruntime", "threads": 2,
                                                    "p50_ms": 4.0, "p90_ms": 4.0, "p99_ms": 4.0}}
    assert best["throughput"]["runtime"] == "openvino" and best["throughput"]["speedup"] == 5.0
    assert set(s["static"]["runtimes"]) == {"openvino"}  # ONNX Runtime's are the variant's own keys
    ov = s["static"]["runtimes"]["openvino"]
    assert set(ov) == {"latency_p50_ms", "latency_p90_ms", "latency_p99_ms", "speedup", "baseline_p50_ms", "by_threads",
                       "throughput_ips", "throughput_config", "throughput_speedup", "parity"}
    assert set(ov["by_threads"]) == {f"threads{t}" for t in benches["static"]["threads"]}
    assert ov["latency_p50_ms"] == {"bs1": 0.025, "bs64": 0.8}  # the headline thread count (2)
    assert ov["speedup"] == {"bs1": 4.0, "bs64": 5.0}
    assert ov["parity"] == {"agreement": 1.0, "max_abs_diff": 0.01, "mean_abs_diff": 0.001}
    # The existing keys keep meaning ONNX Runtime.
    assert s["static"]["latency_p50_ms"] == {"bs1": 0.05, "bs64": 1.6}
    assert s["fp32"]["best"]["latency"]["bs1"]["runtime"] == "openvino"
    assert "speedup" not in s["fp32"]["best"]["latency"]["bs1"]


def test_an_untrusted_engine_is_in_the_summary_and_out_of_best(evals, benches):
    benches["static"] = _bench("static", {"bs1": 0.1, "bs64": 3.2}, openvino=0.5,
                               openvino_agreement=0.9)
    s = report.build_summary(evals, benches)
    ov = s["static"]["runtimes"]["openvino"]
    assert ov["failed"].startswith("models/static.onnx on OpenVINO: its predictions agree")
    assert ov["parity"]["agreement"] == 0.9 and ov["latency_p50_ms"]["bs64"] == pytest.approx(1.6)
    best = s["static"]["best"]
    assert {row["runtime"] for row in best["latency"].values()} == {"onnxruntime"}
    assert best["throughput"]["runtime"] == "onnxruntime"


def test_summary_refuses_benches_from_different_machines(evals, benches):
    benches["static"]["machine"] = {**VNNI_MACHINE, "cpu": "Other CPU"}
    with pytest.raises(UserError, match=r"metrics/bench/static\.json and metrics/bench/fp32\.json"):
        report.build_summary(evals, benches)


def test_summary_of_an_improving_variant_has_a_negative_drop(evals, benches):
    evals["static"]["accuracy"] = 0.985
    assert report.build_summary(evals, benches)["static"]["accuracy_drop_pp"] == pytest.approx(-0.5)


# --- recommended --------------------------------------------------------------------------------

def test_recommended_is_the_fastest_within_the_gate_and_the_more_accurate_of_equals(evals, benches):
    summary = report.build_summary(evals, benches)
    rec = report.recommend(summary, GatesParams())
    assert set(rec) == {"bs1", "bs64"}
    # static and qat are equally fast (within 10%) on OpenVINO at 2 threads; qat is more accurate.
    assert rec["bs64"]["variant"] == "qat" and rec["bs64"]["runtime"] == "openvino"
    assert rec["bs64"]["threads"] == 2 and rec["bs64"]["p50_ms"] == summary["qat"]["best"]["latency"]["bs64"]["p50_ms"]
    assert rec["bs64"]["speedup"] == summary["qat"]["best"]["latency"]["bs64"]["speedup"]
    assert rec["bs64"]["why"].startswith("as fast as static (within 10%) and more accurate (0.9750 vs 0.9700)")
    evals["qat"]["accuracy"] = 0.96  # now over the 1.0 pp gate
    rec = report.recommend(report.build_summary(evals, benches), GatesParams())
    assert rec["bs64"]["variant"] == "static"
    assert rec["bs64"]["why"] == ("the fastest of the variants within the accuracy gate and faster "
                                  "than FP32 everywhere (dynamic, static)")


def test_recommended_never_names_a_variant_slower_than_fp32_anywhere(evals, benches):
    # static: fast on one thread and at its best, but x0.8 on 2 threads at bs1.
    benches["static"]["latency"]["threads2"]["bs1"] = _row(0.125, 0.1)
    for v in ("dynamic", "qat"):
        evals[v]["accuracy"] = 0.9  # out of the gate
    summary = report.build_summary(evals, benches)
    rec = report.recommend(summary, GatesParams())
    assert rec["bs1"]["variant"] == "fp32" and "speedup" not in rec["bs1"]
    assert rec["bs1"]["runtime"] == summary["fp32"]["best"]["latency"]["bs1"]["runtime"]
    assert rec["bs1"]["why"] == ("dynamic loses 8.00 pp > gates.max_accuracy_drop_pp; static is "
                                 "slower than FP32 (x0.80 at 2 thread(s)); qat loses 8.00 pp > "
                                 "gates.max_accuracy_drop_pp")
    assert rec["bs64"]["variant"] == "static"
    summary["recommended"] = rec
    text = report.render_markdown(summary, ["static is slower than FP32 at bs1: why."])
    head = text.split("## ")[0]  # before the first table
    assert "- **bs1: ship `fp32`** (" in head and "static is slower than FP32 (x0.80 at 2 thread(s))" in head
    assert "- **bs64: ship `static`** (OpenVINO, 2 threads" in head
    assert "**Where INT8 does not pay (or pays less)**:\n\n- static is slower than FP32 at bs1: why." in head


def test_best_never_picks_a_loose_tail_when_a_configuration_as_fast_has_a_tight_one():
    """The 16-core case: ONNX Runtime static at every thread, bs1, p50 0.131 ms, p99 30x it;
    fewer threads 5% slower with a tight tail. A tight one 22% slower displaces it too (its
    median is under a third of that p99); one slower than a third of the p99 does not."""
    def lat(p50, p99):
        return bench.Latency(p50_ms=p50, p90_ms=p50, p99_ms=p99, mean_ms=p50, std_ms=0.0,
                             throughput=1.0, runs=300)
    int8, fp32 = ("int8", "ort"), ("fp32", "ort")
    grid = {"threads16": {"bs1": {int8: lat(0.131, 3.9), fp32: lat(0.14, 0.2)}},
            "threads8": {"bs1": {int8: lat(0.137, 0.2), fp32: lat(0.15, 0.2)}},
            "threads1": {"bs1": {int8: lat(0.30, 0.4), fp32: lat(0.6, 0.8)}}}
    best = bench.best_configuration(grid, {}, "int8", ["ort"], "fp32", ["ort"])["latency"]["bs1"]
    assert (best["threads"], best["p50_ms"], best["p99_ms"]) == (8, 0.137, 0.2)
    grid["threads8"]["bs1"][int8] = lat(0.16, 0.2)  # 22% slower, p99 20x shorter: steadier
    best = bench.best_configuration(grid, {}, "int8", ["ort"], "fp32", ["ort"])["latency"]["bs1"]
    assert (best["threads"], best["p50_ms"], best["p99_ms"]) == (8, 0.16, 0.2)
    grid["threads8"]["bs1"][int8] = lat(1.31, 1.5)  # over 3.9 / 3: the fast median stays
    grid["threads1"]["bs1"][int8] = lat(1.4, 1.6)
    best = bench.best_configuration(grid, {}, "int8", ["ort"], "fp32", ["ort"])["latency"]["bs1"]
    assert (best["threads"], best["p99_ms"]) == (16, 3.9)
    grid["threads8"]["bs1"][int8] = lat(0.144, 0.2)  # 10% slower, tight: as fast
    best = bench.best_configuration(grid, {}, "int8", ["ort"], "fp32", ["ort"])["latency"]["bs1"]
    assert best["threads"] == 8
    grid["threads8"]["bs1"][int8] = lat(0.137, 0.5)  # loose too, but ranked 0.5 / 3
    grid["threads1"]["bs1"][int8] = lat(1.2, 1.3)    # tight, under 3.9 / 3
    best = bench.best_configuration(grid, {}, "int8", ["ort"], "fp32", ["ort"])["latency"]["bs1"]
    assert best["threads"] == 8  # the shorter tail of the two loose ones, far faster than 1 thread
    assert tails.pace(0.137, 0.5) == pytest.approx(0.5 / 3) and tails.pace(1.2, 1.3) == 1.2
    assert tails.pace(0.131, 0.2) == 0.131 and tails.pace(1.0, 3.05) == pytest.approx(1.1)
    assert tails.describe(0.131, 3.9) == "p99 3.900 ms (x29.8 p50, loose)"
    assert tails.describe(0.137, 0.2) == "p99 0.200 ms (x1.5 p50)"


def test_recommended_prefers_a_tight_tail_among_equals_and_states_it(evals, benches):
    summary = report.build_summary(evals, benches)
    # qat (the more accurate of the two equals at bs64) with a loose tail: static has a tight one.
    summary["qat"]["best"]["latency"]["bs64"]["p99_ms"] = 10 * summary["qat"]["best"]["latency"]["bs64"]["p50_ms"]
    rec = report.recommend(summary, GatesParams())
    assert rec["bs64"]["variant"] == "static"
    assert rec["bs64"]["why"].startswith("as fast as qat (within 10%) with a tight tail (qat's p99 ")
    assert rec["bs64"]["p99_ms"] == summary["static"]["best"]["latency"]["bs64"]["p99_ms"]
    summary["recommended"] = rec
    head = report.render_markdown(summary, []).split("## ")[0]
    p50, p99 = rec["bs64"]["p50_ms"], rec["bs64"]["p99_ms"]
    assert f"p50 {p50:.3f} ms, p99 {p99:.3f} ms (x{p99 / p50:.1f} p50)" in head


def test_recommended_takes_a_slower_median_for_a_much_shorter_tail(evals, benches):
    """The AVX2 EPYC's batch 1: static faster at the median with p99 6.6x it; another variant
    44% slower at the median with a tight tail under a third of that p99 is recommended, and
    why says so. Slower than a third of the p99, it is not."""
    summary = report.build_summary(evals, benches)
    rows = {v: summary[v]["best"]["latency"]["bs64"] for v in ("static", "qat")}
    fast = rows["static"]["p50_ms"]
    rows["static"].update(p99_ms=6.6 * fast)
    rows["qat"].update(p50_ms=1.44 * fast, p99_ms=1.9 * fast)
    rec = report.recommend(summary, GatesParams())
    assert rec["bs64"]["variant"] == "qat"
    assert rec["bs64"]["why"].startswith("static is faster at the median but its tail is loose (p99 ")
    assert "x6.6 p50, loose" in rec["bs64"]["why"]
    # qat (the more accurate of two equals) with p99 6.6x, static's tail loose but shorter:
    # static, "shorter", not "tight".
    rows["qat"].update(p50_ms=1.02 * fast, p99_ms=6.6 * fast)
    rows["static"].update(p99_ms=3.3 * fast)
    rec = report.recommend(summary, GatesParams())
    assert rec["bs64"]["variant"] == "static"
    assert rec["bs64"]["why"].startswith("as fast as qat (within 10%) with a shorter tail (qat's p99 ")
    rows["static"].update(p99_ms=6.6 * fast)
    rows["qat"].update(p50_ms=2.3 * fast, p99_ms=2.5 * fast)  # over 6.6 / 3 = 2.2
    rec = report.recommend(summary, GatesParams())
    assert rec["bs64"]["variant"] == "static"
    assert rec["bs64"]["p99_ms"] == pytest.approx(6.6 * fast)


def test_the_server_snippet_runs_and_builds_what_the_bench_timed(evals, benches, tmp_path):
    """summary.json's `server` and each recommended row carry the exact options; the ONNX
    Runtime snippet, executed, builds `streams` sessions of `threads` threads that run."""
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2))
    path = tmp_path / "models/static.onnx"
    path.parent.mkdir()
    torch.onnx.export(model, torch.zeros(1, 1, 2, 2), str(path), dynamo=False,
                      input_names=["x"], dynamic_axes={"x": {0: "batch"}})
    settings = {"graph_optimization_level": "ORT_ENABLE_ALL", "inter_op_num_threads": 1,
                "session.force_spinning_stop": 1}
    for b in benches.values():
        b["runtimes"]["onnxruntime"]["settings"] = settings
        b["runtimes"]["openvino"]["settings"] = {
            "device": "CPU", "latency": {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": "<threads>"},
            "throughput": {"PERFORMANCE_HINT": "THROUGHPUT", "NUM_STREAMS": "<streams>",
                           "INFERENCE_NUM_THREADS": "<streams x threads>"}}
    evals["qat"]["accuracy"] = 0.9  # out of the gate: static is recommended
    summary = report.build_summary(evals, benches)
    summary["recommended"] = report.recommend(summary, GatesParams())
    server = report.serve(summary, benches)
    top = summary["static"]["best"]["throughput"]
    assert (server["variant"], server["runtime"], server["streams"], server["threads"]) == (
        "static", top["runtime"], top["streams"], top["threads"])
    assert server["options"]["config"] == {"PERFORMANCE_HINT": "THROUGHPUT", "NUM_STREAMS": 2,
                                           "INFERENCE_NUM_THREADS": 2}
    ort_code = serving.snippet("onnxruntime", settings, str(path), 2, 1)
    scope: dict = {}
    exec(ort_code, scope)
    sessions = scope["sessions"]
    assert len(sessions) == 2
    assert sessions[0].get_session_options().intra_op_num_threads == 1
    assert sessions[1].run(None, {"x": np.ones((3, 1, 2, 2), np.float32)})[0].shape == (3, 2)
    for rec in summary["recommended"].values():  # one session (stream) of the row's threads
        options = rec["options"]
        assert (options["intra_op_num_threads"] if rec["runtime"] == "onnxruntime" else
                options["config"]["INFERENCE_NUM_THREADS"]) == rec["threads"]
        assert f'"models/{rec["variant"]}.onnx"' in rec["snippet"]
    summary["server"] = server
    assert "**Serve it** (`static` at bs64" in report.render_markdown(summary, [])


def test_threads_curve_has_a_column_per_variant_and_engine(evals, benches):
    summary = report.build_summary(evals, benches)
    curve = report.threads_curve(summary, "bs64")
    assert [r["threads"] for r in curve] == [1, 2]
    assert set(curve[0]) == {"threads", "dynamic_onnxruntime", "dynamic_openvino", "static_onnxruntime",
                             "static_openvino", "qat_onnxruntime", "qat_openvino"}
    assert set(curve[0]) - {"threads"} <= set(report.CURVE_COLUMNS)
    assert curve[1]["static_onnxruntime"] == summary["static"]["by_threads"]["threads2"]["speedup"]["bs64"]
    assert curve[0]["static_openvino"] == \
        summary["static"]["runtimes"]["openvino"]["by_threads"]["threads1"]["speedup"]["bs64"]


# --- gates ------------------------------------------------------------------------------------

def _summary(static_drop=0.2, dynamic_drop=0.1, static_speedup=None):
    speedup = static_speedup or {"bs1": 2.0, "bs64": 2.4}
    entry = {"accuracy": 0.97, "agreement": 0.99, "size_bytes": 1, "size_ratio": 0.25,
             "latency_p50_ms": {k: 1.0 for k in speedup}}
    return {"fp32": {"accuracy": 0.98, "size_bytes": 4, "latency_p50_ms": {k: 1.0 for k in speedup}},
            "dynamic": {**entry, "accuracy_drop_pp": dynamic_drop, "speedup": {k: 1.1 for k in speedup}},
            "static": {**entry, "accuracy_drop_pp": static_drop, "speedup": speedup}}


def test_gates_pass_within_limits():
    gates = GatesParams(max_accuracy_drop_pp=1.0, min_static_speedup=1.5)
    assert report.check_gates(_summary(static_drop=1.0, dynamic_drop=0.9), gates) == []


def test_gate_fails_on_a_large_accuracy_drop():
    failures = report.check_gates(_summary(static_drop=1.5), GatesParams(max_accuracy_drop_pp=1.0))
    assert len(failures) == 1
    assert "static" in failures[0] and "gates.max_accuracy_drop_pp" in failures[0]
    failures = report.check_gates(_summary(dynamic_drop=3.0), GatesParams(max_accuracy_drop_pp=1.0))
    assert len(failures) == 1 and failures[0].startswith("dynamic")


def test_a_drop_the_test_split_cannot_tell_from_noise_passes_the_gate_with_a_note():
    """2 of 72 test images lost and none won (McNemar p = 0.25) is 2.78 pp: over the gate, but
    noise at gates.significance; 6 lost and none won (p = 0.016) is real."""
    noisy = _summary(static_drop=2.78)
    noisy["static"].update({"mcnemar_p": 0.25, "test_flips": {"lost": 2, "won": 0}})
    gates = GatesParams(max_accuracy_drop_pp=1.0)
    assert report.check_gates(noisy, gates) == []
    (note,) = report.tolerance_notes(noisy, gates)
    assert note.startswith("static loses 2.78 pp of test accuracy") and "McNemar p = 0.25" in note
    real = _summary(static_drop=8.33)
    real["static"].update({"mcnemar_p": 0.0156, "test_flips": {"lost": 6, "won": 0}})
    (failure,) = report.check_gates(real, gates)
    assert "gates.max_accuracy_drop_pp" in failure
    assert report.check_gates(noisy, GatesParams(max_accuracy_drop_pp=1.0, significance=0.3))


def test_gate_fails_on_small_static_speedup_at_the_largest_batch():
    # bs8 sorts after bs64 as text: the largest batch must be found numerically.
    summary = _summary(static_speedup={"bs1": 3.0, "bs8": 2.0, "bs64": 1.1})
    failures = report.check_gates(summary, GatesParams(min_static_speedup=1.2))
    assert len(failures) == 1
    assert "bs64" in failures[0] and "gates.min_static_speedup" in failures[0]


def test_speedup_gate_looks_only_at_the_largest_batch():
    summary = _summary(static_speedup={"bs1": 0.8, "bs8": 0.9, "bs64": 1.3})
    assert report.check_gates(summary, GatesParams(min_static_speedup=1.2)) == []


def test_both_gates_can_fail_together():
    summary = _summary(static_drop=2.0, static_speedup={"bs1": 0.5, "bs64": 0.5})
    assert len(report.check_gates(summary, GatesParams())) == 2


def test_peak_rss_gate_only_when_set(evals, benches):
    benches["dynamic"] = _bench("dynamic", {"bs1": 0.16, "bs64": 7.5}, peak={"bs1": 70.0, "bs64": 130.5})
    summary = report.build_summary(evals, benches)
    assert report.check_gates(summary, GatesParams()) == []  # no limit by default
    assert report.check_gates(summary, GatesParams(max_peak_rss_mb=200)) == []
    failures = report.check_gates(summary, GatesParams(max_peak_rss_mb=100))
    assert failures == ["dynamic peak RSS 130.5 MB at bs64 > gates.max_peak_rss_mb = 100"]


# --- slowdown notes ---------------------------------------------------------------------------

def test_slowdown_note_explains_convinteger(evals, benches):
    evals["dynamic"]["ops"] = {"ConvInteger": 2, "MatMulInteger": 1}
    benches["dynamic"] = _bench("dynamic", {"bs1": 0.8, "bs64": 32.0})  # 4x slower
    summary = report.build_summary(evals, benches)
    notes = report.slowdown_notes(summary, evals, VNNI_MACHINE)
    assert len(notes) == 1  # static is faster than FP32: no note for it
    assert notes[0].startswith("dynamic is slower than FP32 at bs1, bs64")
    assert "ConvInteger" in notes[0] and "quantize_dynamic.op_types" in notes[0]


def test_slowdown_note_without_vnni(evals, benches):
    benches["static"] = _bench("static", {"bs1": 0.4, "bs64": 6.0})  # slower only at bs1
    summary = report.build_summary(evals, benches)
    notes = report.slowdown_notes(summary, evals, NO_VNNI_MACHINE)
    assert len(notes) == 1 and notes[0].startswith("static is slower than FP32 at bs1:")
    assert "VNNI" in notes[0]


def test_slowdown_note_for_a_low_optimization_level(evals, benches):
    evals["static"]["graph_optimization_level"] = "ORT_ENABLE_BASIC"
    benches["static"] = _bench("static", {"bs1": 0.4, "bs64": 16.0})
    notes = report.slowdown_notes(report.build_summary(evals, benches), evals, VNNI_MACHINE)
    assert len(notes) == 1 and "ORT_ENABLE_EXTENDED" in notes[0]


def _profile(kernel_ms, top_op, top_node, top_ms, batch_size=64):
    return {"threads": 1, "batch_size": batch_size, "runs": 20, "kernel_ms": kernel_ms,
            "by_op_ms": {top_op: top_ms, "MaxPool": round(kernel_ms - top_ms, 4)},
            "top_nodes": [{"node": top_node, "op": top_op, "ms": top_ms,
                           "share": round(top_ms / kernel_ms, 3)}]}


def test_slowdown_note_separates_a_microsecond_batch_from_a_slow_kernel(evals, benches):
    # FP32 takes 0.02 ms at bs1 (fixed costs decide) but 8 ms at bs64 (kernels decide).
    fp32_p50 = {"bs1": 0.02, "bs64": 8.0}
    benches["fp32"] = _bench("fp32", fp32_p50)
    benches["static"] = _bench("static", {"bs1": 0.03, "bs64": 10.0}, fp32_p50=fp32_p50)
    summary = report.build_summary(evals, benches)
    profiles = {"fp32": _profile(7.9, "Conv", "conv1_nchwc", 6.0),
                "static": _profile(9.8, "QLinearConv", "node_conv2d_token_1", 7.35)}
    notes = report.slowdown_notes(summary, evals, VNNI_MACHINE, profiles)
    assert len(notes) == 1
    note = notes[0]
    assert note.startswith("static is slower than FP32 at bs1, bs64: at bs1 the FP32 model takes "
                           "only microseconds")
    assert ("; at bs64 its INT8 convolutions and matrix products themselves take longer than "
            "FP32's (7.35 ms against 6.00 ms, profiled at bs64: 9.80 ms of kernels, FP32's 7.90 "
            "ms; its slowest kernel is QLinearConv 'node_conv2d_token_1', 7.35 ms)") in note
    # Faster INT8 convolutions drowned by the elementwise rest: the note says where time goes.
    small = {**profiles, "static": {**profiles["static"], "by_op_ms": {
        "QLinearConv": 2.0, "QLinearSigmoid": 3.0, "QLinearMul": 2.5, "MaxPool": 2.3}}}
    note = report.slowdown_notes(summary, evals, VNNI_MACHINE, small)[0]
    assert ("at bs64 its convolutions and matrix products take 2.00 ms in INT8 against FP32's "
            "6.00 ms, but only 20% of its kernel time") in note
    assert "(QLinearSigmoid 31%, QLinearMul 26%, MaxPool 23%)" in note
    # Without profiles the same note still explains both batch sizes.
    plain = report.slowdown_notes(summary, evals, VNNI_MACHINE)[0]
    assert "at bs1 the FP32 model" in plain and "at bs64 INT8 kernels gain little" in plain

    # A dynamic slowdown at bs64 is put down to how little of the time its INT8 kernels take.
    benches["dynamic"] = _bench("dynamic", {"bs1": 0.01, "bs64": 8.5}, fp32_p50=fp32_p50)
    with_dynamic = report.build_summary(evals, benches)
    profiles["dynamic"] = {**_profile(8.4, "Conv", "conv1_nchwc", 6.0),
                           "by_op_ms": {"Conv": 6.0, "DynamicQuantizeMatMul": 0.84, "MaxPool": 1.56}}
    dynamic_note = report.slowdown_notes(with_dynamic, evals, VNNI_MACHINE, profiles)[0]
    assert dynamic_note == (
        "dynamic is slower than FP32 at bs64: at bs64 only 10% of its kernel time (profiled at "
        "bs64) is in INT8 kernels, so there is little to gain while activations are re-quantized "
        "every run; dynamic quantization pays off on MatMul-heavy models.")

    text = report.render_markdown(summary, notes, profiles=profiles)
    assert ("Kernel time at bs64 (1 thread(s), ORT profile): fp32 7.90 ms (Conv 76%, MaxPool 24%); "
            "static 9.80 ms (QLinearConv 75%, MaxPool 25%); dynamic 8.40 ms (Conv 71%, MaxPool 19%, "
            "DynamicQuantizeMatMul 10%).") in text


def test_no_slowdown_notes_when_everything_is_faster(evals, benches):
    summary = report.build_summary(evals, benches)
    assert report.slowdown_notes(summary, evals, VNNI_MACHINE) == []


# --- markdown ---------------------------------------------------------------------------------

def _tables(text: str) -> dict[str, list[list[str]]]:
    """{section title: rows of cells} of every Markdown table under a '## ' heading."""
    tables, title = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            title = line[3:]
        elif line.startswith("| ") and title:
            tables.setdefault(title, []).append([c.strip() for c in line.strip("|").split("|")])
    return tables


def test_markdown_names_the_machine_and_has_every_section(evals, benches):
    for b in benches.values():
        b["threads"] = [2, 1]  # all cores first, as by default
    summary = report.build_summary(evals, benches)
    text = report.render_markdown(summary, ["static is slower than FP32 at bs1: why."])
    assert text.startswith(
        "# quantpipe results\n\n**INT8 against BF16 on this machine** (avx512_vnni): not measured, "
        "no bf16 row; INT8 is weighed against FP32 only.\n\nMeasured on Test CPU, 2 cores; avx2, "
        "avx512f, avx512_vnni (no avx512bw, avx_vnni, amx_tile, amx_int8, avx512_bf16, amx_bf16, "
        "avx512_fp16); onnxruntime 1.32.0.")
    tables = _tables(text)
    assert list(tables) == ["2 intra-op threads (all cores)",
                            "FP32 PyTorch, FP32 ONNX, INT8 PTQ, INT8 QAT", "Latency by thread count",
                            "Throughput, every core busy (2 cores, largest batch)",
                            "Runtimes: the same files on each of them (2 thread(s))",
                            "Memory and start-up (a fresh process, 2 thread(s))"]
    headline = {row[0]: row for row in tables["2 intra-op threads (all cores)"]}
    assert list(headline) == ["variant", "fp32", "dynamic", "static", "qat"]
    assert headline["variant"][6:] == ["p50 bs1 (ms)", "p50 bs64 (ms)", "p99 bs1 (ms)", "p99 bs64 (ms)",
                                       "speedup bs1", "speedup bs64"]
    assert all(len(row) == len(headline["variant"]) for row in headline.values())
    # 2 threads: the fixture's latencies halve, speedups stay.
    assert headline["static"][1:4] == ["0.9700", "1.00", "0.9850"]
    assert headline["static"][6:8] == ["0.050", "1.600"] and headline["static"][10:] == ["x2.00", "x2.50"]
    assert [float(c) for c in headline["static"][8:10]] == [  # p99 beside p50
        pytest.approx(summary["static"]["latency_p99_ms"][k], abs=5e-4) for k in ("bs1", "bs64")]
    assert headline["fp32"][2] == "—"  # no drop/speedup for the baseline
    # The threads curve, ascending; p50 / p90 / p99 in one cell.
    by_threads = [row[:2] + [row[2].split(" / ")[0]] for row in tables["Latency by thread count"][1:]]
    assert by_threads[:2] == [["fp32", "1", "0.200"], ["fp32", "2", "0.100"]]
    assert len(tables["Latency by thread count"][1][2].split(" / ")) == 3
    assert len(by_threads) == 8
    throughput = {row[0]: row for row in tables["Throughput, every core busy (2 cores, largest batch)"]}
    assert throughput["static"] == ["static", "2 streams x 1 thread", "50,000", "x2.50"]
    assert throughput["fp32"][3] == "—"
    memory = {row[0]: row for row in tables["Memory and start-up (a fresh process, 2 thread(s))"]}
    assert memory["variant"] == ["variant", "load (ms)", "peak RSS bs1 (MB)", "peak RSS bs64 (MB)"]
    assert memory["static"] == ["static", "6.5", "60.0", "80.0"]
    assert "- static is slower than FP32 at bs1: why." in text and text.endswith("\n")


def test_markdown_names_the_fastest_runtime_per_variant_and_what_was_left_out(evals, benches):
    for b in benches.values():
        b["threads"] = [2, 1]
    benches["static"] = _bench("static", {"bs1": 0.1, "bs64": 3.2}, threads=(2, 1), openvino=0.5)
    benches["qat"] = _bench("qat", {"bs1": 0.1, "bs64": 3.3}, threads=(2, 1), openvino=0.5,
                            openvino_agreement=0.9)
    text = report.render_markdown(report.build_summary(evals, benches), [])
    rows = _tables(text)["Runtimes: the same files on each of them (2 thread(s))"]
    assert rows[0] == ["variant", "runtime", "agreement with ONNX Runtime", "max logit diff",
                       "p50 / p99 bs1 (ms)", "p50 / p99 bs64 (ms)", "vs FP32 on ONNX Runtime, bs64",
                       "throughput (images/s)", "trusted"]
    by_key = {(r[0], r[1]): r for r in rows[1:]}
    assert len(by_key) == 8  # four variants on two runtimes
    p50s = lambda row: [cell.split(" / ")[0] for cell in row[4:6]]  # noqa: E731
    assert p50s(by_key[("static", "ONNX Runtime")]) == ["0.050", "1.600"]
    assert by_key[("static", "ONNX Runtime")][:4] + by_key[("static", "ONNX Runtime")][6:] == [
        "static", "ONNX Runtime", "—", "—", "x2.50", "50,000", "reference"]
    assert by_key[("static", "OpenVINO")][4:] == ["0.025 / 0.025", "0.800 / 0.800", "x5.00",
                                                  "100,000", "yes"]
    assert by_key[("qat", "OpenVINO")][-1] == "no"
    assert ("- **static**: at bs1 OpenVINO, 2 threads, p50 0.025 ms, p99 0.025 ms (x4.00 the best "
            "FP32: ONNX Runtime, 2 threads, 0.100 ms); at bs64 OpenVINO, 2 threads, p50 0.800 ms, "
            "p99 0.800 ms (x5.00 the best FP32: ONNX Runtime, 2 threads, 4.000 ms); throughput OpenVINO, 2 streams x 1 thread, "
            "100,000 images/s (x5.00 the best FP32: ONNX Runtime, 2 streams x 1 thread, 20,000).") in text
    assert "- **qat**: at bs1 ONNX Runtime, 2 threads, p50 0.050 ms, p99 " in text
    assert ("- OpenVINO is left out of qat's best: models/qat.onnx on OpenVINO: its predictions agree "
            "with ONNX Runtime's on 90.00% of 1000 test samples.") in text


def test_markdown_shows_torch_in_the_latency_tables_only(evals, benches):
    torch_bench = {"accuracy": 0.98, "size_bytes": 4_000_000,
                   "latency": _bench("torch", {"bs1": 0.5, "bs64": 16.0})["latency"]}
    summary = report.build_summary(evals, benches, torch_bench)
    assert set(summary["torch"]) == {"accuracy", "size_bytes", "latency_p50_ms", "latency_p90_ms",
                                     "latency_p99_ms", "speedup", "baseline_p50_ms", "by_threads"}
    assert summary["torch"]["speedup"] == {"bs1": pytest.approx(0.4), "bs64": pytest.approx(0.5)}
    tables = _tables(report.render_markdown(summary, []))
    sections = {title: {row[0] for row in rows} for title, rows in tables.items()}
    assert "torch" in sections["1 intra-op thread (of 2 cores)"]
    assert "torch" in sections["Latency by thread count"]
    assert not any("torch" in names for title, names in sections.items()
                   if title.startswith(("Throughput", "Memory")))


def test_markdown_compares_the_guides_four_models(evals, benches):
    torch_bench = {"accuracy": 0.98, "size_bytes": 4_000_000,
                   "latency": _bench("torch", {"bs1": 0.5, "bs64": 16.0})["latency"]}
    summary = report.build_summary(evals, benches, torch_bench)
    rows = _tables(report.render_markdown(summary, []))["FP32 PyTorch, FP32 ONNX, INT8 PTQ, INT8 QAT"]
    assert rows[0] == ["model", "file", "accuracy", "size (MB)", "p50 bs1 (ms)", "p50 bs64 (ms)",
                       "speed vs FP32 ONNX, bs64"]
    assert [r[:4] for r in rows[1:]] == [
        ["FP32 PyTorch", "`models/model.pt`", "0.9800", "4.00"],
        ["FP32 ONNX", "`models/fp32.onnx`", "0.9800", "4.00"],
        ["INT8 ONNX, post-training (PTQ)", "`models/static.onnx`", "0.9700", "1.00"],
        ["INT8 ONNX, quantization-aware training (QAT)", "`models/qat.onnx`", "0.9750", "1.00"]]
    assert [r[-1] for r in rows[1:]] == ["x0.50", "x1.00", "x2.50", "x2.42"]


def test_a_skipped_variant_has_no_row_and_the_report_says_why(evals, benches):
    why = "train.model is onnx:inputs/m.onnx: there is no PyTorch model to fine-tune"
    evals["qat"] = {"variant": "qat", "skipped": why}
    benches["qat"] = {"variant": "qat", "skipped": "models/qat.onnx is empty"}
    summary = report.build_summary(evals, benches)
    assert set(summary) == {"fp32", "dynamic", "static", "machine", "runtimes", "skipped"}
    assert summary["skipped"] == {"qat": why}
    assert set(report.variants_of(summary)) == {"fp32", "dynamic", "static"}
    assert report.check_gates(summary, GatesParams()) == []
    assert report.slowdown_notes(summary, evals, VNNI_MACHINE) == []
    text = report.render_markdown(summary, [])
    assert f"- INT8 ONNX, quantization-aware training (QAT): {why}." in text
    assert "- FP32 PyTorch: no PyTorch model (brought as ONNX)." in text
    assert "| qat |" not in text


def test_a_failed_variant_is_measured_shown_never_recommended_and_fails_the_gates(evals, benches):
    passing = report.recommend(report.build_summary(evals, benches), GatesParams())
    picked = {r["variant"] for r in passing.values()} - {"fp32"}
    assert picked  # the fixture's INT8 variants pay: one of them is recommended
    variant = sorted(picked)[0]
    why = ("agreement with FP32 on 2000 pool images 83.85% < agreement_floor 97.00%, a real "
           "change whatever the validation drop")
    summary = report.build_summary(evals, benches, failed={variant: why})
    assert summary[variant]["failed"] == why
    assert [v for v in report.QUANTIZED if "failed" in summary[v]] == [variant]
    assert summary[variant]["speedup"]  # still measured
    recommended = report.recommend(summary, GatesParams())
    assert all(r["variant"] != variant for r in recommended.values())
    assert f"{variant} failed its stage's check" in " ".join(r["why"] for r in recommended.values()) \
        or all(r["variant"] != "fp32" for r in recommended.values())
    assert report.check_gates(summary, GatesParams(max_accuracy_drop_pp=5.0)) == \
        [f"{variant} failed: {why}"]
    summary["recommended"] = recommended
    text = report.render_markdown(summary, [])
    assert f"- `{variant}`: {why}" in text and f"| {variant} (failed) |" in text
    assert text.index("**Failed**") < text.index("## ")  # at the top, beside the recommendation


def test_qat_accuracy_drop_is_gated_like_the_other_variants(evals, benches):
    evals["qat"]["accuracy"] = 0.95
    failures = report.check_gates(report.build_summary(evals, benches),
                                  GatesParams(max_accuracy_drop_pp=1.0))
    assert [f.split()[0] for f in failures] == ["qat"]  # static drops exactly the 1.0 allowed


def test_thread_scaling_note_when_the_gain_shrinks_with_threads(evals, benches):
    for b in benches.values():
        b["threads"] = [2, 1]
    summary = report.build_summary(evals, benches)
    assert report.thread_scaling_notes(summary) == []  # the fixture scales evenly with threads
    # Static: x2.5 at 1 thread but only x1.5 at 2 threads at bs64.
    summary["static"]["speedup"] = summary["static"]["by_threads"]["threads2"]["speedup"] = \
        {"bs1": 2.0, "bs64": 1.5}
    notes = report.thread_scaling_notes(summary)
    assert notes == ["static gains less with more threads: x2.50 at 1, x1.50 at 2 threads "
                     "(bs64), because FP32's kernels parallelize better than its INT8 kernels "
                     "(compare the kernel profiles). With every core busy, 2 streams x 1 thread "
                     "reach x2.50 FP32's best throughput: serve concurrent requests from several "
                     "sessions rather than one session with every thread."]
    summary["static"]["throughput_config"] = {"streams": 1, "threads": 2}
    assert report.thread_scaling_notes(summary)[0].endswith("1 stream x 2 threads reach x2.50 "
                                                            "FP32's best throughput.")
    # A 1-thread headline has nothing to compare.
    for b in benches.values():
        b["threads"] = [1, 2]
    assert report.thread_scaling_notes(report.build_summary(evals, benches)) == []


# --- the bf16 row: the FP32 file computed in BF16 on OpenVINO ---------------------------------

AMX_MACHINE = {**VNNI_MACHINE, "cpu_flags": {**VNNI_MACHINE["cpu_flags"], "amx_tile": True,
                                             "amx_int8": True, "avx512_bf16": True, "amx_bf16": True}}


def _with_bf16(evals, benches, bf16_factor):
    """evals and benches as the stages write them on a CPU with native BF16: the bf16 row
    (OpenVINO at bf16_factor times FP32 on ONNX Runtime, no memory probe) and, in every INT8
    bench, the bf16 baseline timed in the same rounds (speedup_vs_bf16)."""
    ov = ("bf16", "openvino")
    fp32 = ("fp32", "onnxruntime")
    for variant, b in benches.items():
        b["machine"] = AMX_MACHINE
        grid = {count: {bs: {ov: _lat(r.get("baseline_p50_ms", r["p50_ms"]) * bf16_factor),
                             fp32: _lat(r.get("baseline_p50_ms", r["p50_ms"])),
                             (variant, "onnxruntime"): _lat(r["p50_ms"])}
                        for bs, r in rows.items()} for count, rows in b["latency"].items()}
        ips = {ov: {StreamConfig(2, 1): FP32_IPS / bf16_factor},
               fp32: {StreamConfig(2, 1): FP32_IPS},
               (variant, "onnxruntime"): {StreamConfig(2, 1): b["throughput"]["best"]["ips"]}}
        if variant != "fp32":
            b["best"] = bench.best_configuration(grid, ips, variant, ["onnxruntime"], "fp32", ["onnxruntime"])
            bench.add_versus(b["best"], grid, ips, "bf16", ["openvino"])
    row = _bench("bf16", {bs: p * bf16_factor for bs, p in FP32_P50.items()},
                 threads=tuple(int(k.removeprefix("threads")) for k in benches["fp32"]["latency"]))
    row.update({"machine": AMX_MACHINE, "threads": benches["fp32"]["threads"]})
    openvino = {"title": "OpenVINO", "version": "2026.4.1",
                "parity": {**row["runtimes"]["openvino"]["parity"], "agreement": 0.999},
                "latency": row["latency"], "throughput": row["throughput"]}
    row.update({"runtime": "openvino", "runtimes": {"openvino": openvino},
                "unsupported": {"onnxruntime": "no BF16 here"},
                "kernels": {"openvino": kernel_table([{"layer": "Convolution", "kernel": "brgconv_avx512_amx_bf16",
                                                       "precision": "bf16", "isa": "AMX-BF16", "count": 2}])}})
    row["best"]["latency"] = {bs: {**r, "runtime": "openvino"} for bs, r in row["best"]["latency"].items()}
    del row["memory"]
    benches["bf16"] = row
    benches["static"]["kernels"] = {
        "onnxruntime": kernel_table([{"layer": "QLinearConv", "kernel": "MLAS symmetric conv",
                                      "precision": "u8s8", "isa": "AVX-512 VNNI", "count": 2}]),
        "openvino": kernel_table([{"layer": "Convolution", "kernel": "brgconv_avx512_amx_I8",
                                   "precision": "u8", "isa": "AMX-INT8", "count": 2}])}
    evals["bf16"] = {**_eval("bf16", 0.98, 0.999, evals["fp32"]["size_bytes"]),
                     "runtime": "openvino", "inference_precision": "bf16"}


def test_the_bf16_row_is_a_candidate_and_int8_is_weighed_against_it(evals, benches):
    for b in benches.values():
        b["threads"] = [2, 1]
    _with_bf16(evals, benches, bf16_factor=0.3)  # BF16 at 0.3x FP32's latency: faster than INT8
    summary = report.build_summary(evals, benches)
    bf16 = summary["bf16"]
    assert bf16["runtime"] == "openvino" and bf16["inference_precision"] == "bf16"
    assert "peak_rss_mb" not in bf16 and bf16["accuracy_drop_pp"] == 0.0
    assert bf16["speedup"]["bs64"] == pytest.approx(1 / 0.3, rel=1e-3)
    static = summary["static"]
    # static at 2 threads: 1.6 ms at bs64; BF16: 0.3 x FP32's 4.0 ms = 1.2 ms.
    assert static["speedup_vs_bf16"]["bs64"] == pytest.approx(1.2 / 1.6, rel=1e-3)
    assert static["best"]["latency"]["bs64"]["bf16"]["runtime"] == "openvino"
    assert "throughput_speedup_vs_bf16" in static
    picks = report.recommend(summary, GatesParams())
    assert picks["bs64"]["variant"] == "bf16" and picks["bs64"]["runtime"] == "openvino"
    text = report.render_markdown(summary, [])
    first = text.split("\n")[2]
    assert first.startswith("**INT8 against BF16 on this machine** (amx_int8, amx_bf16, avx512_bf16, "
                            "avx512_vnni): INT8 does not pay over BF16: the fastest, ")
    assert "static, runs x0.75 BF16's best at bs64 (" in first and "static x0.75 at bs64, x0.60 at bs1" in first
    assert "BF16 (the FP32 file on OpenVINO, no calibration) runs x" in first
    assert ("**Kernels**: INT8 convolutions ran on AVX-512 VNNI under ONNX Runtime; INT8 convolutions "
            "ran on AMX-INT8 under OpenVINO; BF16 convolutions ran on AMX-BF16 under OpenVINO") in text
    tables = _tables(text)
    assert "Kernels (largest batch, latency configuration)" in tables
    rows = [row for row in tables["Runtimes: the same files on each of them (2 thread(s))"] if row[0] == "bf16"]
    assert [row[1] for row in rows] == ["OpenVINO"]  # its keys are OpenVINO's, once
    assert "bf16" not in {row[0] for row in tables["Memory and start-up (a fresh process, 2 thread(s))"]}
    # INT8 that beats BF16 by more than noise pays.
    _with_bf16(evals, benches, bf16_factor=0.9)
    first = report.render_markdown(report.build_summary(evals, benches), []).split("\n")[2]
    assert "INT8 pays over BF16: static runs x2.25 BF16's best at bs64" in first


def test_without_native_bf16_the_report_says_int8_is_weighed_against_fp32_only(evals, benches):
    reason = machine.bf16_missing(VNNI_MACHINE)
    evals["bf16"] = {"variant": "bf16", "skipped": reason}
    benches["bf16"] = {"variant": "bf16", "skipped": reason}
    summary = report.build_summary(evals, benches)
    assert "bf16" not in summary and summary["skipped"] == {"bf16": reason}
    first = report.render_markdown(summary, []).split("\n")[2]
    assert first == (f"**INT8 against BF16 on this machine** (avx512_vnni): not measured, {reason}; "
                     "INT8 is weighed against FP32 only.")
