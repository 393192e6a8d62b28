"""Quantization-aware training: fake quantization in the scheme the static variant runs on x86.

The route (measured with torch 2.14; docs/qat.md): FX `prepare_qat_fx` with fake-quant ranges
(0, 255) for activations (U8, asymmetric) and (-128, 127) for weights (S8, symmetric, per
output channel), the same types ORT's static quantization writes; observers start from the
calibration set's min/max (ORT's MinMax); a short fine-tune at a low learning rate; BatchNorm
folded into its convolution, then the TorchScript exporter (`dynamo=False`), which writes each
fake-quant as a QuantizeLinear/DequantizeLinear pair that ONNX Runtime fuses into
QLinearConv/QGemm once the graph is written as quantize_static writes QDQ (`as_ort_qdq`).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch import nn

from quantpipe import models
from quantpipe.errors import UserError
from quantpipe.onnxutil import INPUT_NAME, OUTPUT_NAME


# S8 weight ranges: the exporter's (the only signed one it writes), and reduce_range's 7 bits,
# which ONNX Runtime's U8S8 kernels cannot overflow on x86 without VNNI (isa.int8_saturates).
WEIGHT_RANGE = (-128, 127)
WEIGHT_RANGE_7BIT = (-64, 63)


def qconfig_mapping(per_channel: bool, reduce_range: bool = False):
    """U8 asymmetric activations, S8 symmetric weights (per output channel or per tensor).

    Moving-average observers, as torch's own QAT defaults: the ranges follow the activations
    and weights while they train, without one outlier batch widening them for good.
    (-127, 127), ORT's symmetric weight range, is refused by the exporter; (-128, 127) with
    scale max|w| / 127.5 is what it accepts. reduce_range: 7-bit weights, (-64, 63), trained as
    such and widened for the exporter (widen_weight_ranges).
    """
    from torch.ao.quantization import (FakeQuantize, MovingAverageMinMaxObserver,
                                       MovingAveragePerChannelMinMaxObserver, QConfig,
                                       QConfigMapping)

    activation = FakeQuantize.with_args(
        observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255, dtype=torch.quint8,
        qscheme=torch.per_tensor_affine, reduce_range=False)
    low, high = WEIGHT_RANGE_7BIT if reduce_range else WEIGHT_RANGE
    if per_channel:
        weight = FakeQuantize.with_args(
            observer=MovingAveragePerChannelMinMaxObserver, quant_min=low, quant_max=high,
            dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0)
    else:
        weight = FakeQuantize.with_args(
            observer=MovingAverageMinMaxObserver, quant_min=low, quant_max=high,
            dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    return QConfigMapping().set_global(QConfig(activation=activation, weight=weight))


# ReLU6 (MobileNetV2's activation) has no Conv fusion in torch's native backend config: FX would
# fake-quantize the Conv output, then ReLU6 with the same range, which ORT runs as
# Conv -> Q -> DQ -> Clip -> Q, outside QLinearConv. Fused like Conv+BN+ReLU, the only range is
# the one after ReLU6 (within [0, 6]), so ORT drops the Clip and fuses QLinearConv: the scheme
# ORT's quantize_static writes for the same FP32 graph.
class ConvReLU6(torch.ao.nn.intrinsic._FusedModule):
    def __init__(self, conv: nn.Conv2d, relu: nn.ReLU6) -> None:
        super().__init__(conv, relu)


class ConvBnReLU6(torch.ao.nn.intrinsic._FusedModule):
    def __init__(self, conv: nn.Conv2d, bn: nn.BatchNorm2d, relu: nn.ReLU6) -> None:
        super().__init__(conv, bn, relu)


class QATConvReLU6(torch.ao.nn.qat.Conv2d, torch.ao.nn.intrinsic._FusedModule):
    _FLOAT_MODULE = ConvReLU6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu6(self._conv_forward(x, self.weight_fake_quant(self.weight), self.bias))


class QATConvBnReLU6(torch.ao.nn.intrinsic.qat.ConvBn2d):
    _FLOAT_MODULE = ConvBnReLU6
    _FLOAT_RELU_MODULE = nn.ReLU6
    _FUSED_FLOAT_MODULE = ConvReLU6  # what to_float() folds it into

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu6(self._forward(x))


# Average pooling: torch's native config has its output share the input's fake-quant, i.e.
# requantize the mean onto the input's own grid. A mean of n codes on that grid is k/n steps,
# so with an even n it lands exactly halfway between two steps for a large share of values
# (1 in 4 for a 2x2 map): there the rounding is decided by float noise, x * (1/scale) in
# torch against x / scale and another summation order in ORT, and the two disagree on a tenth
# to a third of those ties. A Squeeze-Excitation block's pooled vector gates whole channels, so
# each flip moves a whole channel (EfficientNet at 32 px: 2x2 maps in stages 4-5, 2-8% of
# pooled values one step apart, agreement 95%). With a range of its own (what ORT's
# quantize_static gives GlobalAveragePool), mean / scale is no longer a multiple of 1/n steps
# and the exported graph rounds as torch does; ORT still fuses it (QLinearGlobalAveragePool,
# QLinearAveragePool).
AVERAGING_OPS = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
                 nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, torch.adaptive_avg_pool1d,
                 F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, torch.avg_pool1d,
                 torch._C._nn.avg_pool2d, torch._C._nn.avg_pool3d, torch.mean, "mean")


def backend_config():
    """torch's native backend config plus Conv2d(+BatchNorm2d)+ReLU6 fusion, with average
    pooling observed on its own output (AVERAGING_OPS)."""
    from torch.ao.quantization.backend_config import (BackendPatternConfig, ObservationType,
                                                      get_native_backend_config)
    from torch.ao.quantization.backend_config.native import weighted_op_quint8_dtype_config

    config = get_native_backend_config()
    existing = {c.pattern: c for c in config.configs}
    for op in AVERAGING_OPS:
        config.set_backend_pattern_config(
            BackendPatternConfig(op).set_dtype_configs(existing[op].dtype_configs)
            .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT))
    dtypes = [weighted_op_quint8_dtype_config]
    for pattern, fused, qat_module in (
            ((nn.Conv2d, nn.ReLU6), ConvReLU6, QATConvReLU6),
            ((nn.Conv2d, nn.BatchNorm2d, nn.ReLU6), ConvBnReLU6, QATConvBnReLU6)):
        config.set_backend_pattern_config(
            BackendPatternConfig(pattern).set_dtype_configs(dtypes)
            .set_fuser_method(lambda is_qat, *modules, fused=fused: fused(*modules))
            .set_fused_module(fused))
        config.set_backend_pattern_config(
            BackendPatternConfig(fused).set_dtype_configs(dtypes).set_qat_module(qat_module))
        config.set_backend_pattern_config(
            BackendPatternConfig(qat_module).set_dtype_configs(dtypes)
            .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
            .set_root_module(nn.Conv2d)
            .set_reference_quantized_module(torch.ao.nn.quantized.reference.Conv2d))
    return config


class Unsupported(UserError):
    """QAT cannot handle this model (tracing or exporting it); the stage skips QAT, saying why,
    and the other variants go on."""


class _Skip(nn.Module):
    """Stands in for a module that is the identity at inference. Not a torch.nn class, so the
    FX tracer traces through it and the module leaves no node behind."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def without_train_only_modules(model: nn.Module) -> int:
    """Replace dropout and stochastic depth with nothing; returns how many were replaced.

    Traced in training mode they would stay in the graph for good (stochastic depth's
    `training` flag becomes a constant), and dropout's output would get a fake-quant range of
    its own, stretched by training's 1 / (1 - p) rescaling: a requantization at run time that
    the static model does not have. The fine-tune is short and at a low learning rate; it
    does without them.
    """
    from torchvision.ops import StochasticDepth

    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (nn.modules.dropout._DropoutNd, StochasticDepth)):
                setattr(parent, name, _Skip())
                replaced += 1
    # GoogLeNet's/Inception's auxiliary classifiers: traced in training mode they would stay
    # in the exported graph (and return a tuple); they only ever helped training.
    if getattr(model, "aux_logits", False):
        model.aux_logits = False
        for head in ("aux1", "aux2", "AuxLogits"):
            if getattr(model, head, None) is not None:
                setattr(model, head, None)
                replaced += 1
    return replaced


