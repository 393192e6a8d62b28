"""Real Ultralytics-exported YOLO ONNX graphs as test fixtures (YOLOv8n- and YOLO11n-style,
width-reduced), trained on the digit canvases and exported with Ultralytics' own exporter.

Ultralytics is AGPL-3.0 and is NOT a dependency of quantpipe or of its test environment:
this script runs with the Python of a separate venv made by scripts/ultralytics_env.sh,
never with the project's .venv. The files it writes are outputs of a training run; using
them needs no Ultralytics.

    VENV=$(bash scripts/ultralytics_env.sh | tail -n 1)
    .venv/bin/python -m quantpipe.detection.folders yolo /tmp/digits64 --size 64 --classes 3
    $VENV/bin/python scripts/ultralytics_fixtures.py --data /tmp/digits64 \\
        --out tests/fixtures/ultralytics

Without --data the folder is written first by `--quantpipe-python` (default: .venv/bin/python
of this checkout) running the same quantpipe.detection.folders command.

Fully offline: it sets YOLO_OFFLINE=1 (ultralytics.utils.is_online() then answers False, so no
AutoUpdate, version check, analytics or Sentry), YOLO_AUTOINSTALL=0 (check_requirements() only
warns instead of pip-installing; the env script pre-installs everything the exporter checks),
a YOLO_CONFIG_DIR of its own with settings sync=False and every logger integration off, and puts
a TrueType font (matplotlib's DejaVuSans) at <config>/Arial.ttf, because check_det_dataset()
calls check_font("Arial.ttf") unconditionally, and that issues an HTTP HEAD to the assets
host when the font is missing. Training uses plots=False, amp=False and device=cpu.

--study (second priority, slow): trains FULL-width yolo11n and yolov8n (scale n) at 128 px on
a --size 128 digits folder, exports ONNX (dynamic), OpenVINO FP32 and OpenVINO INT8 (Ultralytics'
NNCF path) and runs Ultralytics' validator on each (val split); results go to
$HOME/.cache/quantpipe-ultralytics/study/study.json (not into the repository).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("QP_ULTRALYTICS_CACHE",
                            Path.home() / ".cache" / "quantpipe-ultralytics"))

# Family -> (Ultralytics' model yaml inside the package, depth, width, max_channels).
# Depth is Ultralytics' own n depth; width 1/16 keeps each file near 1.4 MB. C2PSA keeps its
# attention (num_heads = max(c // 64, 1) = 1).
FIXTURES = {
    "yolov8n": ("cfg/models/v8/yolov8.yaml", 0.33, 0.0625, 1024),
    "yolo11n": ("cfg/models/11/yolo11.yaml", 0.50, 0.0625, 1024),
}
EPOCHS = {"yolov8n": 150, "yolo11n": 150}
IMGSZ = 64
STUDY_IMGSZ = 128
STUDY_EPOCHS = 200
TRAIN_ARGS = dict(batch=16, workers=0, device="cpu", seed=0, deterministic=True, plots=False,
                  amp=False, fliplr=0.0, verbose=True)  # digits are not mirror-symmetric


def offline_env(config_dir: Path) -> None:
    """Environment that must be in place before `import ultralytics`."""
    os.environ["YOLO_OFFLINE"] = "1"
    os.environ["YOLO_AUTOINSTALL"] = "0"
    os.environ["YOLO_CONFIG_DIR"] = str(config_dir)
    os.environ.pop("ULTRALYTICS_API_KEY", None)  # Platform callbacks only run with a key


def offline_settings(work: Path) -> None:
    import matplotlib
    from ultralytics import settings
    from ultralytics.utils import USER_CONFIG_DIR

    font = USER_CONFIG_DIR / "Arial.ttf"
    if not font.exists():
        shutil.copy(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf", font)
    settings.update(sync=False, api_key="", clearml=False, comet=False, dvc=False, mlflow=False,
                    raytune=False, tensorboard=False, wandb=False, vscode_msg=False,
                    openvino_msg=False, datasets_dir=str(work / "datasets"),
                    weights_dir=str(work / "weights"), runs_dir=str(work / "runs"))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def dataset_digest(root: Path) -> str:
    """sha256 over data.yaml and every image/label file (relative path + bytes), sorted."""
    h = hashlib.sha256()
    files = [root / "data.yaml"] + sorted(
        p for d in ("images", "labels") for p in (root / d).rglob("*")
        if p.is_file() and p.suffix != ".cache")  # Ultralytics writes labels/<split>.cache
    for p in files:
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def model_yaml(family: str, nc: int, work: Path, full_width: bool = False) -> tuple[Path, dict]:
    """Ultralytics' own model yaml with only `scales` (unless full_width) and nc replaced, saved as
    <family>.yaml so that Ultralytics' guess_model_scale() picks scale 'n' from the file name."""
    import ultralytics
    import yaml

    rel, depth, width, max_ch = FIXTURES[family]
    d = yaml.safe_load((Path(ultralytics.__file__).parent / rel).read_text())
    if not full_width:
        d["scales"] = {"n": [depth, width, max_ch]}
    d["nc"] = nc
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"{family}.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path, {"source": f"ultralytics/{rel}", "scale": "n",
                  "depth_width_max_channels": d["scales"]["n"], "nc": nc}


