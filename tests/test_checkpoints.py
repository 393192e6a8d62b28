"""train.weights: a checkpoint the user brings, loaded safely, every misfit in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantpipe import models
from quantpipe.errors import UserError
from quantpipe.schemas.train import TrainParams

NAME, CHANNELS, SIZE, CLASSES = "resnet18", 3, 32, 10


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return models.build_model(NAME, CHANNELS, SIZE, CLASSES)


def _load(path: Path, num_classes: int = CLASSES) -> torch.nn.Module:
    torch.manual_seed(1)  # another initialisation: what is equal afterwards came from the file
    return models.load_checkpoint(models.build_model(NAME, CHANNELS, SIZE, num_classes), path,
                                  NAME, num_classes)


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("wrap", ["plain", "state_dict", "model", "model_state_dict",
                                  "module_prefix"])
def test_checkpoint_layouts_load_the_same_weights(tmp_path, wrap):
    source = _model()
    state = source.state_dict()
    saved = {"plain": state, "module_prefix": {f"module.{k}": v for k, v in state.items()}}.get(
        wrap, {wrap: state, "epoch": 7, "optimizer": {"lr": torch.tensor(0.1)}})
    path = tmp_path / "ckpt.pth"
    torch.save(saved, path)
    _assert_same_weights(_load(path), source)


def test_detector_checkpoint_without_the_wrapper_prefix(tmp_path):
    """A torchvision SSDLite state_dict (keys backbone.*, head.*) fits quantpipe's wrapper,
    which holds the torchvision model as `det`."""
    torch.manual_seed(0)
    source = models.build_model("ssdlite320_mobilenet_v3_large", 3, 64, 3)
    path = tmp_path / "ssd.pth"
    torch.save(source.det.state_dict(), path)
    torch.manual_seed(1)
    target = models.load_checkpoint(models.build_model("ssdlite320_mobilenet_v3_large", 3, 64, 3),
                                    path, "ssdlite320_mobilenet_v3_large", 3)
    _assert_same_weights(target, source)


def _one_line(info: pytest.ExceptionInfo, path: Path, *needles: str) -> str:
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message
    for needle in needles:
        assert needle in message, message
    return message


def _without_layer2_conv(state: dict) -> None:
    del state["layer2.0.conv1.weight"]


def _with_a_projector(state: dict) -> None:
    state["projector.weight"] = torch.zeros(4, 4)


@pytest.mark.parametrize("change, needles", [
    (_without_layer2_conv, ("layer2.0.conv1.weight", "missing")),
    (_with_a_projector, ("projector.weight", "unexpected"))])
def test_missing_or_unexpected_layer(tmp_path, change, needles):
    state = _model().state_dict()
    change(state)
    path = tmp_path / "changed.pth"
    torch.save(state, path)
    with pytest.raises(UserError) as info:
        _load(path)
    _one_line(info, path, *needles)


def test_shape_mismatch_names_both_shapes(tmp_path):
    state = _model().state_dict()
    state["layer1.0.conv2.weight"] = torch.zeros(64, 64, 1, 1)
    path = tmp_path / "shape.pth"
    torch.save(state, path)
    with pytest.raises(UserError) as info:
        _load(path)
    _one_line(info, path, "layer1.0.conv2.weight", "(64, 64, 1, 1)", "(64, 64, 3, 3)")


def test_class_count_mismatch(tmp_path):
    """An ImageNet checkpoint (1,000 classes) on a 10-class dataset."""
    path = tmp_path / "imagenet.pth"
    torch.save(_model().state_dict(), path)
    with pytest.raises(UserError) as info:
        _load(path, num_classes=4)
    _one_line(info, path, "fc.weight", "10 classes", "the data has 4")


@pytest.mark.parametrize("content", [[1, 2, 3], {"epoch": 3, "note": "no weights"},
                                     torch.zeros(3), {}])
def test_not_a_state_dict(tmp_path, content):
    path = tmp_path / "other.pth"
    torch.save(content, path)
    with pytest.raises(UserError) as info:
        _load(path)
    _one_line(info, path, "not a state_dict")


def test_whole_module_pickle_is_refused_by_weights_only(tmp_path):
    path = tmp_path / "whole.pth"
    torch.save(_model(), path)  # the nn.Module itself: unpickling it would import and run code
    with pytest.raises(UserError) as info:
        _load(path)
    _one_line(info, path, "weights_only", "torchvision.models.resnet.ResNet", "state_dict()")


def test_not_a_torch_file(tmp_path):
    path = tmp_path / "notes.pth"
    path.write_text("not a checkpoint")
    with pytest.raises(UserError) as info:
        _load(path)
    _one_line(info, path, "torch.save")


def test_weights_must_live_under_inputs(tmp_path):
    with pytest.raises(UserError, match="under inputs/"):
        models.weights_source(str(tmp_path / "w.pth"), NAME)
    with pytest.raises(UserError, match="not found"):
        models.weights_source("inputs/absent.pth", NAME)
    with pytest.raises(UserError, match="carries its own weights"):
        models.weights_source("inputs/w.pth", "onnx:inputs/model.onnx")


def test_epochs_zero_needs_weights():
    with pytest.raises(UserError, match="train.epochs = 0"):
        TrainParams(epochs=0)
    assert TrainParams(weights="inputs/w.pth", epochs=0).epochs == 0