def prepare(model: nn.Module, input_shape: tuple[int, ...], per_channel: bool,
            name: str, reduce_range: bool = False) -> torch.fx.GraphModule:
    """The model with fake quantization inserted (Conv+BN(+ReLU) fused into QAT modules);
    7-bit weights with reduce_range."""
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    model.train()
    example = (torch.zeros((1, *input_shape)),)
    try:
        with warnings.catch_warnings():
            # torch.ao's deprecation notice (FX quantization is in maintenance in favour of
            # torchao's pt2e, whose models the ONNX exporter does not yet write as QDQ).
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.filterwarnings("ignore", message=".*torch.ao.quantization.*deprecated")
            return prepare_qat_fx(model, qconfig_mapping(per_channel, reduce_range), example,
                                  backend_config=backend_config())
    except Exception as e:  # symbolic tracing fails on data-dependent control flow
        raise Unsupported(f"train.model = {name!r}: torch.fx cannot trace it for quantization-aware "
                          f"training ({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None


class _Raw(nn.Module):
    """A detector's learned part, `raw(x)`, as a module of its own for torch.fx to trace."""

    def __init__(self, detector: nn.Module) -> None:
        super().__init__()
        self.detector = detector

    def forward(self, x: torch.Tensor):
        return self.detector.raw(x)


class FloatDecode(nn.Module):
    """A detector whose learned layers (`raw`, torch.fx-prepared with fake quantization) feed
    its decode in float: box decoding and the score activations stay out of quantization, as
    quantize_static leaves them by default (detect.float_decode; docs/detection.md). The
    float detector lends its `decode` and `raw_loss`; its weights are the body's."""

    def __init__(self, body: torch.fx.GraphModule, detector: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.__dict__["detector"] = detector  # not a submodule: nothing of it trains or exports twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.detector.decode(self.body(x))

    def loss(self, x: torch.Tensor, objects: list[np.ndarray]) -> torch.Tensor:
        return self.detector.raw_loss(self.body(x), objects)


def prepare_detector(detector: nn.Module, input_shape: tuple[int, ...], per_channel: bool,
                     name: str, reduce_range: bool = False) -> FloatDecode:
    """`prepare` for a quantpipe detector (quantpipe.detection.model.Detector): fake
    quantization in its learned layers, its decode in float."""
    reason = getattr(detector, "qat_unsupported", None)
    if reason:
        raise Unsupported(f"train.model = {name!r}: {reason}")
    return FloatDecode(prepare(_Raw(detector), input_shape, per_channel, name, reduce_range),
                       detector)


def prepare_model(model: nn.Module, input_shape: tuple[int, ...], per_channel: bool,
                  name: str, reduce_range: bool = False) -> nn.Module:
    """`prepare` for any model: a detector (one with a float `decode` after its learned layers
    and a `raw_loss`) gets fake quantization in its learned layers only (prepare_detector)."""
    if hasattr(model, "raw_loss") and hasattr(model, "decode"):
        return prepare_detector(model, input_shape, per_channel, name, reduce_range)
    return prepare(model, input_shape, per_channel, name, reduce_range)


def body_of(qmodel: nn.Module) -> nn.Module:
    """The fake-quantized graph of a prepare_model result."""
    return qmodel.body if isinstance(qmodel, FloatDecode) else qmodel


def scope_of(qmodel: nn.Module) -> str:
    """Where body_of(qmodel)'s nodes sit in the exported graph's names."""
    return "body/" if isinstance(qmodel, FloatDecode) else ""


def fake_quants(model: nn.Module) -> list[nn.Module]:
    from torch.ao.quantization import FakeQuantizeBase

    return [m for m in model.modules() if isinstance(m, FakeQuantizeBase)]


@torch.no_grad()
def calibrate(qmodel: nn.Module, x: np.ndarray, batch_size: int) -> None:
    """Start every fake-quant range from the calibration set: min/max over all of it.

    A moving-average observer would weigh the last batches most, so each one is swapped for
    a MinMaxObserver of the same type for this pass and given back its min/max after. Weight
    observers see the weights once; that sets them exactly. The ranges are then fixed until
    `finetune` lets them follow the training batches.
    """
    from torch.ao.quantization import (MinMaxObserver, MovingAverageMinMaxObserver,
                                       disable_fake_quant, disable_observer, enable_fake_quant,
                                       enable_observer)

    swapped = []
    for fq in fake_quants(qmodel):
        observer = fq.activation_post_process
        if isinstance(observer, MovingAverageMinMaxObserver):
            fq.activation_post_process = MinMaxObserver(
                dtype=observer.dtype, qscheme=observer.qscheme, quant_min=observer.quant_min,
                quant_max=observer.quant_max)
            swapped.append((fq, observer))
    was_training = qmodel.training
    qmodel.eval()  # BatchNorm's running statistics stay those of the trained model
    qmodel.apply(enable_observer)
    qmodel.apply(disable_fake_quant)
    try:
        for i in range(0, len(x), batch_size):
            qmodel(torch.from_numpy(x[i:i + batch_size]))
    except Exception as e:  # the traced graph kept a check the data fails (ViT's image size)
        raise UserError(f"the model prepared for quantization-aware training fails on the "
                        f"calibration data ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                        "set quantize_qat.enabled: false") from None
    for fq, observer in swapped:
        seen = fq.activation_post_process
        observer.min_val, observer.max_val = seen.min_val, seen.max_val
        fq.activation_post_process = observer
        scale, zero_point = observer.calculate_qparams()
        fq.scale.resize_(scale.shape).copy_(scale)
        fq.zero_point.resize_(zero_point.shape).copy_(zero_point)
    qmodel.apply(enable_fake_quant)
    qmodel.apply(disable_observer)  # until training: an evaluation pass must not move them
    qmodel.train(was_training)


def finetune(qmodel: nn.Module, train_x: np.ndarray, train_y: np.ndarray, val_x: np.ndarray,
             val_y: np.ndarray, *, epochs: int, batch_size: int, lr: float, max_shift: int,
             seed: int, freeze_bn_after: int | None, freeze_observers_after: int | None,
             progress: bool = True) -> tuple[list, int]:
    """A classifier trained with fake quantization (models.train_model, `fit_with_fake_quant`);
    returns its per-epoch stats and the number of optimizer steps."""
    return fit_with_fake_quant(
        qmodel, lambda on_step: models.train_model(
            qmodel, train_x, train_y, val_x, val_y, epochs=epochs, batch_size=batch_size, lr=lr,
            max_shift=max_shift, seed=seed, progress=progress, on_step=on_step),
        freeze_bn_after=freeze_bn_after, freeze_observers_after=freeze_observers_after)


def fit_with_fake_quant(qmodel: nn.Module, fit: Callable[[Callable[[nn.Module, int], None]], list],
                        *, freeze_bn_after: int | None,
                        freeze_observers_after: int | None) -> tuple[list, int]:
    """Run a training loop, fit(on_step) (on_step(model, step) after each optimizer step), on a
    model holding the fake-quants of `qmodel`; returns fit's history and the steps taken.

    The fake-quant ranges follow the training batches only (the per-epoch validation pass
    leaves them be) until `freeze_observers_after` optimizer steps; BatchNorm normalizes with
    batch statistics until `freeze_bn_after` steps, then with its running statistics, as at
    inference. Ranges are frozen at the end either way.
    """
    from torch.ao.quantization import disable_observer

    quantizers = fake_quants(qmodel)
    observing, steps = [True], [0]

    def observe_in_training_only(module: nn.Module, args: tuple) -> None:
        for fq in quantizers:
            fq.observer_enabled.fill_(int(module.training and observing[0]))

    def on_step(model: nn.Module, step: int) -> None:
        steps[0] = step
        if step == freeze_bn_after:
            freeze_batch_norms(qmodel)
        if step == freeze_observers_after:
            observing[0] = False

    on_step(qmodel, 0)  # a limit of 0 steps: frozen from the start
    hook = qmodel.register_forward_pre_hook(observe_in_training_only)
    try:
        history = fit(on_step)
    finally:
        hook.remove()
        qmodel.apply(disable_observer)
        freeze_batch_norms(qmodel)
    return history, steps[0]


def freeze_batch_norms(qmodel: nn.Module) -> None:
    """Every Conv+BN QAT module normalizes with its running statistics from now on (torch's
    `freeze_bn_stats` skips subclasses such as QATConvBnReLU6)."""
    from torch.ao.nn.intrinsic.qat.modules.conv_fused import _ConvBnNd

    for module in qmodel.modules():
        if isinstance(module, _ConvBnNd):
            module.freeze_bn_stats()


def fold_batch_norms(qmodel: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Each QAT Conv+BN(+ReLU) becomes a QAT Conv(+ReLU) with the BN folded into its weights
    and bias, keeping its trained weight fake-quant, as inference runs it.

    In eval mode the QAT module computes conv(x, fq(w * g/s)) / (g/s) + b, then BN; with
    g/s folded into w that is conv(x, fq(w_folded)) + b_folded: the same function up to float
    rounding, but a plain DequantizeLinear -> Conv that ORT fuses into QLinearConv (unfolded,
    the export keeps Div and BatchNormalization between Conv and its QuantizeLinear).
    """
    from torch.ao.nn.intrinsic.qat.modules.conv_fused import _ConvBnNd
    from torch.ao.quantization.quantization_mappings import get_default_qat_module_mappings

    qat_class = {**get_default_qat_module_mappings(), ConvReLU6: QATConvReLU6}
    for name, module in list(qmodel.named_modules()):
        if not isinstance(module, _ConvBnNd):
            continue
        folded = module.to_float()  # nn.ConvNd or nni.ConvReLUNd, BN folded with running stats
        for part in folded.modules():  # from_float reads it from the conv inside a fused pair
            part.qconfig = module.qconfig
        replacement = qat_class[type(folded)].from_float(folded)
        replacement.weight_fake_quant = module.weight_fake_quant  # the trained weight range
        replacement.train(False)
        parent_name, _, child = name.rpartition(".")
        setattr(qmodel.get_submodule(parent_name) if parent_name else qmodel, child, replacement)
    return qmodel


def widen_weight_ranges(qmodel: nn.Module) -> int:
    """Each 7-bit weight fake-quant as the exporter takes it, the same function: its range
    widened to WEIGHT_RANGE with the same scales, its weights clamped to the ends of the 7-bit
    grid first, so every weight rounds to the integer it trained on (the exporter writes
    (-128, 127) ranges only). Returns how many were widened."""
    widened = 0
    for module in qmodel.modules():
        fq = getattr(module, "weight_fake_quant", None)
        if fq is None or (fq.quant_min, fq.quant_max) == WEIGHT_RANGE:
            continue
        fq.disable_observer()  # the trained scales stay
        shape = [1] * module.weight.dim()
        if fq.scale.numel() > 1:
            shape[fq.ch_axis] = -1
        scale = fq.scale.detach().reshape(shape)
        with torch.no_grad():  # symmetric: zero points are 0
            module.weight.copy_(module.weight.clamp(fq.quant_min * scale, fq.quant_max * scale))
        # Its forward reads the observer's range (the module's own copy is for compatibility).
        fq.quant_min, fq.quant_max = WEIGHT_RANGE
        fq.activation_post_process.quant_min, fq.activation_post_process.quant_max = WEIGHT_RANGE
        widened += 1
    return widened


def export_qdq(qmodel: nn.Module, input_shape: tuple[int, ...], opset: int,
               name: str) -> onnx.ModelProto:
    """TorchScript export (the dynamo exporter has no fake-quant -> QDQ lowering) with a dynamic
    batch axis, then written the way ORT's quantize_static writes QDQ (`as_ort_qdq`). 7-bit
    weights go out as their integers in the exporter's range (widen_weight_ranges)."""
    qmodel.eval()
    widen_weight_ranges(qmodel)
    buffer = io.BytesIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(qmodel, (torch.zeros((1, *input_shape)),), buffer, dynamo=False,
                              opset_version=opset, input_names=[INPUT_NAME],
                              output_names=[OUTPUT_NAME],
                              dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}})
    except Exception as e:  # e.g. VGG's adaptive pooling up from a 1x1 map at small sizes
        raise Unsupported(f"train.model = {name!r}: the TorchScript exporter cannot write its "
                          f"fake-quant model as QDQ ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:160]})") from None
    return as_ort_qdq(onnx.load_from_string(buffer.getvalue()))


def as_ort_qdq(model: onnx.ModelProto) -> onnx.ModelProto:
    """The exported QDQ graph in the form ORT's quantize_static writes, the same function:

    - constants shared through Identity nodes are read from their initializer directly, and
      per-tensor scales and zero points are scalars (the exporter writes shape [1]): ORT's
      QDQ selectors for Add, Mul, ... take only scalar constants, so without this a residual
      Add runs in float between DequantizeLinear and QuantizeLinear;
    - weights are stored as int8 (`_store_weights_int8`): a quarter of the size.
    """
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    aliases = {n.output[0]: n.input[0] for n in graph.node
               if n.op_type == "Identity" and n.input[0] in inits}
    kept = [n for n in graph.node if not (n.op_type == "Identity" and n.output[0] in aliases)]
    for node in kept:
        for k, name in enumerate(node.input):
            node.input[k] = aliases.get(name, name)
    _replace_nodes(graph, kept)
    scalars = {}
    for node in graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) == 3:
            for k in (1, 2):
                init = inits.get(node.input[k])
                if init is not None and list(init.dims) == [1]:
                    name = f"{init.name}.scalar"
                    scalars[name] = numpy_helper.from_array(numpy_helper.to_array(init).reshape(()), name)
                    node.input[k] = name
    graph.initializer.extend(scalars.values())
    _store_weights_int8(graph)
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    live = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(live)
    return model


def _replace_nodes(graph: onnx.GraphProto, nodes: list) -> None:
    kept = list(nodes)  # copies: clearing the graph's list invalidates views into it
    del graph.node[:]
    graph.node.extend(kept)


def constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in graph.initializer}


