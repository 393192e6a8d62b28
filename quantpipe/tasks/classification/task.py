"""Image classification after prepare: models, logits, top-1 agreement and quantize_static's
flip-counting criterion."""

from __future__ import annotations

import numpy as np

# quantpipe.models (PyTorch: seconds to import) is imported by the methods that train or score
# in PyTorch only: the stages after export run without it.
from quantpipe import criterion, evaluate, onnxutil, representative
from quantpipe.runtimes.base import top1_agreement
from quantpipe.tasks.base import Evaluation, StaticJudge, Task
from quantpipe.tasks.classification import ClassificationSpec


class Classification(ClassificationSpec, Task):
    """The stages' side: models, logits, top-1 agreement, quantize_static's flip-counting
    criterion (quantpipe.criterion)."""
    validation_key, history_key, history_label = "accuracy", "val_accuracy", "val accuracy"

    @classmethod
    def zoo(cls) -> tuple[str, ...]:
        from quantpipe import models
        return models.ZOO

    @classmethod
    def has_model(cls, name: str) -> bool:
        from quantpipe import models
        return name in models.ZOO or name in models.torchvision_names()

    @classmethod
    def describe_zoo(cls) -> str:
        from quantpipe import models
        return (f"{list(models.ZOO)}, a torchvision classification model such as resnet18, "
                "mobilenet_v2")

    def fit(self, model, x_train, train, x_val, val, *, epochs, batch_size, lr, max_shift, seed,
            on_step=None, plan=None):
        from quantpipe import models
        return models.train_model(model, x_train, train.y, x_val, val.y, epochs=epochs,
                                  batch_size=batch_size, lr=lr, max_shift=max_shift, seed=seed,
                                  on_step=on_step, micro_batch=plan and plan.micro_batch,
                                  eval_batch=plan.eval_batch if plan else 256)

    def torch_scores(self, model, x, split, batch_size=256) -> dict:
        from quantpipe import models
        return models.score_classifier(model, x, split.y, batch_size)

    def check_output(self, out: np.ndarray, where: str) -> None:
        onnxutil.check_logits(out, self.info.num_classes, where)

    def compare(self, got: np.ndarray, expected: np.ndarray) -> dict:
        diff = np.abs(got.astype(np.float64) - expected)
        return {"samples": len(got), "max_abs_diff": round(float(diff.max()), 6),
                "mean_abs_diff": round(float(diff.mean()), 6),
                "agreement": round(float((got.argmax(1) == expected.argmax(1)).mean()), 6)}

    def agree(self, ref: np.ndarray, out: np.ndarray) -> float:
        return top1_agreement(ref, out)

    def labels(self, split):
        return split.y

    def evaluate(self, out, ref, pool_out, pool_ref, test, where) -> Evaluation:
        quality = evaluate.accuracy_metrics(out, ref, test.y, self.info.num_classes)
        pool = criterion.compare(pool_out.argmax(1), pool_ref.argmax(1),
                                 logits=(pool_out, pool_ref)).as_dict()
        line = (f"accuracy {quality['accuracy']:.4f}, agreement with fp32 "
                f"{quality['agreement']:.4f} (flips {quality['fp32_right_int8_wrong']} lost, "
                f"{quality['int8_right_fp32_wrong']} won; pool of {pool['samples']}: "
                f"{pool['agreement']:.4f})")
        return Evaluation(quality, pool, [], evaluate.confusion_rows(test.y, out.argmax(1)), line)

    def test_scores(self, out, test) -> dict:
        return {"accuracy": round(float((out.argmax(1) == test.y).mean()), 6)}

    def static_judge(self, ref_val_out, ref_pool_out, val, p) -> StaticJudge:
        ref_val, ref_pool = ref_val_out.argmax(1), ref_pool_out.argmax(1)

        def check(val_out: np.ndarray, pool_out: np.ndarray) -> criterion.Judged:
            """One candidate against FP32 on val and pool, and the verdict."""
            return criterion.assess(val_out.argmax(1), pool_out.argmax(1), ref_val, ref_pool,
                                    val.y, max_drop_pp=p.max_drop_pts,
                                    significance=p.significance,
                                    min_pool_agreement=p.min_pool_agreement,
                                    agreement_floor=p.agreement_floor,
                                    pool_logits=(pool_out, ref_pool_out))

        return StaticJudge(float((ref_val == val.y).mean()), ref_pool, check,
                           lambda out: out.argmax(1))

    def static_warnings(self, val, p, val_fraction) -> list[str]:
        coarse = criterion.coarse_split_warning(len(val.y), p.max_drop_pts, val_fraction)
        return [coarse] if coarse else []

    def static_metrics(self, judge, result, val) -> dict:
        return {"val_image_pp": round(criterion.one_image_pp(len(val.y)), 4)}  # one image's worth

    def output_statistics(self, out):
        return representative.classifier_outputs(out)

    def qat_limits(self, parity, p) -> str | None:
        if parity["agreement"] >= p.min_agreement and parity["max_abs_diff"] <= p.max_abs_diff:
            return None
        return (f"max |logit diff| {parity['max_abs_diff']:.3g}, agreement "
                f"{parity['agreement']:.2%}; quantize_qat.max_abs_diff = {p.max_abs_diff}, "
                f"min_agreement = {p.min_agreement}")
