"""quantpipe.models: the zoo, torchvision models, deterministic training, safe checkpoint loading."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import info_for, structured_images
from quantpipe import data, models
from quantpipe.errors import UserError


@pytest.fixture(autouse=True)
def _restore_torch_determinism():
    # train_model switches torch.use_deterministic_algorithms on process-wide; keep that out of
    # the other tests.
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def _forward(model: torch.nn.Module, batch: int, channels: int, size: int) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(torch.randn(batch, channels, size, size))


# --- build_model ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["simple_cnn", "mnist_net"])
@pytest.mark.parametrize("size", [12, 28])
@pytest.mark.parametrize("channels", [1, 3])
def test_zoo_models_give_logits(name, size, channels):
    torch.manual_seed(0)
    model = models.build_model(name, channels, size, num_classes=5)
    out = _forward(model, 3, channels, size)
    assert out.shape == (3, 5)
    assert torch.isfinite(out).all()


def test_zoo_model_at_odd_image_size():
    for name in models.ZOO:
        assert _forward(models.build_model(name, 1, 13, 4), 2, 1, 13).shape == (2, 4)


def test_build_model_is_reproducible_after_manual_seed():
    torch.manual_seed(1)
    a = models.state_dict_bytes(models.build_model("simple_cnn", 1, 12, 4))
    torch.manual_seed(1)
    b = models.state_dict_bytes(models.build_model("simple_cnn", 1, 12, 4))
    assert a == b


def test_resnet18_with_one_channel():
    torch.manual_seed(0)
    model = models.build_model("resnet18", 1, 32, num_classes=10)
    first_conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    assert first_conv.in_channels == 1
    assert first_conv.out_channels == 64 and first_conv.kernel_size == (7, 7)
    assert _forward(model, 2, 1, 32).shape == (2, 10)


def test_mobilenet_v3_small_with_three_channels():
    torch.manual_seed(0)
    model = models.build_model("mobilenet_v3_small", 3, 32, num_classes=7)
    assert _forward(model, 2, 3, 32).shape == (2, 7)


# --- input constraints: one line naming the constraint and the nearest valid image size ------

@pytest.mark.parametrize("name, channels, size, message", [
    ("vit_b_16", 3, 30, "train.model = vit_b_16 cuts images into 16x16 patches, so "
     "prepare.image_size must be a multiple of 16 (got 30); the nearest valid prepare.image_size is 32"),
    ("vit_b_32", 1, 8, "the nearest valid prepare.image_size is 32"),
    ("maxvit_t", 3, 40, "must be a multiple of 32 (got 40); the nearest valid prepare.image_size is 32"),
    ("alexnet", 1, 32, "train.model = alexnet needs images of at least 63 px: its pooling and "
     "strides leave nothing of 32 px; the nearest valid prepare.image_size is 63"),
    ("inception_v3", 1, 32, "needs images of at least 75 px"),
    ("squeezenet1_0", 3, 16, "needs images of at least 21 px"),
])
def test_an_image_size_a_model_cannot_take_names_the_nearest_valid_one(name, channels, size, message):
    with pytest.raises(UserError) as info:
        models.build_model(name, channels, size, num_classes=4)
    assert message in str(info.value) and "\n" not in str(info.value)
    nearest = int(str(info.value).rsplit(" ", 1)[1])
    torch.manual_seed(0)  # the printed size works
    assert _forward(models.build_model(name, channels, nearest, 4), 2, channels, nearest).shape == (2, 4)


def test_probing_the_input_size_leaves_the_model_unchanged():
    torch.manual_seed(0)
    model = models.build_model("densenet121", 1, 32, num_classes=4)  # BatchNorm throughout
    before = models.state_dict_bytes(model)
    assert models._runs_at(model, 1, 32) and not models._runs_at(model, 1, 16)
    assert models.state_dict_bytes(model) == before and model.training  # built in train mode


def test_maxvit_partitions_fit_the_image():
    from torchvision.models.maxvit import MaxVit

    for size, partition in ((32, 1), (64, 2), (96, 3), (224, 7)):
        model = models.build_model("maxvit_t", 3, size, num_classes=4)
        assert isinstance(model, MaxVit) and model.partition_size == partition
    assert _forward(model, 1, 3, 224).shape == (1, 4)


def test_auxiliary_classifiers_train_with_their_reference_weights():
    """GoogLeNet keeps its two auxiliary heads at 32 px and their losses count (0.3 each);
    Inception v3's need 299 px, so at 75 px it is built without them."""
    torch.manual_seed(0)
    googlenet = models.build_model("googlenet", 1, 32, num_classes=4)
    assert googlenet.aux_logits
    googlenet.train()
    y = torch.tensor([0, 1, 2, 3])
    out = googlenet(torch.randn(4, 1, 32, 32))
    logits, loss = models._logits_and_loss(out, y)
    ce = torch.nn.functional.cross_entropy
    expected = ce(out.logits, y) + 0.3 * (ce(out.aux_logits1, y) + ce(out.aux_logits2, y))
    assert logits is out.logits and torch.allclose(loss, expected)
    inception = models.build_model("inception_v3", 3, 75, num_classes=4)
    assert not inception.aux_logits
    assert _forward(googlenet, 2, 1, 32).shape == (2, 4)  # eval: the logits alone


