"""Image classification (prepare.task: classification): a label per image, (N, classes) logits,
top-1 accuracy. What it is (here) and what it does after prepare (task.py)."""

from __future__ import annotations

from quantpipe import data, imagefolder, sources
from quantpipe.tasks.base import Listing, Score, TaskSpec


class ClassificationSpec(TaskSpec):
    name = "classification"
    defaults = {"prepare.source": "mnist5k", "prepare.image_size": 28, "train.model": "mnist_net",
                "train.epochs": 10, "train.batch_size": 64, "train.lr": 1e-3,
                "quantize_static.max_drop_pts": 0.5}
    # mnist5k and digits ship inside installed wheels; the others read prepare.path.
    sources = ("mnist5k", "digits", "imagefolder", "npz", "torchvision:")
    score = Score("accuracy", "accuracy_drop_pp", "pp", "max_accuracy_drop_pp", "accuracy")
    score_keys = ("accuracy",)
    torch_score_keys = ("accuracy",)
    headline = (("accuracy", "accuracy", ".4f"), ("drop (pp)", "accuracy_drop_pp", ".2f"),
                ("agreement", "agreement", ".4f"))

    @classmethod
    def load(cls, p) -> Listing:
        if p.source == "imagefolder":
            # Decoded after the split, in parallel, straight into the split files: a folder
            # larger than memory never is in memory.
            folder = imagefolder.list_folder(sources.source_root(p.source, p.path))
            return Listing(folder.classes, folder.y, data.check_labels(folder.y, p.path),
                           folder=folder, transform=imagefolder.transform_for(
                               folder, p.channels, p.image_size, p.resize, p.crop))
        full, class_names = sources.load_source(p.source, p.path, p.channels, p.image_size,
                                                p.resize, p.crop)
        return Listing(class_names, full.y, data.check_dataset(full, p.path or p.source), full=full)

    @classmethod
    def summary_drop(cls, ev, fp32) -> dict:
        return {"accuracy_drop_pp": round((fp32["accuracy"] - ev["accuracy"]) * 100, 4)}
