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
        drop = {"accuracy_drop_pp": round((fp32["accuracy"] - ev["accuracy"]) * 100, 4)}
        if "mcnemar_p" in ev:  # the flips behind the drop and McNemar's test of them: the gate's
            drop.update(test_flips={"lost": ev["fp32_right_int8_wrong"],
                                    "won": ev["int8_right_fp32_wrong"]}, mcnemar_p=ev["mcnemar_p"])
        return drop

    @classmethod
    def drop_noise(cls, entry, gates) -> str | None:
        """Why a test drop is within what the test split can tell from noise (McNemar's one-sided
        test of its flips at gates.significance, as quantize_static judges the validation
        split), or None when it is real."""
        p, flips = entry.get("mcnemar_p"), entry.get("test_flips")
        if p is None or flips is None or p < gates.significance:
            return None
        return (f"{flips['lost']} test images FP32-right -> INT8-wrong vs {flips['won']} back, "
                f"McNemar p = {p:.3g} >= gates.significance {gates.significance}")

    @classmethod
    def tolerance_notes(cls, summary, gates, quantized) -> list[str]:
        """A drop over the gate that its test split cannot tell from noise passes, with a note."""
        notes = []
        for v in quantized:
            drop, why = summary[v]["accuracy_drop_pp"], cls.drop_noise(summary[v], gates)
            if drop > gates.max_accuracy_drop_pp and why:
                notes.append(f"{v} loses {drop:.2f} pp of test accuracy, over "
                             f"gates.max_accuracy_drop_pp = {gates.max_accuracy_drop_pp}, but the "
                             f"test split cannot tell it from noise ({why}); more test images "
                             "would show whether it is real")
        return notes
