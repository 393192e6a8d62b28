"""quantpipe.criterion: flips, McNemar's test, the pool, and when a drop counts as real."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quantpipe import criterion


def test_mcnemar_p_is_the_binomial_tail():
    assert criterion.mcnemar_p(0, 0) == 1.0
    assert criterion.mcnemar_p(2, 0) == pytest.approx(0.25)        # two coin flips both "lost"
    assert criterion.mcnemar_p(5, 0) == pytest.approx(1 / 32)
    assert criterion.mcnemar_p(3, 3) == pytest.approx(sum(math.comb(6, k) for k in range(3, 7)) / 64)
    assert criterion.mcnemar_p(0, 4) == 1.0                         # INT8 only won
    assert criterion.mcnemar_p(20, 5) < 0.01


def test_compare_counts_flips_in_each_direction():
    y = np.array([0, 1, 2, 3, 0, 1, 2, 3])
    ref = np.array([0, 1, 2, 3, 0, 1, 0, 0])      # FP32: 6 of 8 right
    pred = np.array([0, 1, 1, 3, 0, 2, 2, 0])     # INT8: loses samples 2 and 5, wins sample 6
    c = criterion.compare(pred, ref, y)
    assert (c.samples, c.fp32_right_int8_wrong, c.int8_right_fp32_wrong, c.flips) == (8, 2, 1, 3)
    assert c.agreement == pytest.approx(5 / 8)
    assert c.accuracy_drop_pp == pytest.approx((6 / 8 - 5 / 8) * 100)  # = (b - c) / n
    assert c.mcnemar_p == pytest.approx(criterion.mcnemar_p(2, 1), abs=1e-6)
    unlabeled = criterion.compare(pred, ref)
    assert unlabeled.as_dict() == {"samples": 8, "agreement": 0.625}


def _val(b: int, c: int, n: int = 179) -> criterion.Comparison:
    return criterion.compare(*_flipped(b, c, n))


def _flipped(b: int, c: int, n: int):
    """(pred, ref, y) of n samples: FP32 right on all but c, INT8 losing b and winning those c."""
    y = np.zeros(n, int)
    ref, pred = y.copy(), y.copy()
    pred[:b] = 1
    ref[b:b + c] = 1
    return pred, ref, y


POOL_OK = criterion.Comparison(samples=2000, agreement=0.9995)
POOL_BAD = criterion.Comparison(samples=2000, agreement=0.98)
LIMITS = {"max_drop_pp": 0.5, "significance": 0.1, "min_pool_agreement": 0.995,
          "agreement_floor": 0.97}


def test_two_flipped_images_of_179_are_noise():
    # The case: 1.12 pp on a 179-image validation split, 2 flips to 0.
    val = _val(2, 0)
    assert val.accuracy_drop_pp == pytest.approx(1.1173, abs=1e-3)
    verdict = criterion.judge(val, POOL_BAD, **LIMITS)
    assert not verdict.real
    assert verdict.why == ("validation drop 1.12 pp is noise: 2 FP32-right -> INT8-wrong vs 0 back "
                           "of 179 validation images, McNemar p = 0.25 >= significance 0.1")
    # Entropy on the default model: 8 lost vs 2 won of 500 (p = 0.055) with 98.8% pool
    # agreement is a real drop at the default level.
    assert criterion.judge(_val(8, 2, n=500), POOL_BAD, **LIMITS).real


def test_a_lopsided_drop_is_real_unless_the_pool_agrees():
    val = _val(12, 1)
    verdict = criterion.judge(val, POOL_BAD, **LIMITS)
    assert verdict.real and "McNemar p = " in verdict.why and "98.00% < 99.50%" in verdict.why
    agreed = criterion.judge(val, POOL_OK, **LIMITS)
    assert not agreed.real and "99.95% >= min_pool_agreement 99.50%" in agreed.why


def test_a_drop_within_the_limit_is_never_real():
    assert not criterion.judge(_val(1, 0, n=1000), POOL_BAD, **LIMITS).real  # 0.1 pp
    assert not criterion.judge(_val(0, 5), POOL_BAD, **LIMITS).real        # INT8 better


def test_agreement_below_the_floor_is_real_whatever_the_drop_and_mcnemar_say():
    # EfficientNet-V2-S's static model in the families study: 1.2 pp on val with flips that
    # cancel (McNemar: noise), 83.85% agreement on the pool. It lost 2.4 pp on test.
    val = _val(14, 12, n=500)
    pool = criterion.Comparison(samples=2000, agreement=0.8385)
    assert not criterion.judge(val, pool, **{**LIMITS, "agreement_floor": 0.0}).real  # old rule
    verdict = criterion.judge(val, pool, **LIMITS)
    assert verdict.real and verdict.rule == "agreement_floor"
    assert verdict.why.startswith("agreement with FP32 on 2000 pool images 83.85% < "
                                  "agreement_floor 97.00%, a real change whatever the validation "
                                  "drop (0.40 pp: 14 FP32-right -> INT8-wrong vs 12 back")
    # INT8 winning on val does not excuse it either; at the floor itself the usual rules apply.
    assert criterion.judge(_val(0, 5), pool, **LIMITS).rule == "agreement_floor"
    at_floor = criterion.Comparison(samples=2000, agreement=0.97)
    assert criterion.judge(val, at_floor, **LIMITS).rule == "within_drop"
    assert criterion.judge(_val(12, 1), at_floor, **LIMITS).rule == "real_drop"


def test_pool_indices_skip_calibration_and_spread_evenly():
    idx = criterion.pool_indices(10, exclude=np.array([0, 3]), size=100)
    assert idx.tolist() == [1, 2, 4, 5, 6, 7, 8, 9]
    spread = criterion.pool_indices(1000, exclude=np.arange(0, 1000, 2), size=50)
    assert len(spread) == 50 and len(set(spread.tolist())) == 50
    assert all(i % 2 == 1 for i in spread) and spread[0] == 1 and spread[-1] == 999
    assert criterion.one_image_pp(179) == pytest.approx(0.5587, abs=1e-4)


def test_coarse_split_warning_names_the_val_fraction_that_fixes_it():
    assert criterion.coarse_split_warning(500, 0.5) is None  # 0.2 pp per image
    message = criterion.coarse_split_warning(179, 0.5, val_fraction=0.1)
    assert message.startswith("one of the 179 validation images is worth 0.56 pp, more than "
                              "quantize_static.max_drop_pts = 0.5")
    assert "raise prepare.val_fraction to about 0.11" in message  # 200 of ~1,790 images
    assert "bring more images" in criterion.coarse_split_warning(30, 0.5, val_fraction=0.1)


def test_assess_records_the_comparisons_and_the_verdict():
    y = np.array([0, 1, 2, 3, 0, 1, 2, 3])
    ref = np.array([0, 1, 2, 3, 0, 1, 0, 0])      # FP32: 6 of 8 right
    pred = np.array([0, 1, 1, 3, 0, 2, 2, 0])     # loses 2, wins 1
    judged = criterion.assess(pred, ref[:4], ref, ref[:4], y, max_drop_pp=0.5, significance=0.1,
                              min_pool_agreement=0.995, agreement_floor=0.97)
    record = judged.record
    assert record["val_score"] == pytest.approx(5 / 8) and record["drop_pts"] == 12.5
    assert record["val"]["flips"] == 3 and record["pool"] == {"samples": 4, "agreement": 1.0}
    assert not judged.real and "is noise" in record["verdict"]  # 2 vs 1: McNemar p = 0.5
    assert record["rule"] == "mcnemar_noise"
    assert list(judged.predictions) == list(pred) + list(ref[:4])


def test_pool_agreement_counts_the_images_fp32_decides():
    """Logits of +-300 whose INT8 twin differs by ~1: flips of images FP32 separates by less than
    that are near-ties no faithful INT8 model avoids; the pool rules count the others. Where
    FP32 decides fewer than half the pool by that margin, every image counts."""
    rng = np.random.default_rng(0)
    ref = rng.uniform(-300, 300, (200, 6)).astype(np.float32)
    near = [0, 1, 2]
    ref[near, 0], ref[near, 1] = 300.1, 300.0  # FP32 decides these by 0.1
    out = ref + 1.0  # off by 1 everywhere, the same order
    out[near, 0] -= 5  # flip the three near-ties
    c = criterion.compare(out.argmax(1), ref.argmax(1), logits=(out, ref))
    assert c.agreement < 1.0 and c.decided_agreement == 1.0
    assert c.counted_agreement == 1.0 and c.decided_samples > 150
    judged = criterion.judge(_val(4, 1), c, **LIMITS)  # a validation drop McNemar calls noise
    assert not judged.real and judged.rule == "mcnemar_noise"
    ruled = criterion.judge(_val(4, 1), c, **{**LIMITS, "agreement_floor": 1.0 + 1e-9})
    assert ruled.real and "the 197 of 200 pool images FP32 decides by more than 1" in ruled.why
    # An error as large as FP32's margins on most images: every image counts.
    noisy = ref + rng.uniform(-300, 300, ref.shape).astype(np.float32)
    d = criterion.compare(noisy.argmax(1), ref.argmax(1), logits=(noisy, ref))
    assert d.decided_agreement is None and d.counted_agreement == d.agreement < 0.97
