"""When is an accuracy drop real? Flips against FP32, McNemar's test, agreement on a large pool.

A validation split of a few hundred images makes one image worth 0.2-0.6 pp: a drop above
quantize_static.max_drop_pts can be one or two flipped images, i.e. noise. So a drop
counts as real only when all three hold:
- the validation accuracy drops by more than max_drop_pts (percentage points for accuracy);
- the flips are lopsided beyond chance: FP32-right -> INT8-wrong (b) outnumber INT8-right ->
  FP32-wrong (c) with McNemar's exact one-sided p-value below `significance` (under "no real
  drop" each discordant image is a fair coin, so b ~ Binomial(b + c, 1/2));
- the model agrees with FP32 on less than `min_pool_agreement` of a large unlabeled pool (train
  images not used for calibration): at 99.5% agreement no accuracy can move by more than 0.5 pp.
One rule overrides them: agreement on the pool below `agreement_floor` is a real change whatever
the drop and McNemar say. Flips that cancel out on a few hundred validation images are not
noise when one input in six changes class: such a model is not FP32 in INT8 form, and it lost
2.4-7.3 pp on the test split in our families study (EfficientNets at 84% and 47% agreement).

Agreement on the pool counts the images FP32 decides: those whose top-1 leads the runner-up by
more than the quantized model's typical output error (the median over the pool of its largest
logit difference). A flip of an image FP32 scores as a near-tie is one no faithful INT8 model
can avoid: ResNet-50 after 5 epochs on 252 images gives logits of +-300, its static model
differs by 0.69 (0.2% of that) and flips 9% of the pool, 22 of 23 flips on the 21% of images
FP32 itself separates by less. Where FP32 decides fewer than MIN_DECIDED of the pool by that
margin, the error is as large as FP32's own decisions and every image counts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from quantpipe import data

# Pool images scored per model: at 99.5% agreement the verdict rests on ~10 disagreements.
POOL_SIZE = 2000
# The least share of the pool FP32 must decide (see the module docstring) for agreement to be
# counted on those images only.
MIN_DECIDED = 0.5


def mcnemar_p(b: int, c: int) -> float:
    """One-sided exact McNemar p-value: P(X >= b) for X ~ Binomial(b + c, 1/2)."""
    n = b + c
    if n == 0:
        return 1.0
    return min(1.0, sum(math.comb(n, k) for k in range(b, n + 1)) / 2 ** n)


@dataclass(frozen=True)
class Comparison:
    """A quantized model's top-1 predictions against FP32's on one set of samples."""
    samples: int
    agreement: float
    # Only with labels: accuracy flips in each direction, all flips (the discordant images the
    # test rests on), and the accuracy drop they make.
    fp32_right_int8_wrong: int | None = None
    int8_right_fp32_wrong: int | None = None
    flips: int | None = None
    accuracy_drop_pp: float | None = None
    mcnemar_p: float | None = None
    # Only with both models' logits: agreement on the images FP32 decides (decided()), how many
    # those are, and the margin that decides them (the quantized model's typical error).
    decided_agreement: float | None = None
    decided_samples: int | None = None
    decided_margin: float | None = None

    @property
    def counted_agreement(self) -> float:
        """What the pool rules read: agreement on the decided images where there are enough."""
        return self.agreement if self.decided_agreement is None else self.decided_agreement

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def decided(out: np.ndarray, ref_out: np.ndarray) -> dict:
    """Agreement of (N, K) logits `out` with FP32's `ref_out` on the images FP32 decides: its
    top-1 leads the runner-up by more than the median over images of out's largest logit
    difference; {} where those are fewer than MIN_DECIDED of the images."""
    if len(out) == 0 or out.ndim != 2 or out.shape[1] < 2:
        return {}
    top2 = np.sort(ref_out.astype(np.float64), axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    tolerance = float(np.median(np.abs(out.astype(np.float64) - ref_out).max(axis=1)))
    clear = margin > tolerance
    if clear.mean() < MIN_DECIDED:
        return {}
    same = out.argmax(1)[clear] == ref_out.argmax(1)[clear]
    return {"decided_agreement": round(float(same.mean()), 6), "decided_samples": int(clear.sum()),
            "decided_margin": round(tolerance, 6)}


def compare(pred: np.ndarray, ref_pred: np.ndarray, y: np.ndarray | None = None,
            logits: tuple[np.ndarray, np.ndarray] | None = None) -> Comparison:
    """pred, ref_pred: (N,) top-1 classes of the quantized model and of FP32; y: labels or None;
    logits: both models' (N, K) logits, for the agreement on the images FP32 decides."""
    agreement = round(float((pred == ref_pred).mean()), 6) if len(pred) else 1.0
    if y is None:
        return Comparison(samples=len(pred), agreement=agreement,
                          **(decided(*logits) if logits is not None else {}))
    right, ref_right = pred == y, ref_pred == y
    b, c = int((ref_right & ~right).sum()), int((right & ~ref_right).sum())
    return Comparison(samples=len(pred), agreement=agreement, fp32_right_int8_wrong=b,
                      int8_right_fp32_wrong=c, flips=b + c,
                      accuracy_drop_pp=round((b - c) / max(len(pred), 1) * 100, 4),
                      mcnemar_p=round(mcnemar_p(b, c), 6))


