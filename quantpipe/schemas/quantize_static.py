"""params.yaml `quantize_static`: the static INT8 engine, its calibration, the accuracy criterion
and the fallback."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import ClassVar

from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType

from quantpipe import isa
from quantpipe.params import check
from quantpipe.tasks import default


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


# NNCF's own enums, by value (nncf.QuantizationPreset, nncf.ModelType): params are read by every
# stage and importing nncf costs ~2 s, so quantpipe.engines.nncf_ptq maps these when it runs.
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
        check(self.subset_size is None or self.subset_size >= 1, "quantize_static.nncf.subset_size",
              self.subset_size, "an integer >= 1 or null (every calibration sample)")
        check(self.smooth_quant_alpha is None or self.smooth_quant_alpha <= 1,
              "quantize_static.nncf.smooth_quant_alpha", self.smooth_quant_alpha,
              "a number in [0, 1], negative to disable, or null")


@dataclass(frozen=True)
class QuantizeStaticParams(isa.ReduceRange):
    SECTION: ClassVar[str] = "quantize_static"

    # Who quantizes models/static.onnx: a name in quantpipe.engines.registry (which checks it),
    # onnxruntime (ORT's quantize_static and the recovery ladder) or nncf (NNCF's ONNX PTQ).
    engine: str = "onnxruntime"
    # QDQ + U8 activations + S8 weights, per channel: the fast path on x86 (docs/design.md, "Defaults").
    quant_format: QuantFormat = QuantFormat.QDQ
    activation_type: QuantType = QuantType.QUInt8
    weight_type: QuantType = QuantType.QInt8
    per_channel: bool = True
    # 7-bit weights: auto (isa.reduce_range_for) on the CPU that runs the stage: true on x86
    # without VNNI, where 8-bit weights overflow ONNX Runtime's fast INT8 kernels; false elsewhere.
    # For NNCF, overflow_fix ENABLE (true) or NNCF's default (false: its first layer only).
    reduce_range: bool | str = isa.AUTO
    calibrate_method: CalibrationMethod = CalibrationMethod.MinMax
    # Samples per calibration batch (fewer where a batch would not fit resources.memory_mb);
    # Entropy/Percentile keep every batch's activations, so they use the first batches that fit.
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
    # Accuracy-aware fallback: while the drop is real (quantpipe.criterion: the task's validation
    # score drops by more than max_drop_pts points (accuracy in percentage points, mAP@[.5:.95]
    # and mIoU x 100), the flips are lopsided beyond chance at
    # `significance` by McNemar's test, and agreement with FP32 on the unlabeled pool is below
    # min_pool_agreement), the engine's fallback runs: ORT's recovery ladder
    # (quant.quantize_static_with_fallback; max_fallback_steps rounds of per-node candidates)
    # or NNCF's accuracy control (at most max_fallback_steps quantizer groups reverted).
    # null: the task's (for_task): 0.5 pp of accuracy, 0.5 points of mIoU, and 1 point of
    # mAP@[.5:.95] for a detector, the practitioners' tolerance table's "excellent" (under 1
    # point; gates.warn_map_drop_pts): a detector has no McNemar test to tell noise from loss,
    # and its validation mAP on a few hundred images moves by tenths of a point between
    # equally good candidates (0.60 to 1.29 across the ladder's, 7-bit weights on an AVX2 CPU).
    max_drop_pts: float | None = None
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
        self.check_reduce_range()
        check(self.calib_num_quantized_bins >= 2, "quantize_static.calib_num_quantized_bins",
              self.calib_num_quantized_bins, "an integer >= 2")
        check(self.calib_num_bins > self.calib_num_quantized_bins, "quantize_static.calib_num_bins",
              self.calib_num_bins, f"an integer > calib_num_quantized_bins ({self.calib_num_quantized_bins})")
        check(self.max_drop_pts is None or self.max_drop_pts >= 0, "quantize_static.max_drop_pts",
              self.max_drop_pts, "a number >= 0, or null (the task's)")
        check(0 < self.significance < 1, "quantize_static.significance", self.significance,
              "a probability in (0, 1), e.g. 0.05")
        check(0 < self.min_pool_agreement <= 1, "quantize_static.min_pool_agreement",
              self.min_pool_agreement, "a share in (0, 1], e.g. 0.995")
        check(0 <= self.agreement_floor <= self.min_pool_agreement, "quantize_static.agreement_floor",
              self.agreement_floor, f"a share in [0, min_pool_agreement = {self.min_pool_agreement}], "
              "e.g. 0.97")
        check(self.max_fallback_steps >= 0, "quantize_static.max_fallback_steps",
              self.max_fallback_steps, "an integer >= 0")
        check(self.fallback_candidates >= 1, "quantize_static.fallback_candidates",
              self.fallback_candidates, "an integer >= 1")
        check(self.calib_batch_size >= 1, "quantize_static.calib_batch_size",
              self.calib_batch_size, "an integer >= 1")
        for key in self.extra_options:
            check(key in STATIC_EXTRA_OPTIONS, f"quantize_static.extra_options.{key}",
                  self.extra_options[key], f"one of the keys {', '.join(STATIC_EXTRA_OPTIONS)}")
        percentile = self.extra_options.get("CalibPercentile")
        if percentile is not None:
            check(isinstance(percentile, (int, float)) and 0 < percentile <= 100,
                  "quantize_static.extra_options.CalibPercentile", percentile, "a number in (0, 100]")

    def for_task(self, task: str) -> "QuantizeStaticParams":
        """These params with the task's max_drop_pts where it is null (task: the prepared
        data's, quantpipe.data.DataInfo.task)."""
        if self.max_drop_pts is not None:
            return self
        return dataclasses.replace(self, max_drop_pts=default(task, "quantize_static.max_drop_pts"))
