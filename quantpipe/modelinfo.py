"""What a brought ONNX model (train.model: onnx:inputs/<file>) states about its inputs.

A model is only as accurate as the pixels it is fed: standardized where it was trained on
pixel/255, or padded black where it learned grey, an Ultralytics YOLO loses tens of mAP points
before any quantization. Ultralytics' exporter writes what its models take into the ONNX file's
metadata (author, task, imgsz, stride, names, channels); prepare takes it from there. A model
that states nothing gets what params.yaml says, and with params that say nothing either prepare
stops and asks (quantpipe.modelinfo.normalization), instead of guessing the train split's
statistics for a model trained on something else.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from quantpipe.errors import UserError

# `train.model: onnx:<path>` brings an ONNX model trained elsewhere; kept under this folder,
# which prepare and export depend on, so replacing the file re-runs the pipeline.
ONNX_PREFIX = "onnx:"
INPUTS_DIR = Path("inputs")

# Ultralytics' letterbox pads with grey 114 (ultralytics.data.augment.LetterBox) and its models
# take RGB pixel/255, no mean/std (the `unit` normalization).
ULTRALYTICS_PAD = 114
# Ultralytics' task names and quantpipe's.
ULTRALYTICS_TASKS = {"detect": "detection", "classify": "classification"}

# Named normalizations of pixel/255 (prepare.mean / prepare.std). `imagenet`: torchvision's
# pretrained models'; `unit`: none at all (pixel/255 as it is: Ultralytics' models), one value
# that broadcasts to any channel count.
PRESETS = {"imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
           "unit": ((0.0,), (1.0,))}


def onnx_source(name: str) -> Path | None:
    """The ONNX file named by `onnx:<path>`, or None for a model trained here."""
    if not name.startswith(ONNX_PREFIX):
        return None
    path = Path(name[len(ONNX_PREFIX):])
    if path.is_absolute() or INPUTS_DIR not in path.parents:
        raise UserError(f"train.model = {name!r}: put the model under {INPUTS_DIR}/ (e.g. "
                        f"onnx:{INPUTS_DIR}/model.onnx) so DVC tracks it as a dependency")
    return path


@dataclass(frozen=True)
class Stated:
    """The preprocessing a model's metadata states; None where it says nothing."""
    by: str                                  # e.g. "Ultralytics 8.4.190 (inputs/yolo11n.onnx)"
    family: str | None = None                # whose conventions it follows: "ultralytics"
    task: str | None = None                  # quantpipe's name: detection, classification
    mean: tuple[float, ...] | None = None    # of pixel/255, one value broadcasting
    std: tuple[float, ...] | None = None
    image_size: int | None = None
    channels: int | None = None
    pad_value: int | None = None             # letterbox padding (0..255)
    class_names: tuple[str, ...] | None = None


def stated(path: Path) -> Stated | None:
    """What the ONNX file at `path` states about its inputs (None: nothing quantpipe reads).
    One line naming the file when it is missing or unreadable, or states what quantpipe cannot
    take (an image that is not square, a task it has no pipeline for)."""
    import onnx

    if not path.is_file():
        raise UserError(f"train.model = {ONNX_PREFIX}{path}: not found; put your ONNX file there")
    try:
        # The weights are not needed, and a model over 2 GB keeps them in a side file.
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError and friends from protobuf
        raise UserError(f"{path}: not a readable ONNX model ({type(e).__name__}); re-export it") from None
    meta = {p.key: p.value for p in model.metadata_props}
    if meta.get("author", "").startswith("Ultralytics"):
        return _ultralytics(meta, path)
    return None


def _ultralytics(meta: dict[str, str], path: Path) -> Stated:
    where = f"{path} (Ultralytics metadata)"

    def literal(key: str):
        try:
            return ast.literal_eval(meta[key]) if key in meta else None
        except (ValueError, SyntaxError):
            raise UserError(f"{where}: {key} = {meta[key]!r} is not readable; re-export the "
                            "model with Ultralytics' exporter") from None

    task = meta.get("task")
    if task not in ULTRALYTICS_TASKS:
        raise UserError(f"{where}: task {task!r}; quantpipe takes Ultralytics "
                        f"{' and '.join(ULTRALYTICS_TASKS)} models")
    imgsz = literal("imgsz")
    if isinstance(imgsz, int):
        imgsz = [imgsz, imgsz]
    if imgsz is not None and (not isinstance(imgsz, (list, tuple)) or len(set(imgsz)) != 1):
        raise UserError(f"{where}: imgsz {imgsz!r}; quantpipe feeds square images: export the "
                        "model with one imgsz, or set prepare.image_size")
    names = literal("names")
    if isinstance(names, dict):
        names = [names[k] for k in sorted(names)]
    version = meta.get("version", "")
    return Stated(by=f"Ultralytics {version} ({path})".replace("  ", " "), family="ultralytics",
                  task=ULTRALYTICS_TASKS[task], mean=PRESETS["unit"][0], std=PRESETS["unit"][1],
                  image_size=int(imgsz[0]) if imgsz else None,
                  channels=int(meta.get("channels", 3)),
                  pad_value=ULTRALYTICS_PAD if task == "detect" else None,
                  class_names=tuple(str(n) for n in names) if names else None)


def broadcast(values: tuple[float, ...], channels: int, key: str) -> tuple[float, ...]:
    """One value for every channel, or one per channel; else one line naming the key."""
    if len(values) == 1:
        return values * channels
    if len(values) != channels:
        raise UserError(f"{key} has {len(values)} values; the images have {channels} "
                        f"channel(s): give {channels} values, one value for all, or a preset "
                        f"({', '.join(PRESETS)})")
    return tuple(values)


def check_classes(stated_names: tuple[str, ...] | None, data_names: tuple[str, ...] | None,
                  by: str, where: str) -> None:
    """The model's classes must be the dataset's, in the same order."""
    if stated_names is None or data_names is None or tuple(stated_names) == tuple(data_names):
        return
    raise UserError(f"{where}: the classes {list(data_names)} differ from the "
                    f"{len(stated_names)} the model was trained on ({by}: "
                    f"{list(stated_names)}); bring the dataset the model was trained on, with "
                    "its names in the same order")