@dataclass(frozen=True)
class Verdict:
    real: bool
    why: str
    # Which rule decided: "within_drop", "mcnemar_noise", "pool_agreement" (not real), or
    # "agreement_floor", "real_drop" (real).
    rule: str


def judge(val: Comparison, pool: Comparison, *, max_drop_pp: float, significance: float,
          min_pool_agreement: float, agreement_floor: float) -> Verdict:
    """Is the validation drop real (see the module docstring)? `why` says in one line."""
    drop, b, c = val.accuracy_drop_pp, val.fp32_right_int8_wrong, val.int8_right_fp32_wrong
    flips = f"{b} FP32-right -> INT8-wrong vs {c} back of {val.samples} validation images"
    agreed = pool.counted_agreement
    on = (f"{pool.samples} pool images" if pool.decided_agreement is None else
          f"the {pool.decided_samples} of {pool.samples} pool images FP32 decides by more than "
          f"{pool.decided_margin:.3g} (all: {pool.agreement:.2%})")
    if agreed < agreement_floor:
        return Verdict(True, f"agreement with FP32 on {on} {agreed:.2%} < agreement_floor "
                             f"{agreement_floor:.2%}, a real change whatever the validation drop "
                             f"({drop:.2f} pp: {flips}, McNemar p = {val.mcnemar_p:.3g})",
                       "agreement_floor")
    if drop <= max_drop_pp:
        return Verdict(False, f"validation drop {drop:.2f} pp <= {max_drop_pp} pp", "within_drop")
    if val.mcnemar_p >= significance:
        return Verdict(False, f"validation drop {drop:.2f} pp is noise: {flips}, McNemar p = "
                              f"{val.mcnemar_p:.3g} >= significance {significance}", "mcnemar_noise")
    if agreed >= min_pool_agreement:
        return Verdict(False, f"validation drop {drop:.2f} pp ({flips}), but agreement with FP32 "
                              f"on {on} is {agreed:.2%} >= min_pool_agreement "
                              f"{min_pool_agreement:.2%}", "pool_agreement")
    return Verdict(True, f"validation drop {drop:.2f} pp: {flips} (McNemar p = "
                         f"{val.mcnemar_p:.3g} < {significance}), agreement with FP32 on {on} "
                         f"{agreed:.2%} < {min_pool_agreement:.2%}", "real_drop")


@dataclass(frozen=True)
class Judged:
    """A candidate model judged against FP32: what the fallback records and decides on."""
    # JSON-able: val_score, drop_pts (the task's score on val and its drop, in points), val/pool
    # comparisons, real_drop, verdict.
    record: dict
    # Top-1 classes on every judged image (val, then pool): did a change move any prediction?
    predictions: np.ndarray

    @property
    def real(self) -> bool:
        return bool(self.record["real_drop"])

    def score(self) -> tuple:
        """Larger is better: a drop that is not real, then agreement with FP32 on the pool (the
        largest sample), then the validation drop."""
        pool = self.record.get("pool", {})
        return (not self.real, pool.get("decided_agreement", pool.get("agreement", 0.0)),
                pool.get("agreement", 0.0), -self.record["drop_pts"])