def _store_weights_int8(graph: onnx.GraphProto) -> None:
    """Replace each float initializer -> QuantizeLinear with the int8 initializer it computes.

    The values are fake quantization's, computed as torch does (round-half-even of w * (1 /
    scale), plus the zero point, saturated), so DequantizeLinear gives back exactly the weights
    the PyTorch model ran with.
    """
    values = constants(graph)
    kept = []
    for node in graph.node:
        w, scale, zero_point = ([values.get(i) for i in node.input] + [None] * 3)[:3]
        if node.op_type != "QuantizeLinear" or any(v is None for v in (w, scale, zero_point)):
            kept.append(node)
            continue
        if scale.size > 1:  # per channel: broadcast along `axis`
            axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
            shape = [1] * w.ndim
            shape[axis] = -1
            scale, zero_point = scale.reshape(shape), zero_point.reshape(shape)
        info = np.iinfo(zero_point.dtype)
        inverse = (np.float32(1.0) / scale.astype(np.float32)).astype(np.float32)
        q = np.rint(w.astype(np.float32) * inverse) + zero_point.astype(np.int64)
        graph.initializer.append(numpy_helper.from_array(
            np.clip(q, info.min, info.max).astype(zero_point.dtype), node.output[0]))
    _replace_nodes(graph, kept)
