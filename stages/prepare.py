"""prepare: load the dataset, split it (stratified, seeded) and draw the calibration set.

Outputs: data/prepared/ (train/val/test .npy + meta.json; for an image folder, which file went
to which split) and data/calibration/ (calib .npy, their indices into train, meta.json),
separate so that a calibration change leaves the training data's hash alone. An image folder is
decoded in parallel straight into the split files (quantpipe.imagefolder), with progress.
"""

import dataclasses
import sys
import time

import numpy as np

from quantpipe import data, imagefolder, modelinfo, params, tasks
from quantpipe.errors import UserError
from quantpipe.io import atomic_path, resources, run_stage, stage_args, write_json
from quantpipe.schemas.prepare import PrepareParams
from quantpipe.schemas.train import TrainParams


def main(argv: list[str]) -> None:
    args = stage_args("prepare", argv, "prepared", "calibration", "metrics")
    p, seed, stated = model_params(params.load(PrepareParams), params.load(TrainParams))
    start = time.perf_counter()
    # The task's dataset: in memory, or listed now and decoded after the split, in parallel,
    # straight into the split files (a folder larger than memory never is in memory).
    task = tasks.spec(p.task)
    listing = task.load(p)
    y, declared = listing.y, listing.declared
    class_names, num_classes = listing.class_names, listing.num_classes
    if stated is not None:
        modelinfo.check_classes(stated.class_names, class_names, stated.by,
                                p.path or p.source)
    parts = (data.declared_split(declared, y, p.val_fraction, seed=seed) if declared else
             data.stratified_split(y, p.val_fraction, p.test_fraction, seed=seed))
    calib_index = data.calibration_indices(len(parts["train"]), p.calib_size, seed=seed)
    if len(calib_index) < p.calib_size:
        print(f"warning: prepare.calib_size = {p.calib_size} is more than the train split's "
              f"{len(parts['train'])} images: calibrating on half of them ({len(calib_index)}), "
              "the other half judges the quantized models", file=sys.stderr)

    with atomic_path(args.prepared, is_dir=True) as tmp:
        splits, workers_peak = imagefolder.splits_of(listing, parts, tmp, p.path)
        info = dataclasses.replace(
            data.compute_info(p.source, splits["train"], num_classes, class_names,
                              None if p.mean is None else (p.mean, p.std)),
            task=p.task, category_ids=listing.category_ids, resize=p.resize, crop=p.crop,
            pad_value=p.pad_value or None, model_family=stated.family if stated else None)
        data.save_splits(tmp, splits, info)
        task.write_extras(tmp, splits, info)
    calib = data.load_split(args.prepared, "train").take(calib_index)
    with atomic_path(args.calibration, is_dir=True) as tmp:
        data.save_splits(tmp, {"calib": calib}, info)
        # quantize_static scores models on the train images that did not calibrate them.
        np.save(tmp / data.CALIB_INDEX, calib_index)
    sizes = {name: len(idx) for name, idx in parts.items()}
    counts = {f"{name}_objects": sum(map(len, split.objects)) for name, split in splits.items()
              if split.objects is not None}
    write_json(args.metrics, {
        "source": p.source, "num_classes": num_classes, "input_shape": list(info.input_shape),
        **{f"{name}_samples": n for name, n in sizes.items()},
        "calib_samples": len(calib), **({"task": p.task, **counts} if counts else {}),
        **({"declared_splits": {s: len(i) for s, i in declared.items()}} if declared else {}),
        **({"preprocessing_from": stated.by} if stated else {}),
        "resources": resources(sum(sizes.values()), time.perf_counter() - start,
                               workers_peak_rss_mb=workers_peak)})
    print(f"prepare: {', '.join(f'{n} {k}' for n, k in sizes.items())}, "
          f"calibration {len(calib)} -> {args.prepared}, {args.calibration}")


def model_params(p: PrepareParams, train: TrainParams):
    """prepare's params completed by what a brought model states (quantpipe.modelinfo), the
    seed, and the statement. A brought ONNX that states nothing needs prepare.mean/std."""
    brought = modelinfo.onnx_source(train.for_task(p.task).model)
    stated = modelinfo.stated(brought) if brought else None
    if stated is not None and stated.task != p.task:
        raise UserError(f"{brought}: a {stated.task} model ({stated.by}); set prepare.task: "
                        f"{stated.task}")
    if brought is not None and stated is None and p.mean is None:
        raise UserError(f"{brought} states no preprocessing (no metadata quantpipe reads) and "
                        "prepare.mean/prepare.std are null: set them to what the model was "
                        "trained with, e.g. -S prepare.mean=imagenet, -S prepare.mean=unit "
                        "(pixel/255 as it is), or one value per channel")
    return p.for_model(stated), params.seed(), stated


if __name__ == "__main__":
    run_stage(main)
