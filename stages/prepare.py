"""prepare: load the dataset, split it (stratified, seeded) and draw the calibration set.

Outputs: data/prepared/ (train/val/test .npy + meta.json) and data/calibration/ (calib .npy,
their indices into train, meta.json), separate so that a calibration change leaves the
training data's hash alone.
"""

import dataclasses
import json

import numpy as np

from quantpipe import data
from quantpipe import params
from quantpipe.detection import data as detection_data
from quantpipe.io import atomic_path, run_stage, stage_args, write_json
from quantpipe.schemas.prepare import PrepareParams

# Detection: the test split's ground truth in COCO instances format, beside the arrays, so the
# COCO results each variant's evaluation writes can be re-scored with any COCO tool.
TEST_ANNOTATIONS = "test_annotations.json"


def main(argv: list[str]) -> None:
    args = stage_args("prepare", argv, "prepared", "calibration", "metrics")
    p, seed = params.load(PrepareParams), params.seed()
    category_ids = None
    if p.task == "detection":
        x, objects, class_names, category_ids = detection_data.load_detection_source(
            p.source, p.path, p.channels, p.image_size)
        num_classes = len(class_names)
        full = data.Split(x=x, y=detection_data.strata(objects, num_classes),
                          objects=tuple(objects))
    else:
        full, class_names = data.load_source(p.source, p.path, p.channels, p.image_size)
        num_classes = data.check_dataset(full, p.path or p.source)
    splits = {name: full.take(idx) for name, idx in data.stratified_split(
        full.y, p.val_fraction, p.test_fraction, seed=seed).items()}
    info = dataclasses.replace(
        data.compute_info(p.source, splits["train"], num_classes, class_names,
                          None if p.mean is None else (p.mean, p.std)),
        task=p.task, category_ids=category_ids)
    calib_index = data.calibration_indices(len(splits["train"]), p.calib_size, seed=seed)
    calib = splits["train"].take(calib_index)

    with atomic_path(args.prepared, is_dir=True) as tmp:
        data.save_splits(tmp, splits, info)
        if p.task == "detection":
            (tmp / TEST_ANNOTATIONS).write_text(json.dumps(detection_data.coco_ground_truth(
                splits["test"].objects, p.image_size, category_ids, class_names)) + "\n")
    with atomic_path(args.calibration, is_dir=True) as tmp:
        data.save_splits(tmp, {"calib": calib}, info)
        # quantize_static scores models on the train images that did not calibrate them.
        np.save(tmp / data.CALIB_INDEX, calib_index)
    objects = {f"{name}_objects": sum(map(len, split.objects)) for name, split in splits.items()
               if split.objects is not None}
    write_json(args.metrics, {
        "source": p.source, "num_classes": num_classes, "input_shape": list(info.input_shape),
        **{f"{name}_samples": len(split) for name, split in splits.items()},
        "calib_samples": len(calib), **({"task": p.task, **objects} if objects else {})})
    print(f"prepare: {', '.join(f'{n} {len(s)}' for n, s in splits.items())}, "
          f"calibration {len(calib)} -> {args.prepared}, {args.calibration}")


if __name__ == "__main__":
    run_stage(main)
