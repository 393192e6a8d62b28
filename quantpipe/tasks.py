"""What the model does (prepare.task) and what each task takes when params.yaml says null.

The task is a fact of the prepared data (data/prepared/meta.json): every stage after prepare
reads it from there, so `dvc exp run -S prepare.task=detection` switches the whole pipeline and
only prepare declares the key.
"""

from __future__ import annotations

TASKS = ("classification", "detection")

# params.yaml keys left null take the task's value.
DEFAULTS = {
    "classification": {"prepare.source": "mnist5k", "prepare.image_size": 28,
                       "train.model": "mnist_net", "train.epochs": 10, "train.batch_size": 64,
                       "train.lr": 1e-3},
    # 15 epochs of the embedded canvases: ~2 minutes on 2 cores, mAP@.5 ~0.95.
    "detection": {"prepare.source": "digits_detection", "prepare.image_size": 64,
                  "train.model": "tiny_detector", "train.epochs": 15, "train.batch_size": 32,
                  "train.lr": 3e-3},
}


def default(task: str, key: str):
    return DEFAULTS[task][key]