def metrics(r) -> dict:
    return {"mAP50-95": round(float(r.box.map), 4), "mAP50": round(float(r.box.map50), 4),
            "precision": round(float(r.box.mp), 4), "recall": round(float(r.box.mr), 4)}


def onnx_facts(path: Path, nc: int) -> dict:
    """Opset, metadata_props, op-type counts and onnxruntime output shapes (batch 1 and 4)."""
    from collections import Counter

    import numpy as np
    import onnx
    import onnxruntime as ort

    m = onnx.load(str(path))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    y1 = sess.run(None, {name: np.zeros((1, 3, IMGSZ, IMGSZ), np.float32)})[0]
    y4 = sess.run(None, {name: np.zeros((4, 3, IMGSZ, IMGSZ), np.float32)})[0]
    outs = {"batch1": list(y1.shape), "batch4": list(y4.shape),
            "batch_consistent": bool(np.allclose(y4, np.repeat(y1, 4, axis=0), atol=1e-5))}
    assert y1.shape[1] == 4 + nc and y4.shape[0] == 4 and outs["batch_consistent"], outs
    return {
        "opset": {o.domain or "ai.onnx": o.version for o in m.opset_import},
        "ir_version": m.ir_version,
        "producer": f"{m.producer_name} {m.producer_version}",
        "inputs": [(i.name, [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim])
                   for i in m.graph.input],
        "outputs": [(o.name, [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim])
                    for o in m.graph.output],
        "ort_output_shapes": outs,
        "nodes": len(m.graph.node),
        "op_types": dict(sorted(Counter(n.op_type for n in m.graph.node).items())),
        "metadata_props": {p.key: p.value for p in m.metadata_props},
    }


def train(family: str, data_yaml: Path, nc: int, work: Path, imgsz: int, epochs: int,
          full_width: bool = False):
    from ultralytics import YOLO

    cfg, model_info = model_yaml(family, nc, work / "models", full_width)
    model = YOLO(str(cfg))
    params = sum(p.numel() for p in model.model.parameters())
    t = time.time()
    model.train(data=str(data_yaml), imgsz=imgsz, epochs=epochs, project=str(work / "runs"),
                name=family, exist_ok=True, **TRAIN_ARGS)
    best = Path(model.trainer.best)
    return best, model_info, params, round(time.time() - t, 1)


