"""quantpipe.params: params.yaml -> typed, validated Params with ONNX Runtime enums."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import onnxruntime
import pytest
import yaml
from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType

from helpers import ROOT
from quantpipe.errors import UserError
from quantpipe.schemas.all import Params, load_params, parse_params

# Key names users and tests rely on (docs/params.md).
CONTRACT_KEYS = (
    "seed", "prepare.source", "prepare.path", "prepare.image_size", "prepare.calib_size",
    "train.model", "train.epochs", "train.batch_size", "train.lr", "export.opset",
    "quantize_dynamic.weight_type", "quantize_dynamic.op_types",
    "quantize_static.calibrate_method", "quantize_static.quant_format",
    "quantize_static.activation_type", "quantize_static.weight_type",
    "quantize_static.per_channel", "quantize_static.nodes_to_exclude",
    "bench.batch_sizes", "bench.threads", "gates.max_accuracy_drop_pp",
    "gates.min_static_speedup",
)


def _dotted_keys(mapping: dict, prefix: str = "") -> set[str]:
    keys = set()
    for k, v in mapping.items():
        keys.add(prefix + k)
        if isinstance(v, dict) and k != "extra_options":  # extra_options is free-form
            keys |= _dotted_keys(v, prefix + k + ".")
    return keys


def _dataclass_keys(obj, prefix: str = "") -> set[str]:
    keys = set()
    for f in dataclasses.fields(obj):
        keys.add(prefix + f.name)
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys |= _dataclass_keys(value, prefix + f.name + ".")
    return keys


def _error(raw: dict) -> str:
    with pytest.raises(UserError) as info:
        parse_params(raw)
    return str(info.value)


# --- defaults ---------------------------------------------------------------------------------

def test_params_yaml_equals_dataclass_defaults():
    assert load_params(ROOT / "params.yaml") == Params()


def test_params_yaml_spells_out_every_field():
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert _dotted_keys(raw) == _dataclass_keys(Params())


def test_params_yaml_has_the_contract_keys():
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    missing = [k for k in CONTRACT_KEYS if k not in _dotted_keys(raw)]
    assert missing == []
    # null: the task's default, mnist5k for the default task (classification).
    assert load_params(ROOT / "params.yaml").prepare.source == "mnist5k"
    assert load_params(ROOT / "params.yaml").prepare.task == "classification"


def test_defaults_are_the_fast_x86_path():
    p = Params()
    assert p.quantize_static.quant_format is QuantFormat.QDQ
    assert p.quantize_static.activation_type is QuantType.QUInt8
    assert p.quantize_static.weight_type is QuantType.QInt8
    assert p.quantize_static.per_channel is True
    assert "Conv" not in p.quantize_dynamic.op_types
    # 7-bit weights exactly where 8-bit ones overflow the fast INT8 kernels (test_onnx.py).
    assert p.quantize_static.reduce_range == p.quantize_dynamic.reduce_range == "auto"


def test_the_drop_bar_is_the_tasks_unless_set():
    """quantize_static.max_drop_pts: null is the task's: 0.5 pp of a classifier's accuracy and
    0.5 points of a segmenter's mIoU, one point of a detector's mAP@[.5:.95] (the tolerance
    table's "excellent"); a value of the user's holds for every task."""
    from quantpipe.tasks import TASKS

    p = Params().quantize_static
    assert p.max_drop_pts is None
    assert {t: p.for_task(t).max_drop_pts for t in TASKS} == {
        "classification": 0.5, "detection": 1.0, "segmentation": 0.5}
    mine = parse_params({"quantize_static": {"max_drop_pts": 0.3}}).quantize_static
    assert {mine.for_task(t).max_drop_pts for t in TASKS} == {0.3}
    assert _error({"quantize_static": {"max_drop_pts": -1}}).endswith(
        "quantize_static.max_drop_pts = -1.0 is not allowed; use a number >= 0, or null (the "
        "task's)")


def test_empty_mapping_gives_defaults(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("")
    assert load_params(path) == Params()


def test_partial_section_keeps_other_defaults():
    p = parse_params({"train": {"epochs": 3}})
    assert p.train.epochs == 3
    assert p.train.batch_size == Params().train.batch_size
    assert p.bench == Params().bench


# --- unknown keys -----------------------------------------------------------------------------

def test_unknown_top_level_key_is_named():
    message = _error({"sed": 1})
    assert "unknown key sed" in message
    assert "seed" in message  # the allowed keys are listed


def test_unknown_nested_key_names_the_full_dotted_key():
    message = _error({"quantize_static": {"calibrate_methd": "MinMax"}})
    assert "quantize_static.calibrate_methd" in message
    assert "calibrate_method" in message


@pytest.mark.parametrize("section", ["quantize_static", "review"])
def test_a_renamed_key_names_its_new_name(section):
    """The drop thresholds hold mAP and mIoU points too: max_accuracy_drop_pp became
    max_drop_pts, and a params.yaml with the old name says so in one line."""
    message = _error({section: {"max_accuracy_drop_pp": 0.5}})
    assert f"{section}.max_accuracy_drop_pp is now {section}.max_drop_pts" in message
    assert "\n" not in message


def test_unknown_doubly_nested_key():
    message = _error({"evaluate": {"batch_consistency_atol": {"fp16": 0.1}}})
    assert "evaluate.batch_consistency_atol.fp16" in message


def test_error_message_names_the_source():
    with pytest.raises(UserError, match=r"^myparams.yaml: "):
        parse_params({"bogus": 1}, source="myparams.yaml")


# --- wrong types ------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, key", [
    ({"train": {"epochs": "ten"}}, "train.epochs"),
    ({"train": {"epochs": True}}, "train.epochs"),  # a YAML bool is not an integer
    ({"train": {"epochs": 2.5}}, "train.epochs"),
    ({"quantize_static": {"per_channel": "yes"}}, "quantize_static.per_channel"),
    ({"bench": {"batch_sizes": 4}}, "bench.batch_sizes"),
    ({"bench": {"batch_sizes": [1, "big"]}}, "bench.batch_sizes[1]"),
    ({"train": {"lr": "fast"}}, "train.lr"),
    ({"train": {"model": 18}}, "train.model"),
    ({"quantize_static": {"extra_options": [1]}}, "quantize_static.extra_options"),
    ({"train": 5}, "train"),
])
def test_wrong_type_names_the_key(raw, key):
    message = _error(raw)
    assert key in message
    assert repr(raw_value(raw, key)) in message  # the bad value is shown too


def raw_value(raw: dict, key: str):
    value = raw
    for part in key.split("."):
        name, _, index = part.partition("[")
        value = value[name]
        if index:
            value = value[int(index.rstrip("]"))]
    return value


def test_int_is_accepted_where_a_float_is_expected():
    p = parse_params({"train": {"lr": 1}})
    assert p.train.lr == 1.0 and isinstance(p.train.lr, float)


def test_lists_become_tuples():
    p = parse_params({"quantize_dynamic": {"op_types": ["MatMul"]}, "bench": {"batch_sizes": [1, 8]}})
    assert p.quantize_dynamic.op_types == ("MatMul",)
    assert p.bench.batch_sizes == (1, 8)


# --- enums ------------------------------------------------------------------------------------

def test_invalid_calibrate_method_lists_allowed_values():
    message = _error({"quantize_static": {"calibrate_method": "Minmax"}})
    assert "quantize_static.calibrate_method" in message and "'Minmax'" in message
    for allowed in ("MinMax", "Entropy", "Percentile"):
        assert allowed in message


def test_invalid_activation_type_lists_allowed_values():
    message = _error({"quantize_static": {"activation_type": "S8"}})
    assert "quantize_static.activation_type" in message and "'S8'" in message
    for allowed in ("QInt8", "QUInt8"):
        assert allowed in message


def test_invalid_quant_format_and_level_list_allowed_values():
    message = _error({"quantize_static": {"quant_format": "qdq"}})
    assert "quantize_static.quant_format" in message and "QDQ" in message and "QOperator" in message
    message = _error({"runtime": {"graph_optimization_level": "ALL"}})
    assert "runtime.graph_optimization_level" in message and "ORT_ENABLE_ALL" in message


def test_enum_given_a_non_string_is_refused():
    assert "quantize_dynamic.weight_type" in _error({"quantize_dynamic": {"weight_type": 0}})


def test_strings_become_ort_enums():
    p = parse_params({
        "quantize_static": {"quant_format": "QDQ", "activation_type": "QUInt8",
                            "weight_type": "QInt8", "calibrate_method": "Entropy"},
        "quantize_dynamic": {"weight_type": "QUInt8"},
        "runtime": {"graph_optimization_level": "ORT_ENABLE_EXTENDED"},
    })
    assert p.quantize_static.quant_format is QuantFormat.QDQ
    assert p.quantize_static.activation_type is QuantType.QUInt8
    assert p.quantize_static.weight_type is QuantType.QInt8
    assert p.quantize_static.calibrate_method is CalibrationMethod.Entropy
    assert p.quantize_dynamic.weight_type is QuantType.QUInt8
    level = p.runtime.graph_optimization_level
    assert isinstance(level, onnxruntime.GraphOptimizationLevel)
    assert level == onnxruntime.GraphOptimizationLevel.ORT_ENABLE_EXTENDED


def test_bench_threads_take_counts_and_the_word_all():
    assert Params().bench.threads == ("all", "powers")  # the headline is all cores, then the curve
    assert parse_params({"bench": {"threads": [4, "all", 2]}}).bench.threads == (4, "all", 2)
    assert parse_params({"gates": {"max_peak_rss_mb": 512}}).gates.max_peak_rss_mb == 512.0
    assert Params().gates.max_peak_rss_mb is None


def test_bench_runtimes_default_to_both_engines_and_name_real_ones():
    assert Params().bench.runtimes == ("onnxruntime", "openvino")
    assert Params().bench.min_runtime_agreement == 0.995
    assert parse_params({"bench": {"runtimes": ["onnxruntime"]}}).bench.runtimes == ("onnxruntime",)
    from quantpipe.runtimes import registry
    assert registry.RUNTIMES.names() == list(Params().bench.runtimes) and registry.REFERENCE == "onnxruntime"
    runtimes = registry.select(["onnxruntime"], level=Params().runtime.graph_optimization_level)
    assert [e.title for e in runtimes.values()] == ["ONNX Runtime"]
    with pytest.raises(UserError, match=r"^bench.runtimes: 'tensorrt' is not allowed; use one of "
                                        r"\['onnxruntime', 'openvino'\]$"):
        registry.select(["onnxruntime", "tensorrt"], level=Params().runtime.graph_optimization_level)
    with pytest.raises(UserError, match="must include onnxruntime"):
        registry.select(["openvino"], level=Params().runtime.graph_optimization_level)


def test_qoperator_and_percentile_parse():
    p = parse_params({"quantize_static": {"quant_format": "QOperator",
                                          "calibrate_method": "Percentile",
                                          "extra_options": {"CalibPercentile": 99.9}}})
    assert p.quantize_static.quant_format is QuantFormat.QOperator
    assert p.quantize_static.calibrate_method is CalibrationMethod.Percentile
    assert p.quantize_static.extra_options == {"CalibPercentile": 99.9}


# --- invalid values ---------------------------------------------------------------------------

@pytest.mark.parametrize("raw, key, allowed", [
    ({"bench": {"batch_sizes": [0]}}, "bench.batch_sizes", ">= 1"),
    ({"bench": {"batch_sizes": []}}, "bench.batch_sizes", "non-empty"),
    ({"bench": {"threads": [0]}}, "bench.threads", ">= 1"),
    ({"bench": {"threads": ["ALL"]}}, "bench.threads", "'all' (every physical core)"),
    ({"bench": {"threads": []}}, "bench.threads", "non-empty"),
    ({"bench": {"threads": [1.5]}}, "bench.threads[0]", "expected int or str"),
    ({"bench": {"threads": [True]}}, "bench.threads[0]", "expected int or str"),
    ({"gates": {"max_peak_rss_mb": 0}}, "gates.max_peak_rss_mb", "> 0 (MiB) or null"),
    ({"bench": {"runs": 3, "rounds": 5}}, "bench.runs", "bench.rounds"),
    ({"bench": {"runtimes": ["onnxruntime", "onnxruntime"]}}, "bench.runtimes", "distinct"),
    ({"bench": {"min_runtime_agreement": 99.5}}, "bench.min_runtime_agreement", "[0, 1]"),
    ({"quantize_static": {"extra_options": {"CalibPercentile": 101}}},
     "quantize_static.extra_options.CalibPercentile", "(0, 100]"),
    ({"quantize_static": {"extra_options": {"CalibPercentile": 0}}},
     "quantize_static.extra_options.CalibPercentile", "(0, 100]"),
    ({"quantize_static": {"calib_batch_size": 0}}, "quantize_static.calib_batch_size", ">= 1"),
    ({"quantize_static": {"reduce_range": "yes"}}, "quantize_static.reduce_range",
     "true, false or auto"),
    ({"quantize_dynamic": {"reduce_range": "7bit"}}, "quantize_dynamic.reduce_range",
     "true, false or auto"),
    ({"prepare": {"test_fraction": 0.7}}, "prepare.test_fraction", "(0, 0.5)"),
    ({"prepare": {"val_fraction": 0}}, "prepare.val_fraction", "(0, 0.5)"),
    ({"prepare": {"image_size": 4}}, "prepare.image_size", "8..1024"),
    ({"prepare": {"calib_size": 0}}, "prepare.calib_size", ">= 1"),
    ({"prepare": {"source": "cifar"}}, "prepare.source", "mnist5k"),
    ({"train": {"epochs": 0}}, "train.epochs", ">= 1"),
    ({"train": {"lr": 0.0}}, "train.lr", "(0, 10)"),
    ({"export": {"opset": 11}}, "export.opset", "18..23"),
    ({"gates": {"max_accuracy_drop_pp": -1}}, "gates.max_accuracy_drop_pp", ">= 0"),
    ({"review": {"max_drop_pts": -0.1}}, "review.max_drop_pts", ">= 0 (points of the task's score)"),
    ({"review": {"max_speedup_regression": 15}}, "review.max_speedup_regression", "[0, 1), e.g. 0.35"),
    ({"evaluate": {"batch_consistency_atol": {"static": 0}}},
     "evaluate.batch_consistency_atol.static", "> 0"),
    ({"quantize_qat": {"epochs": 0}}, "quantize_qat.epochs", ">= 1"),
    ({"quantize_qat": {"lr": 0.0}}, "quantize_qat.lr", "(0, 10)"),
    ({"quantize_qat": {"freeze_bn_after": -1}}, "quantize_qat.freeze_bn_after", "steps >= 0, or null"),
    ({"quantize_qat": {"min_agreement": 1.5}}, "quantize_qat.min_agreement", "(0, 1]"),
    ({"quantize_qat": {"max_abs_diff": 0}}, "quantize_qat.max_abs_diff", "> 0"),
])
def test_invalid_value_names_key_and_allowed_range(raw, key, allowed):
    message = _error(raw)
    assert f"{key} = " in message
    assert allowed in message


def test_negative_seed_is_refused():
    assert "seed" in _error({"seed": -1})


# --- load_params ------------------------------------------------------------------------------

def test_missing_file_is_a_user_error(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(UserError, match="nope.yaml: not found"):
        load_params(path)


def test_invalid_yaml_is_a_user_error(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("train: {epochs: [1\n")
    with pytest.raises(UserError, match="not valid YAML") as info:
        load_params(path)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_non_mapping_yaml_is_a_user_error(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(UserError, match="expected a mapping"):
        load_params(path)


def test_load_params_error_names_file_and_key(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("quantize_static:\n  calibrate_methd: MinMax\n")
    with pytest.raises(UserError) as info:
        load_params(path)
    assert str(path) in str(info.value)
    assert "quantize_static.calibrate_methd" in str(info.value)


# --- the stage boundary -----------------------------------------------------------------------

def _run_prepare(cwd, debug: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "QUANTPIPE_DEBUG"}
    if debug:
        env["QUANTPIPE_DEBUG"] = "1"
    env["PYTHONPATH"] = str(ROOT)  # the stages package of this checkout, run elsewhere
    return subprocess.run([sys.executable, "-m", "stages.prepare", "--prepared", "data/prepared",
                           "--calibration", "data/calibration", "--metrics", "metrics/prepare.json"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_stage_with_bad_params_prints_one_error_line_and_exits_2(tmp_path):
    (tmp_path / "params.yaml").write_text("seed: 0\nprepare:\n  image_size: ten\n")
    result = _run_prepare(tmp_path, debug=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:")
    assert "prepare.image_size" in lines[0]
    assert "Traceback" not in result.stderr
    # It failed at the boundary: nothing was written.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


def test_stage_with_bad_params_and_debug_shows_traceback(tmp_path):
    (tmp_path / "params.yaml").write_text("seed: 0\nprepare:\n  image_size: ten\n")
    result = _run_prepare(tmp_path, debug=True)
    assert result.returncode not in (0, 2)
    assert "Traceback" in result.stderr
    assert "UserError" in result.stderr and "prepare.image_size" in result.stderr
