"""What quantize_static writes of a quantization, whichever engine made it: metrics/
quantize_static.json's record of the written model and the verdict, and the failure message
when the drop is still real after the fallback."""

from __future__ import annotations

import onnx

from quantpipe import onnxutil
from quantpipe.engines.base import StaticResult
from quantpipe.engines.graph import mac_summary
from quantpipe.schemas.quantize_static import QuantizeStaticParams

# The params behind each rule of quantpipe.criterion that makes a change real.
RULE_KEYS = {"agreement_floor": "quantize_static.agreement_floor",
             "real_drop": "quantize_static.max_drop_pts, significance and min_pool_agreement"}


def static_record(result: StaticResult, settings: dict, p: QuantizeStaticParams,
                  score_key: str, fp32_score: float, task_metrics: dict, model: onnx.ModelProto,
                  sample_shape: tuple[int, ...]) -> dict:
    """The written model (`model`, as the engine left it) and the verdict it was kept on."""
    last = result.final
    return {
        "engine": result.engine, **settings,
        "nodes_excluded": list(p.nodes_to_exclude),
        "fallback_nodes": result.fallback_nodes, "nodes_in_float": result.nodes_in_float,
        # Where the arithmetic is and how much of it the written model runs in INT8: the
        # report's reason when static is not faster (mac_share_int8, macs_by_op_type).
        **mac_summary(model, sample_shape),
        **task_metrics,
        "fallback_steps": result.steps,
        # The task's validation score (accuracy, mAP@[.5:.95], mIoU: `score` names it), the
        # drop in points, and the bar it was judged by (max_drop_pts, the task's when null).
        "score": score_key, "fp32_val_score": round(fp32_score, 6), "max_drop_pts": p.max_drop_pts,
        "val_score": last["val_score"], "val_drop_pts": result.drop_pts,
        # What the decision rests on (the kept model): flips and agreement, val and pool.
        "val": last["val"], "pool": last["pool"], "real_drop": last["real_drop"],
        "verdict": last["verdict"], "rule": last["rule"],
        "symbolic_shape_inference": result.symbolic_shape_inference,
        "ops": onnxutil.op_counts(model)}


def failure(result: StaticResult, p: QuantizeStaticParams, engines: list[str]) -> str | None:
    """Why the written model is out of the criterion and what to try, or None when it is in.
    `engines`: every name quantize_static.engine allows."""
    last = result.final
    if not last["real_drop"]:
        return None
    other = " or ".join(n for n in engines if n != p.engine)
    return (f"{last['verdict']} (rule: {RULE_KEYS[last['rule']]}); tried {result.tried()}; "
            f"raise max_fallback_steps, try engine: {other}, or set allow_accuracy_drop: true")