def fixtures(args) -> None:
    from ultralytics import YOLO, __version__

    data, cmd = data_folder(args, IMGSZ)
    data_yaml = data / "data.yaml"
    nc = len(__import__("yaml").safe_load(data_yaml.read_text())["names"])
    args.out.mkdir(parents=True, exist_ok=True)
    record = args.out / "fixtures.json"
    kept = json.loads(record.read_text())["models"] if record.exists() else {}  # other families
    doc = {"ultralytics": __version__, "imgsz": IMGSZ, "dataset": {
        "command": " ".join(["python"] + cmd[1:3] + ["yolo", "DIR"] + cmd[5:]),
        "sha256": dataset_digest(data), "nc": nc,
        "images": {s: len(list((data / "images" / s).glob("*.png")))
                   for s in ("train", "val", "test")}},
        "train_args": TRAIN_ARGS, "models": kept}
    for family in args.families:
        epochs = args.epochs or EPOCHS[family]
        best, model_info, params, seconds = train(family, data_yaml, nc, args.work, IMGSZ, epochs)
        pt = YOLO(str(best)).val(data=str(data_yaml), imgsz=IMGSZ, batch=16, split="val",
                                 plots=False, device="cpu")
        onnx_path = Path(YOLO(str(best)).export(format="onnx", imgsz=IMGSZ, dynamic=True,
                                                device="cpu"))
        target = args.out / f"{family}.onnx"
        shutil.copy(onnx_path, target)
        val = YOLO(str(target)).val(data=str(data_yaml), imgsz=IMGSZ, batch=16, split="val",
                                    plots=False, device="cpu")
        facts = onnx_facts(target, nc)
        doc["models"][family] = {
            "file": target.name, "bytes": target.stat().st_size, "sha256": sha256(target),
            "model_yaml": model_info, "params": params, "epochs": epochs,
            "train_seconds": seconds,
            "export_args": {"format": "onnx", "imgsz": IMGSZ, "dynamic": True},
            "val_split": "val", "val_pt": metrics(pt), "val_onnx": metrics(val), **facts,
            "test_onnx": test_scores(target, data_yaml, IMGSZ)}
        record.write_text(json.dumps(doc, indent=2) + "\n")
        print(json.dumps({family: doc["models"][family]}, indent=2))


def test_scores(onnx_path: Path, data_yaml: Path, imgsz: int) -> dict:
    """The validator on the test split (the split quantpipe reports on when a dataset declares
    one), as `yolo val` runs by default and with rect=False. By default it letterboxes each
    batch to its images' shape plus half a stride of padding (rect=True, pad 0.5: 64 px
    canvases are scored at 96 px); rect=False scores them at imgsz, as Ultralytics' predict
    feeds an exported model, and as quantpipe does."""
    from ultralytics import YOLO

    return {f"rect_{rect}".lower(): metrics(YOLO(str(onnx_path), task="detect").val(
        data=str(data_yaml), imgsz=imgsz, batch=16, split="test", rect=rect, plots=False,
        device="cpu")) for rect in (True, False)}


def rescore(args) -> None:
    """--rescore: the validator's test-split scores of the fixtures already in --out, recorded
    in fixtures.json (no training)."""
    data, _ = data_folder(args, IMGSZ)
    record = args.out / "fixtures.json"
    doc = json.loads(record.read_text())
    for family, entry in doc["models"].items():
        entry["test_onnx"] = test_scores(args.out / entry["file"], data / "data.yaml", IMGSZ)
    record.write_text(json.dumps(doc, indent=2) + "\n")


def data_folder(args, size: int) -> tuple[Path, list[str]]:
    python = args.quantpipe_python
    cmd = [str(python), "-m", "quantpipe.detection.folders", "yolo", "DIR", "--size", str(size),
           "--classes", "3"]
    if args.data is not None:
        return args.data.resolve(), cmd
    data = args.work / "data" / f"digits{size}"
    if not (data / "data.yaml").exists():
        subprocess.run([str(data) if c == "DIR" else c for c in cmd], check=True, cwd=REPO)
    return data, cmd


