"""Typed, validated view of params.yaml.

Strings become ONNX Runtime enums here, once; library code only sees enums. Every error names
the key, the bad value and what is allowed, so a user can fix params.yaml from one line.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from onnxruntime import GraphOptimizationLevel
from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType

from quantpipe.errors import UserError

PARAMS_FILE = Path("params.yaml")

# mnist5k and digits ship inside installed wheels; the others read prepare.path.
SOURCES = ("mnist5k", "digits", "imagefolder", "npz", "torchvision:<Name>")


@dataclass(frozen=True)
class PrepareParams:
    source: str = "mnist5k"
    path: str | None = None
    # Side of the square images fed to the model (pixels); mnist5k is natively 28.
    image_size: int = 28
    # 1 or 3 converts every image (grey <-> RGB); null keeps the dataset's own channels.
    channels: int | None = None
    # Per-channel normalization of pixel/255; null computes it on the train split. Set it to
    # what a model brought as ONNX was trained with (e.g. ImageNet's 0.485, 0.456, 0.406).
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    # Shares of the whole dataset; the rest is train. Stratified, so each class keeps its share.
    val_fraction: float = 0.1
    test_fraction: float = 0.2
    # Calibration samples drawn from the train split (never test): a few hundred cover the
    # activation ranges of a small CNN; more only slows Entropy/Percentile calibration.
    calib_size: int = 256

    def __post_init__(self) -> None:
        known = self.source in SOURCES or (self.source.startswith("torchvision:")
                                           and len(self.source) > len("torchvision:"))
        _check(known, "prepare.source", self.source, f"one of {list(SOURCES)}")
        _check(self.channels in (None, 1, 3), "prepare.channels", self.channels, "1, 3 or null")
        _check((self.mean is None) == (self.std is None), "prepare.mean", self.mean,
               "null together with prepare.std, or a list beside it")
        _check(self.std is None or all(v > 0 for v in self.std), "prepare.std", self.std,
               "a list of numbers > 0")
        _check(8 <= self.image_size <= 1024, "prepare.image_size", self.image_size, "8..1024")
        for key in ("val_fraction", "test_fraction"):
            value = getattr(self, key)
            _check(0 < value < 0.5, f"prepare.{key}", value, "a number in (0, 0.5)")
        _check(self.calib_size >= 1, "prepare.calib_size", self.calib_size, "an integer >= 1")


@dataclass(frozen=True)
class TrainParams:
    # A zoo name (simple_cnn, mnist_net) or a torchvision classification model (resnet18, ...).
    model: str = "mnist_net"
    epochs: int = 10
    batch_size: int = 64
    lr: float = 1e-3
    # Random shifts of up to this many pixels: cheap augmentation that keeps a 3,500-image
    # MNIST training set from over-fitting (~98% test accuracy with 10 epochs).
    max_shift: int = 1

    def __post_init__(self) -> None:
        # The model name itself is checked by quantpipe.models (it needs torchvision).
        _check(bool(self.model), "train.model", self.model, "a model name such as mnist_net")
        _check(self.epochs >= 1, "train.epochs", self.epochs, "an integer >= 1")
        _check(self.batch_size >= 1, "train.batch_size", self.batch_size, "an integer >= 1")
        _check(0 < self.lr < 10, "train.lr", self.lr, "a number in (0, 10)")
        _check(0 <= self.max_shift <= 8, "train.max_shift", self.max_shift, "0..8 pixels")


@dataclass(frozen=True)
class ExportParams:
    # 18 is the lowest opset torch 2.14's dynamo exporter emits without a lossy conversion.
    opset: int = 18
    # FP32 ONNX vs PyTorch logits; typical float reordering noise is 1e-6..1e-5.
    max_abs_diff: float = 1e-4

    def __post_init__(self) -> None:
        _check(18 <= self.opset <= 23, "export.opset", self.opset, "18..23")
        _check(self.max_abs_diff > 0, "export.max_abs_diff", self.max_abs_diff, "a number > 0")


@dataclass(frozen=True)
class SimplifyParams:
    max_abs_diff: float = 1e-4

    def __post_init__(self) -> None:
        _check(self.max_abs_diff > 0, "simplify.max_abs_diff", self.max_abs_diff, "a number > 0")


@dataclass(frozen=True)
class QuantizeDynamicParams:
    weight_type: QuantType = QuantType.QInt8
    per_channel: bool = False
    reduce_range: bool = False
    # Conv is left out on purpose: ConvInteger runs 4-5x slower than FP32 Conv on x86.
    op_types: tuple[str, ...] = ("MatMul", "Gemm")
    nodes_to_exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # ORT reads an empty list as "everything", Conv (slow ConvInteger) included.
        _check(bool(self.op_types), "quantize_dynamic.op_types", list(self.op_types),
               "a non-empty list of op types, e.g. [MatMul, Gemm]")


# The extra_options keys ORT's quantize_static reads (onnxruntime/quantization/quantize.py);
# ORT ignores any other key, so a typo would silently change nothing.
STATIC_EXTRA_OPTIONS = (
    "ActivationSymmetric", "WeightSymmetric", "EnableSubgraph", "ForceQuantizeNoInputCheck",
    "MatMulConstBOnly", "AddQDQPairToWeight", "OpTypesToExcludeOutputQuantization",
    "DedicatedQDQPair", "QDQOpTypePerChannelSupportToAxis", "QDQKeepRemovableActivations",
    "QDQDisableWeightAdjustForInt32Bias", "UseQDQContribOps", "MinimumRealRange",
    "TensorQuantOverrides", "SmoothQuant", "SmoothQuantAlpha", "SmoothQuantFolding",
    "CalibTensorRangeSymmetric", "CalibStridedMinMax", "CalibMovingAverage",
    "CalibMovingAverageConstant", "CalibMaxIntermediateOutputs", "CalibPercentile")


class Engine(enum.Enum):
    """Who quantizes models/static.onnx: ORT's quantize_static, or NNCF's ONNX PTQ."""
    onnxruntime = "onnxruntime"
    nncf = "nncf"


# NNCF's own enums, by value (nncf.QuantizationPreset, nncf.ModelType): params are read by every
# stage and importing nncf costs ~2 s, so quantpipe.nncf_engine maps these when it runs.
class NNCFPreset(enum.Enum):
    performance = "performance"  # symmetric weights and activations
    mixed = "mixed"  # symmetric weights, asymmetric activations


class BiasCorrection(enum.Enum):
    fast = "fast"  # NNCF's FastBiasCorrection: one pass, little memory
    full = "full"  # BiasCorrection: layer by layer, slower, in general more accurate
    none = "none"


class NNCFModelType(enum.Enum):
    transformer = "transformer"  # adds transformer patterns and SmoothQuant


@dataclass(frozen=True)
class NNCFParams:
    """quantize_static with engine: nncf (NNCF's defaults; nodes_to_exclude is its ignored scope)."""
    preset: NNCFPreset = NNCFPreset.performance
    bias_correction: BiasCorrection = BiasCorrection.fast
    # Calibration samples NNCF collects statistics on; null: the whole calibration set.
    subset_size: int | None = None
    model_type: NNCFModelType | None = None
    # SmoothQuant's alpha for MatMul (model_type: transformer only); null: NNCF's default,
    # a negative number switches SmoothQuant off.
    smooth_quant_alpha: float | None = None

    def __post_init__(self) -> None:
        _check(self.subset_size is None or self.subset_size >= 1, "quantize_static.nncf.subset_size",
               self.subset_size, "an integer >= 1 or null (every calibration sample)")
        _check(self.smooth_quant_alpha is None or self.smooth_quant_alpha <= 1,
               "quantize_static.nncf.smooth_quant_alpha", self.smooth_quant_alpha,
               "a number in [0, 1], negative to disable, or null")


@dataclass(frozen=True)
class QuantizeStaticParams:
    engine: Engine = Engine.onnxruntime
    # QDQ + U8 activations + S8 weights, per channel: the fast path on x86 (DESIGN.md §3).
    quant_format: QuantFormat = QuantFormat.QDQ
    activation_type: QuantType = QuantType.QUInt8
    weight_type: QuantType = QuantType.QInt8
    per_channel: bool = True
    reduce_range: bool = False
    calibrate_method: CalibrationMethod = CalibrationMethod.MinMax
    # Samples per calibration batch; Entropy/Percentile keep every batch's activations in memory.
    calib_batch_size: int = 32
    nodes_to_exclude: tuple[str, ...] = ()
    # Empty means every op type ORT can quantize.
    op_types_to_quantize: tuple[str, ...] = ()
    extra_options: dict = field(default_factory=dict)
    # Histogram calibration (Entropy, Percentile): bins collected, and for Entropy the bins of
    # the candidate ranges it compares by KL divergence (ORT's 128/128 default leaves one
    # candidate, the full range, so Entropy would equal MinMax).
    calib_num_bins: int = 2048
    calib_num_quantized_bins: int = 128
    # Calibration memory budget (MiB) for intermediate activations; see quant.calibration_plan.
    calib_memory_mb: int = 2048
    # Accuracy-aware fallback: while the drop is real (quantpipe.criterion: the validation
    # accuracy drops by more than max_accuracy_drop_pp, the flips are lopsided beyond chance at
    # `significance` by McNemar's test, and agreement with FP32 on the unlabeled pool is below
    # min_pool_agreement), the engine's fallback runs: ORT's recovery ladder
    # (quant.quantize_static_with_fallback; max_fallback_steps rounds of per-node candidates)
    # or NNCF's accuracy control (at most max_fallback_steps quantizer groups reverted).
    max_accuracy_drop_pp: float = 0.5
    # A screening level, not a publication one: a false alarm costs a fallback step, a missed
    # drop ships a worse model (Entropy on the default model: 8 vs 2 flips, p = 0.055).
    significance: float = 0.1
    # At 99.5% agreement with FP32 no accuracy can move by more than 0.5 pp.
    min_pool_agreement: float = 0.995
    # Below this agreement on the pool the change is real whatever the drop and McNemar say
    # (quantpipe.criterion). Across the torchvision families at 32 px (metrics/families.json)
    # static models kept 97.5-100% of the pool where they changed little; MobileNet v2, RegNet,
    # Inception v3, MaxViT and the EfficientNets kept 77-96%, their flips symmetric enough for
    # McNemar to call them noise.
    agreement_floor: float = 0.97
    max_fallback_steps: int = 3
    # onnxruntime engine: per ladder round, the top nodes by SQNR that are each tried (alone
    # and with their readers); the one that regains most is kept, as SQNR alone misranks.
    fallback_candidates: int = 3
    nncf: NNCFParams = field(default_factory=NNCFParams)
    # true: a model still over the drop after the fallback is kept (with a warning).
    allow_accuracy_drop: bool = False

    def __post_init__(self) -> None:
        _check(self.calib_num_quantized_bins >= 2, "quantize_static.calib_num_quantized_bins",
               self.calib_num_quantized_bins, "an integer >= 2")
        _check(self.calib_num_bins > self.calib_num_quantized_bins, "quantize_static.calib_num_bins",
               self.calib_num_bins, f"an integer > calib_num_quantized_bins ({self.calib_num_quantized_bins})")
        _check(self.calib_memory_mb >= 16, "quantize_static.calib_memory_mb", self.calib_memory_mb,
               "an integer >= 16 (MiB)")
        _check(self.max_accuracy_drop_pp >= 0, "quantize_static.max_accuracy_drop_pp",
               self.max_accuracy_drop_pp, "a number >= 0")
        _check(0 < self.significance < 1, "quantize_static.significance", self.significance,
               "a probability in (0, 1), e.g. 0.05")
        _check(0 < self.min_pool_agreement <= 1, "quantize_static.min_pool_agreement",
               self.min_pool_agreement, "a share in (0, 1], e.g. 0.995")
        _check(0 <= self.agreement_floor <= self.min_pool_agreement, "quantize_static.agreement_floor",
               self.agreement_floor, f"a share in [0, min_pool_agreement = {self.min_pool_agreement}], "
               "e.g. 0.97")
        _check(self.max_fallback_steps >= 0, "quantize_static.max_fallback_steps",
               self.max_fallback_steps, "an integer >= 0")
        _check(self.fallback_candidates >= 1, "quantize_static.fallback_candidates",
               self.fallback_candidates, "an integer >= 1")
        _check(self.calib_batch_size >= 1, "quantize_static.calib_batch_size",
               self.calib_batch_size, "an integer >= 1")
        for key in self.extra_options:
            _check(key in STATIC_EXTRA_OPTIONS, f"quantize_static.extra_options.{key}",
                   self.extra_options[key], f"one of the keys {', '.join(STATIC_EXTRA_OPTIONS)}")
        percentile = self.extra_options.get("CalibPercentile")
        if percentile is not None:
            _check(isinstance(percentile, (int, float)) and 0 < percentile <= 100,
                   "quantize_static.extra_options.CalibPercentile", percentile, "a number in (0, 100]")


@dataclass(frozen=True)
class QuantizeQATParams:
    """Quantization-aware training (quantpipe.qat): models/model.pt fine-tuned with fake
    quantization in the static variant's x86 scheme, exported as QDQ models/qat.onnx."""
    # false: the stage writes an empty models/qat.onnx and a metrics file saying it skipped.
    enabled: bool = True
    epochs: int = 2
    batch_size: int = 64
    # A tenth of train.lr: QAT moves trained weights onto the INT8 grid, it does not re-learn them.
    lr: float = 1e-4
    # S8 weights per output channel (as quantize_static.per_channel: true), or per tensor.
    per_channel: bool = True
    # Optimizer steps after which BatchNorm normalizes with its running statistics (as at
    # inference) instead of each batch's; null: never frozen during the fine-tune. Steps after
    # which the fake-quant ranges stop following the batches; null: at the end.
    freeze_bn_after: int | None = 50
    freeze_observers_after: int | None = None
    # Samples per batch of the calibration pass that starts the ranges (min/max, as MinMax).
    calib_batch_size: int = 32
    # Parity of models/qat.onnx, its QDQ graph run as written, against the fake-quant PyTorch
    # model on the test split: rounding flips move logits by a few output steps (0.1-0.4 here);
    # a wrong export differs by whole logits and in its predictions.
    max_abs_diff: float = 1.0
    min_agreement: float = 0.99

    def __post_init__(self) -> None:
        for key in ("epochs", "batch_size", "calib_batch_size"):
            _check(getattr(self, key) >= 1, f"quantize_qat.{key}", getattr(self, key), "an integer >= 1")
        _check(0 < self.lr < 10, "quantize_qat.lr", self.lr, "a number in (0, 10), e.g. 1e-4")
        for key in ("freeze_bn_after", "freeze_observers_after"):
            value = getattr(self, key)
            _check(value is None or value >= 0, f"quantize_qat.{key}", value,
                   "a number of optimizer steps >= 0, or null")
        _check(self.max_abs_diff > 0, "quantize_qat.max_abs_diff", self.max_abs_diff, "a number > 0")
        _check(0 < self.min_agreement <= 1, "quantize_qat.min_agreement", self.min_agreement,
               "a share in (0, 1], e.g. 0.99")


@dataclass(frozen=True)
class RuntimeParams:
    # The level you deploy with: QDQ pairs fuse into QLinear kernels only at EXTENDED or above.
    graph_optimization_level: GraphOptimizationLevel = GraphOptimizationLevel.ORT_ENABLE_ALL


@dataclass(frozen=True)
class BatchTolerance:
    """Max |batched - single-sample| logit difference allowed per variant (logit units)."""
    fp32: float = 1e-3
    static: float = 1e-3
    qat: float = 1e-3
    # Dynamic quantization picks activation scales per batch, so each row depends on its
    # batch-mates by about one quantization step (~0.05 logits here).
    dynamic: float = 0.25

    def __post_init__(self) -> None:
        for key in ("fp32", "static", "dynamic", "qat"):
            _check(getattr(self, key) > 0, f"evaluate.batch_consistency_atol.{key}",
                   getattr(self, key), "a number > 0")


@dataclass(frozen=True)
class EvaluateParams:
    batch_size: int = 256
    batch_consistency_atol: BatchTolerance = field(default_factory=BatchTolerance)

    def __post_init__(self) -> None:
        _check(self.batch_size >= 1, "evaluate.batch_size", self.batch_size, "an integer >= 1")


# bench.threads' word for "every physical core of the machine that measures".
ALL_CORES = "all"
# Inference engines bench.runtimes may name (quantpipe.runtimes) and how reports spell them;
# the first is the reference.
RUNTIMES = {"onnxruntime": "ONNX Runtime", "openvino": "OpenVINO"}


@dataclass(frozen=True)
class BenchParams:
    batch_sizes: tuple[int, ...] = (1, 64)
    # Intra-op threads per ORT session: counts, or "all" (the physical cores recorded in
    # metrics/machine.json). The first entry is the headline (summary latency_p50_ms/speedup):
    # all cores, ORT's default and what people deploy with; 1 thread shows the per-core gain.
    threads: tuple[int | str, ...] = (ALL_CORES, 1)
    warmup: int = 10
    # Timed runs per (variant, batch size, threads), split into interleaved rounds; in
    # throughput mode, batches per configuration and round = runs // rounds.
    runs: int = 300
    rounds: int = 6
    # Engines that run every variant's ONNX file. onnxruntime is the reference (the summary's
    # latency/speedup keys and every parity check are its); the others are timed beside it in
    # the same rounds, and the summary's `best` picks the fastest engine that passed parity.
    runtimes: tuple[str, ...] = tuple(RUNTIMES)
    # Top-1 agreement with ONNX Runtime on the test split below which another engine's outputs
    # are not trusted: its rows are marked failed and left out of `best`. Two engines' kernels
    # round differently; 99.5% leaves room for a few borderline samples, not for a wrong op.
    min_runtime_agreement: float = 0.995

    def __post_init__(self) -> None:
        _check(bool(self.batch_sizes) and all(b >= 1 for b in self.batch_sizes),
               "bench.batch_sizes", list(self.batch_sizes), "a non-empty list of integers >= 1")
        _check(bool(self.threads) and all(t == ALL_CORES or (isinstance(t, int) and t >= 1)
                                          for t in self.threads),
               "bench.threads", list(self.threads),
               f"a non-empty list of integers >= 1 or {ALL_CORES!r} (every physical core)")
        _check(self.warmup >= 0, "bench.warmup", self.warmup, "an integer >= 0")
        _check(self.rounds >= 1, "bench.rounds", self.rounds, "an integer >= 1")
        _check(self.runs >= self.rounds, "bench.runs", self.runs, f"an integer >= bench.rounds ({self.rounds})")
        reference = next(iter(RUNTIMES))
        _check(reference in self.runtimes and set(self.runtimes) <= set(RUNTIMES)
               and len(set(self.runtimes)) == len(self.runtimes), "bench.runtimes",
               list(self.runtimes), f"a list of distinct names from {list(RUNTIMES)} that "
               f"includes {reference} (the reference)")
        _check(0 <= self.min_runtime_agreement <= 1, "bench.min_runtime_agreement",
               self.min_runtime_agreement, "a number in [0, 1]")


@dataclass(frozen=True)
class GatesParams:
    max_accuracy_drop_pp: float = 1.0
    min_static_speedup: float = 1.0
    # Peak RSS (MiB) of a fresh process running any variant at any benchmarked batch size: the
    # device's memory limit. null: no limit.
    max_peak_rss_mb: float | None = None
    # false: a missed gate is a warning in report, not a failure.
    enforce: bool = True

    def __post_init__(self) -> None:
        _check(self.max_accuracy_drop_pp >= 0, "gates.max_accuracy_drop_pp",
               self.max_accuracy_drop_pp, "a number >= 0")
        _check(self.min_static_speedup >= 0, "gates.min_static_speedup",
               self.min_static_speedup, "a number >= 0")
        _check(self.max_peak_rss_mb is None or self.max_peak_rss_mb > 0, "gates.max_peak_rss_mb",
               self.max_peak_rss_mb, "a number > 0 (MiB) or null")


@dataclass(frozen=True)
class Params:
    seed: int = 0
    prepare: PrepareParams = field(default_factory=PrepareParams)
    train: TrainParams = field(default_factory=TrainParams)
    export: ExportParams = field(default_factory=ExportParams)
    simplify: SimplifyParams = field(default_factory=SimplifyParams)
    quantize_dynamic: QuantizeDynamicParams = field(default_factory=QuantizeDynamicParams)
    quantize_static: QuantizeStaticParams = field(default_factory=QuantizeStaticParams)
    quantize_qat: QuantizeQATParams = field(default_factory=QuantizeQATParams)
    runtime: RuntimeParams = field(default_factory=RuntimeParams)
    evaluate: EvaluateParams = field(default_factory=EvaluateParams)
    bench: BenchParams = field(default_factory=BenchParams)
    gates: GatesParams = field(default_factory=GatesParams)

    def __post_init__(self) -> None:
        _check(0 <= self.seed < 2**32, "seed", self.seed, "an integer in 0..2**32-1")


def load_params(path: Path = PARAMS_FILE) -> Params:
    """Read and validate params.yaml; raise UserError naming the first bad key."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: not found; run from the project root") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    return parse_params(raw or {}, source=str(path))


def parse_params(raw: dict, source: str = "params") -> Params:
    """Build Params from a plain mapping (the parsed YAML)."""
    try:
        return _build(Params, raw, prefix="")
    except UserError as e:
        raise UserError(f"{source}: {e}") from None


def _build(cls: type, raw: object, prefix: str):
    if not isinstance(raw, dict):
        raise UserError(f"{prefix.rstrip('.') or 'top level'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise UserError(f"unknown key {prefix}{unknown[0]}; allowed keys: {', '.join(fields)}")
    values = {name: _convert(hints[name], raw[name], prefix + name)
              for name in fields if name in raw}
    return cls(**values)


def _convert(hint, value, key: str):
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, prefix=key + ".")
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(inner[0], value, key)
        for option in inner:  # e.g. int | str: the first type the value is
            if isinstance(value, option) and not (option is int and isinstance(value, bool)):
                return value
        names = " or ".join(getattr(a, "__name__", str(a)) for a in inner)
        raise UserError(f"{key} = {value!r}: expected {names}")
    if isinstance(hint, type) and hasattr(hint, "__members__"):  # Python and pybind11 enums
        names = list(hint.__members__)
        if not isinstance(value, str) or value not in names:
            raise UserError(f"{key} = {value!r} is not allowed; use one of {names}")
        return hint.__members__[value]
    if origin is tuple:
        if not isinstance(value, list):
            raise UserError(f"{key} = {value!r}: expected a list")
        return tuple(_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"{key} = {value!r}: expected a mapping")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise UserError(f"{key} = {value!r}: expected true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{key} = {value!r}: expected an integer")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{key} = {value!r}: expected a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise UserError(f"{key} = {value!r}: expected a string")
        return value
    raise TypeError(f"unsupported params type {hint!r} for {key}")


def _check(ok: bool, key: str, value: object, allowed: str) -> None:
    if not ok:
        raise UserError(f"{key} = {value!r} is not allowed; use {allowed}")