def assess(pred_val: np.ndarray, pred_pool: np.ndarray, ref_val: np.ndarray,
           ref_pool: np.ndarray, y_val: np.ndarray, *, max_drop_pp: float, significance: float,
           min_pool_agreement: float, agreement_floor: float,
           pool_logits: tuple[np.ndarray, np.ndarray] | None = None) -> Judged:
    """A candidate's top-1 classes on val and pool against FP32's (ref_*): its comparisons and
    verdict, as the fallback records and decides on them. pool_logits: the candidate's and
    FP32's pool logits, for the agreement on the images FP32 decides."""
    val, pool = compare(pred_val, ref_val, y_val), compare(pred_pool, ref_pool, logits=pool_logits)
    verdict = judge(val, pool, max_drop_pp=max_drop_pp, significance=significance,
                    min_pool_agreement=min_pool_agreement, agreement_floor=agreement_floor)
    fp32_accuracy = float((ref_val == y_val).mean()) if len(y_val) else 1.0
    record = {"val_score": round(fp32_accuracy - val.accuracy_drop_pp / 100, 6),
              "drop_pts": val.accuracy_drop_pp, "val": val.as_dict(),
              "pool": pool.as_dict(), "real_drop": verdict.real, "verdict": verdict.why,
              "rule": verdict.rule}
    return Judged(record, np.concatenate([pred_val, pred_pool]))


def pool_indices(n: int, exclude: np.ndarray | None = None, size: int = POOL_SIZE) -> np.ndarray:
    """Up to `size` indices of range(n) not in `exclude`, evenly spaced (so a split stored class
    by class still gives every class its share), deterministic."""
    rest = np.arange(n) if exclude is None else np.setdiff1d(np.arange(n), exclude)
    if len(rest) <= size:
        return rest
    return rest[np.linspace(0, len(rest) - 1, size).round().astype(int)]


def pool(train_x, info: data.DataInfo, exclude: np.ndarray | None = None) -> data.Normalized:
    """The pool: train images (uint8 rows, on disk or in memory) not in `exclude` (the
    calibration set), evenly spaced, normalized a batch at a time as they are read."""
    return data.Normalized(data.rows(train_x, pool_indices(len(train_x), exclude)), info)


def one_image_pp(samples: int) -> float:
    """What one image is worth in accuracy points on a split of `samples` images."""
    return 100.0 / max(samples, 1)


def coarse_split_warning(samples: int, max_drop_pp: float, val_fraction: float | None = None) -> str | None:
    """The warning when one of `samples` validation images is worth more than max_drop_pp, with
    the prepare.val_fraction (now `val_fraction`) that would make one image worth the limit."""
    one = one_image_pp(samples)
    if one <= max_drop_pp:
        return None
    fix = "raise prepare.val_fraction for a finer criterion"
    if val_fraction and max_drop_pp > 0:
        fraction = val_fraction * one / max_drop_pp  # val grows in proportion to the fraction
        fix = (f"raise prepare.val_fraction to about {fraction:.2f} for a finer criterion"
               if fraction < 0.5 else "raise prepare.val_fraction or bring more images")
    return (f"one of the {samples} validation images is worth {one:.2f} pp, more than "
            f"quantize_static.max_drop_pts = {max_drop_pp}: the drop alone cannot tell noise from loss "
            f"(McNemar's test and the pool decide); {fix}")


def above_chance(correct: int, samples: int, classes: int, significance: float = 0.05) -> bool:
    """Whether `correct` of `samples` right answers beat guessing among `classes` classes: the
    one-sided binomial p-value P(X >= correct), X ~ Binomial(samples, 1/classes), below
    `significance`. A model that never left chance is marked so, not scored: its INT8 twin
    has no accuracy to keep."""
    chance = 1.0 / max(classes, 1)
    p = sum(math.comb(samples, k) * chance ** k * (1 - chance) ** (samples - k)
            for k in range(correct, samples + 1))
    return p < significance