def study(args) -> None:
    """Full-width yolo11n / yolov8n at 128 px: ONNX, OpenVINO FP32 and OpenVINO INT8 (NNCF)."""
    from ultralytics import YOLO, __version__

    data, cmd = data_folder(args, STUDY_IMGSZ)
    data_yaml = data / "data.yaml"
    nc = len(__import__("yaml").safe_load(data_yaml.read_text())["names"])
    out = args.work
    result_file = out / "study.json"
    doc = {"ultralytics": __version__, "imgsz": STUDY_IMGSZ,
           "dataset": {"command": " ".join(["python"] + cmd[1:3] + ["yolo", "DIR"] + cmd[5:]),
                       "path": str(data), "sha256": dataset_digest(data)},
           "train_args": TRAIN_ARGS, "models": {}}
    if result_file.exists():  # --families re-trains those and keeps the others of the same data
        before = json.loads(result_file.read_text())
        if before.get("dataset", {}).get("sha256") == doc["dataset"]["sha256"]:
            doc["models"] = {k: v for k, v in before.get("models", {}).items()
                             if k not in args.families}
    for family in args.families:
        epochs = args.epochs or STUDY_EPOCHS
        best, model_info, params, seconds = train(family, data_yaml, nc, out, STUDY_IMGSZ, epochs,
                                                  full_width=True)
        rec = {"model_yaml": model_info, "params": params, "epochs": epochs,
               "train_seconds": seconds, "best": str(best), "val": {}}
        doc["models"][family] = rec

        def run(key, make, batch=16):
            """Export (make) then Ultralytics' validator on the val split; errors are recorded."""
            try:
                path = Path(make())
                r = YOLO(str(path)).val(data=str(data_yaml), imgsz=STUDY_IMGSZ, batch=batch,
                                        split="val", plots=False, device="cpu")
                rec["val"][key] = {"path": str(path), **metrics(r)}
            except Exception as e:  # keep the other exports' results
                rec["val"][key] = {"error": f"{type(e).__name__}: {e}"}
            result_file.write_text(json.dumps(doc, indent=2) + "\n")
            return rec["val"][key].get("path")

        def export(**kw):
            return YOLO(str(best)).export(imgsz=STUDY_IMGSZ, device="cpu", **kw)

        def int8_calibrated_on(split):
            """OpenVINO INT8 through Ultralytics' NNCF path; its calibration split defaults to
            'val' (Exporter.get_int8_calibration_dataloader: split = self.args.split or "val")."""
            kw = {} if split == "val" else {"split": split}
            path = Path(export(format="openvino", int8=True, data=str(data_yaml), **kw))
            moved = path.with_name(f"{path.name.rstrip('/')}_calib_{split}")
            shutil.rmtree(moved, ignore_errors=True)
            return path.rename(moved)

        run("pt", lambda: best)
        run("onnx", lambda: export(format="onnx", dynamic=True))
        run("openvino_fp32", lambda: export(format="openvino"))
        run("openvino_int8_calib_val", lambda: int8_calibrated_on("val"))
        run("openvino_int8_calib_train", lambda: int8_calibrated_on("train"))
        rec["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        result_file.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=None,
                    help="Ultralytics-layout digits folder (quantpipe.detection.folders yolo)")
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "ultralytics")
    ap.add_argument("--work", type=Path, default=None,
                    help="runs, models and settings (default: $HOME/.cache/quantpipe-ultralytics/"
                         "fixtures, or .../study with --study)")
    ap.add_argument("--families", nargs="+", default=list(FIXTURES), choices=list(FIXTURES))
    ap.add_argument("--epochs", type=int, default=None, help="override the per-family epochs")
    ap.add_argument("--quantpipe-python", type=Path, default=REPO / ".venv" / "bin" / "python",
                    help="python with quantpipe, used only to write the digits folder")
    ap.add_argument("--study", action="store_true",
                    help="full-width 128 px study with OpenVINO INT8 export (slow)")
    ap.add_argument("--rescore", action="store_true",
                    help="only the validator's test-split scores of the fixtures in --out")
    args = ap.parse_args(argv)
    args.work = (args.work or CACHE / ("study" if args.study else "fixtures")).resolve()
    args.out = args.out.resolve()
    offline_env(CACHE / "config")
    offline_settings(args.work)
    (study if args.study else rescore if args.rescore else fixtures)(args)


if __name__ == "__main__":
    sys.exit(main())
