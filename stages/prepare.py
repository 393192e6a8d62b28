"""prepare: load the dataset, split it (stratified, seeded) and draw the calibration set.

Outputs: data/prepared/ (train/val/test .npy + meta.json) and data/calibration/ (calib .npy,
their indices into train, meta.json), separate so that a calibration change leaves the
training data's hash alone.
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantpipe import data  # noqa: E402
from quantpipe.io import atomic_path, run_stage, write_json  # noqa: E402
from quantpipe.params import load_params  # noqa: E402

PREPARED = Path("data/prepared")
CALIBRATION = Path("data/calibration")


def main() -> None:
    params = load_params()
    p = params.prepare
    full, class_names = data.load_source(p.source, p.path, p.channels, p.image_size)
    num_classes = data.check_dataset(full, p.path or p.source)
    splits = {name: full.take(idx) for name, idx in data.stratified_split(
        full.y, p.val_fraction, p.test_fraction, seed=params.seed).items()}
    info = data.compute_info(p.source, splits["train"], num_classes, class_names,
                             None if p.mean is None else (p.mean, p.std))
    calib_index = data.calibration_indices(len(splits["train"]), p.calib_size, seed=params.seed)
    calib = splits["train"].take(calib_index)

    with atomic_path(PREPARED, is_dir=True) as tmp:
        data.save_splits(tmp, splits, info)
    with atomic_path(CALIBRATION, is_dir=True) as tmp:
        data.save_splits(tmp, {"calib": calib}, info)
        # quantize_static scores models on the train images that did not calibrate them.
        np.save(tmp / data.CALIB_INDEX, calib_index)
    write_json("metrics/prepare.json", {
        "source": p.source, "num_classes": num_classes, "input_shape": list(info.input_shape),
        **{f"{name}_samples": len(split) for name, split in splits.items()},
        "calib_samples": len(calib)})
    print(f"prepare: {', '.join(f'{n} {len(s)}' for n, s in splits.items())}, "
          f"calibration {len(calib)} -> {PREPARED}, {CALIBRATION}")


if __name__ == "__main__":
    run_stage(main)
