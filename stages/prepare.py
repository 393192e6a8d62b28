"""prepare: load the dataset, split it (stratified, seeded) and draw the calibration set.

Outputs: data/prepared/ (train/val/test .npy + meta.json; for an image folder, which file went
to which split) and data/calibration/ (calib .npy, their indices into train, meta.json),
separate so that a calibration change leaves the training data's hash alone. An image folder is
decoded in parallel straight into the split files (quantpipe.imagefolder), with progress.
"""

import dataclasses
import json
import time

import numpy as np

from quantpipe import data, imagefolder, params, sources
from quantpipe.detection import data as detection_data
from quantpipe.io import atomic_path, resources, run_stage, stage_args, write_json
from quantpipe.schemas.prepare import PrepareParams
from quantpipe.storage import NpyRows

# Detection: the test split's ground truth in COCO instances format, beside the arrays, so the
# COCO results each variant's evaluation writes can be re-scored with any COCO tool.
TEST_ANNOTATIONS = "test_annotations.json"


def main(argv: list[str]) -> None:
    args = stage_args("prepare", argv, "prepared", "calibration", "metrics")
    p, seed = params.load(PrepareParams), params.seed()
    start = time.perf_counter()
    category_ids, class_names, folder, workers_peak = None, None, None, None
    if p.task == "detection":
        x, objects, class_names, category_ids = detection_data.load_detection_source(
            p.source, p.path, p.channels, p.image_size)
        num_classes = len(class_names)
        full = data.Split(x=x, y=detection_data.strata(objects, num_classes),
                          objects=tuple(objects))
        y = full.y
    elif p.source == "imagefolder":
        # Decoded after the split, in parallel, straight into the split files: a folder larger
        # than memory never is in memory.
        folder = imagefolder.list_folder(sources.source_root(p.source, p.path))
        class_names, y = folder.classes, folder.y
        num_classes = data.check_labels(y, p.path)
    else:
        full, class_names = sources.load_source(p.source, p.path, p.channels, p.image_size,
                                             p.resize, p.crop)
        num_classes = data.check_dataset(full, p.path or p.source)
        y = full.y
    parts = data.stratified_split(y, p.val_fraction, p.test_fraction, seed=seed)
    # Before anything is written: a calib_size larger than the train split stops here.
    calib_index = data.calibration_indices(len(parts["train"]), p.calib_size, seed=seed)

    with atomic_path(args.prepared, is_dir=True) as tmp:
        if folder is not None:
            t = imagefolder.transform_for(folder, p.channels, p.image_size, p.resize, p.crop)
            written, workers_peak = imagefolder.decode_into(folder, parts, tmp, t)
            splits = {name: data.Split(x=NpyRows(written[name]), y=y[idx])
                      for name, idx in parts.items()}
            for name, idx in parts.items():  # which image went where, for tracing a prediction
                (tmp / f"{name}_files.txt").write_text(
                    "".join(f"{folder.relative(i)}\n" for i in idx))
        else:
            splits = {name: full.take(idx) for name, idx in parts.items()}
        info = dataclasses.replace(
            data.compute_info(p.source, splits["train"], num_classes, class_names,
                              None if p.mean is None else (p.mean, p.std)),
            task=p.task, category_ids=category_ids, resize=p.resize, crop=p.crop)
        data.save_splits(tmp, splits, info)
        if p.task == "detection":
            (tmp / TEST_ANNOTATIONS).write_text(json.dumps(detection_data.coco_ground_truth(
                splits["test"].objects, p.image_size, category_ids, class_names)) + "\n")
    calib = data.load_split(args.prepared, "train").take(calib_index)
    with atomic_path(args.calibration, is_dir=True) as tmp:
        data.save_splits(tmp, {"calib": calib}, info)
        # quantize_static scores models on the train images that did not calibrate them.
        np.save(tmp / data.CALIB_INDEX, calib_index)
    sizes = {name: len(idx) for name, idx in parts.items()}
    objects = {f"{name}_objects": sum(map(len, split.objects)) for name, split in splits.items()
               if split.objects is not None}
    write_json(args.metrics, {
        "source": p.source, "num_classes": num_classes, "input_shape": list(info.input_shape),
        **{f"{name}_samples": n for name, n in sizes.items()},
        "calib_samples": len(calib), **({"task": p.task, **objects} if objects else {}),
        "resources": resources(sum(sizes.values()), time.perf_counter() - start, workers_peak)})
    print(f"prepare: {', '.join(f'{n} {k}' for n, k in sizes.items())}, "
          f"calibration {len(calib)} -> {args.prepared}, {args.calibration}")

if __name__ == "__main__":
    run_stage(main)
