"""Every classification family of torchvision.models through the pipeline's own steps, one small
member each at (about) the smallest image it takes: build for 1-channel images, a few training
steps, ONNX export with parity, ONNX Runtime dynamic and static quantization, QAT's prepare and
export (or its one-line reason to skip), and OpenVINO reading the files.

Marked `slow` (several minutes on 2 cores): `make test` leaves them out, `make test-all` (and
CI, after `make test`) runs them.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch
from helpers import OPSET, info_for, structured_images

from quantpipe import criterion, data, models, onnxutil
from quantpipe.engines import dynamic, ort_static, qat
from quantpipe.runtimes import base, registry
from quantpipe.schemas.quantize_dynamic import QuantizeDynamicParams
from quantpipe.schemas.quantize_static import QuantizeStaticParams

LEVEL = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
# torch.ao's FX notices (fixed-qparams ops such as Sigmoid keep their own ranges) on every model.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# (family, smallest member, image size): the size is at or just above the smallest it accepts.
FAMILIES = [
    ("AlexNet", "alexnet", 63),
    ("ResNet", "resnet18", 16),
    ("ResNeXt", "resnext50_32x4d", 16),
    ("Wide ResNet", "wide_resnet50_2", 16),
    ("VGG", "vgg11", 32),
    ("DenseNet", "densenet121", 32),
    ("SqueezeNet", "squeezenet1_1", 24),
    ("ShuffleNet", "shufflenet_v2_x0_5", 16),
    ("MobileNet v2", "mobilenet_v2", 16),
    ("MobileNet v3", "mobilenet_v3_small", 16),
    ("MNASNet", "mnasnet0_5", 16),
    ("EfficientNet", "efficientnet_b0", 16),
    ("EfficientNet v2", "efficientnet_v2_s", 16),
    ("RegNet", "regnet_y_400mf", 16),
    ("ConvNeXt", "convnext_tiny", 32),
    ("GoogLeNet", "googlenet", 16),
    ("Inception v3", "inception_v3", 75),
    ("ViT", "vit_b_32", 32),
    ("Swin", "swin_t", 32),
    ("Swin v2", "swin_v2_t", 32),
    ("MaxViT", "maxvit_t", 32),
]


def _family(name: str) -> str:
    return name.split("_")[0].rstrip("0123456789")  # resnet18 -> resnet, wide_resnet50_2 -> wide


def test_the_families_cover_every_torchvision_classifier():
    """A family torchvision adds shows up here first."""
    covered = {_family(name) for _, name, _ in FAMILIES}
    assert {_family(name) for name in models.torchvision_names()} <= covered


@pytest.mark.slow
@pytest.mark.parametrize("family, name, size", FAMILIES, ids=[f[1] for f in FAMILIES])
def test_family_end_to_end(family, name, size, tmp_path):
    split = structured_images(48, size=size)
    info = info_for(split)
    x = data.normalize(split.x, info)
    torch.manual_seed(0)
    model = models.build_model(name, 1, size, info.num_classes)
    models.train_model(model, x[:32], split.y[:32], x[32:], split.y[32:], epochs=1, batch_size=8,
                       lr=1e-4, max_shift=1, seed=0, progress=False)
    expected = models.predict_torch(model, x)

    fp32 = tmp_path / "fp32.onnx"
    fp32.write_bytes(onnxutil.export_onnx(model, info.input_shape, OPSET).SerializeToString())
    got = onnxutil.run_batched(onnxutil.make_session(fp32, level=LEVEL), x)
    # The export stage's check: untrained BatchNorm can make logits large.
    assert onnxutil.max_abs_diff(got, expected) <= onnxutil.parity_limit(expected, 1e-4), family

    dynamic_path = tmp_path / "dynamic.onnx"
    dynamic.quantize_dynamic_model(fp32, dynamic_path, QuantizeDynamicParams())
    static = tmp_path / "static.onnx"
    ort_static.quantize_static_with_fallback(
        fp32, static, split.x[:16], info, QuantizeStaticParams(max_fallback_steps=0),
        lambda path: criterion.Judged({"real_drop": False, "verdict": "not judged here"},
                                      np.zeros(1)))
    for path in (dynamic_path, static):
        out = onnxutil.run_batched(onnxutil.make_session(path, level=LEVEL), x)
        assert out.shape == expected.shape and np.isfinite(out).all(), (family, path.name)

    # QAT: exported as QDQ, or a one-line reason the stage records as its skip.
    torch.manual_seed(0)
    trained = models.build_model(name, 1, size, info.num_classes)
    trained.load_state_dict(model.state_dict())
    qat.without_train_only_modules(trained)
    try:
        qmodel = qat.prepare(trained, info.input_shape, True, name)
        qat.calibrate(qmodel, x[:16], batch_size=8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            proto = qat.export_qdq(qat.fold_batch_norms(qmodel.eval()), info.input_shape, OPSET, name)
        out = onnxutil.run_batched(onnxutil.make_session(proto.SerializeToString(), level=LEVEL), x)
        assert np.isfinite(out).all(), family
    except qat.Unsupported as e:
        assert "\n" not in str(e) and f"train.model = {name!r}" in str(e)

    # The other engine reads the same files (or says in one line why not).
    runtimes = registry.select(registry.RUNTIMES.names(), level=LEVEL)
    for path in (fp32, dynamic_path, static):
        checks = base.check(runtimes, runtimes[registry.REFERENCE], path, x, split.y, threads=1,
                            batch_size=16, min_agreement=0.0)
        ov = checks["openvino"]
        assert ov.runs or "OpenVINO cannot" in ov.failed, (family, path.name, ov.failed)