@pytest.mark.parametrize("name", ["resnet19", "mnist-net", "not_a_model"])
def test_unknown_model_name_is_a_user_error(name):
    with pytest.raises(UserError) as info:
        models.build_model(name, 1, 28, 10)
    assert "train.model" in str(info.value)
    assert repr(name) in str(info.value)
    assert "mnist_net" in str(info.value)  # says what is allowed


def test_mnist_net_too_small_is_a_user_error():
    with pytest.raises(UserError, match="prepare.image_size"):
        models.build_model("mnist_net", 1, 5, 10)


# --- train_model ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_data():
    train = structured_images(64, size=12, seed=0)
    val = structured_images(16, size=12, seed=1)
    info = info_for(train)
    return data.normalize(train.x, info), train.y, data.normalize(val.x, info), val.y


def _train(tiny_data, seed: int, init_seed: int = 0) -> tuple[bytes, list, torch.nn.Module]:
    x, y, xv, yv = tiny_data
    torch.manual_seed(init_seed)
    model = models.build_model("simple_cnn", 1, 12, 4)
    history = models.train_model(model, x, y, xv, yv, epochs=1, batch_size=16, lr=1e-2,
                                 max_shift=1, seed=seed, progress=False)
    return models.state_dict_bytes(model), history, model


def test_training_is_byte_identical_for_a_seed(tiny_data):
    a, history, model = _train(tiny_data, seed=0)
    b, _, _ = _train(tiny_data, seed=0)
    assert a == b
    assert not model.training  # handed back in eval mode
    assert len(history) == 1 and history[0].epoch == 1
    assert 0 <= history[0].val_accuracy <= 1 and history[0].train_loss > 0


def test_training_depends_on_the_seed(tiny_data):
    a, _, _ = _train(tiny_data, seed=0)
    b, _, _ = _train(tiny_data, seed=1)
    assert a != b


def test_training_changes_the_weights(tiny_data):
    torch.manual_seed(0)
    untrained = models.state_dict_bytes(models.build_model("simple_cnn", 1, 12, 4))
    trained, _, _ = _train(tiny_data, seed=0)
    assert trained != untrained


def test_predict_torch_matches_forward_and_restores_mode():
    torch.manual_seed(0)
    model = models.build_model("mnist_net", 1, 12, 4).train()
    x = np.random.default_rng(0).standard_normal((5, 1, 12, 12)).astype(np.float32)
    got = models.predict_torch(model, x, batch_size=2)
    assert model.training  # mode restored
    with torch.no_grad():
        expected = model.eval()(torch.from_numpy(x)).numpy()  # eval: dropout off
    assert got.dtype == np.float32 and got.shape == (5, 4)
    assert np.allclose(got, expected, atol=1e-6)


# --- checkpoints ------------------------------------------------------------------------------

def _mark_unpickled(marker: str) -> dict:
    """Runs only if a loader unpickles arbitrary objects; leaves a file as proof."""
    Path(marker).write_text("unpickled")
    return {}


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (_mark_unpickled, (self.marker,))


def test_load_weights_round_trip(tmp_path):
    torch.manual_seed(0)
    source = models.build_model("simple_cnn", 1, 12, 4)
    path = tmp_path / "model.pt"
    path.write_bytes(models.state_dict_bytes(source))
    torch.manual_seed(1)
    target = models.build_model("simple_cnn", 1, 12, 4).train()
    loaded = models.load_weights(target, path)
    assert loaded is target and not target.training
    for key, value in source.state_dict().items():
        assert torch.equal(value, target.state_dict()[key])


def test_load_weights_refuses_pickled_objects(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pt"
    torch.save({"conv.weight": Payload(str(marker))}, path)
    with pytest.raises(UserError) as info:
        models.load_weights(models.build_model("simple_cnn", 1, 12, 4), path)
    assert str(path) in str(info.value)
    assert not marker.exists(), "the checkpoint's pickled object was executed"


def test_load_weights_truncated_file_names_the_path(tmp_path):
    torch.manual_seed(0)
    blob = models.state_dict_bytes(models.build_model("simple_cnn", 1, 12, 4))
    path = tmp_path / "truncated.pt"
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(UserError) as info:
        models.load_weights(models.build_model("simple_cnn", 1, 12, 4), path)
    assert str(path) in str(info.value)


def test_load_weights_missing_file(tmp_path):
    path = tmp_path / "missing.pt"
    with pytest.raises(UserError, match="not found") as info:
        models.load_weights(models.build_model("simple_cnn", 1, 12, 4), path)
    assert str(path) in str(info.value)


def test_load_weights_of_another_architecture(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(models.state_dict_bytes(models.build_model("simple_cnn", 1, 12, 4)))
    with pytest.raises(UserError, match="does not match train.model") as info:
        models.load_weights(models.build_model("mnist_net", 1, 12, 4), path)
    assert str(path) in str(info.value)
