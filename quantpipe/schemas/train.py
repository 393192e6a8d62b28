"""params.yaml `train`: the model (a zoo name, a torchvision model or onnx:<file>) and its training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from quantpipe.params import check


@dataclass(frozen=True)
class TrainParams:
    SECTION: ClassVar[str] = "train"

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
        check(bool(self.model), "train.model", self.model, "a model name such as mnist_net")
        check(self.epochs >= 1, "train.epochs", self.epochs, "an integer >= 1")
        check(self.batch_size >= 1, "train.batch_size", self.batch_size, "an integer >= 1")
        check(0 < self.lr < 10, "train.lr", self.lr, "a number in (0, 10)")
        check(0 <= self.max_shift <= 8, "train.max_shift", self.max_shift, "0..8 pixels")
