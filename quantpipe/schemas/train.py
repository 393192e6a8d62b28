"""params.yaml `train`: the model (a zoo name, a torchvision model or onnx:<file>) and its training."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from quantpipe.params import check
from quantpipe.tasks import default


@dataclass(frozen=True)
class TrainParams:
    SECTION: ClassVar[str] = "train"

    # A zoo name (simple_cnn, mnist_net; tiny_detector), a torchvision classification model
    # (resnet18, ...) or onnx:inputs/<file>.onnx. null (and null epochs, batch_size, lr): the
    # task's default, mnist_net or tiny_detector (quantpipe/tasks/<task>.py).
    model: str | None = None
    # Weights you bring for train.model: inputs/<file>, a state_dict (or a checkpoint dict
    # holding one under state_dict, model or model_state_dict), read with weights_only=True.
    # With epochs 0 they are used as they are; with epochs N the model is fine-tuned from them.
    weights: str | None = None
    epochs: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    # Random shifts of up to this many pixels: cheap augmentation that keeps a 3,500-image
    # MNIST training set from over-fitting (~98% test accuracy with 10 epochs).
    max_shift: int = 1

    def __post_init__(self) -> None:
        # The model name itself is checked by quantpipe.models (it needs torchvision).
        check(self.model is None or bool(self.model), "train.model", self.model,
              "a model name such as mnist_net, or null")
        check(self.weights is None or bool(self.weights), "train.weights", self.weights,
              "inputs/<file> (a state_dict) or null")
        check(self.epochs is None or self.epochs >= (0 if self.weights else 1), "train.epochs",
              self.epochs, "an integer >= 1 or null (0, use the weights as they are, needs "
              "train.weights)" if not self.weights else "an integer >= 0 or null")
        check(self.batch_size is None or self.batch_size >= 1, "train.batch_size",
              self.batch_size, "an integer >= 1 or null")
        check(self.lr is None or 0 < self.lr < 10, "train.lr", self.lr, "a number in (0, 10) or null")
        check(0 <= self.max_shift <= 8, "train.max_shift", self.max_shift, "0..8 pixels")

    def for_task(self, task: str) -> "TrainParams":
        """These params with the task's defaults where they are null (task: the prepared data's,
        quantpipe.data.DataInfo.task)."""
        return dataclasses.replace(self, **{k: default(task, f"train.{k}") for k in
                                            ("model", "epochs", "batch_size", "lr")
                                            if getattr(self, k) is None})
