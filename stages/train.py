"""train: fit train.model on data/prepared; write models/model.pt (a state_dict) and metrics."""

import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from quantpipe import data, models  # noqa: E402
from quantpipe.io import run_stage, write_bytes, write_json  # noqa: E402
from quantpipe.params import load_params  # noqa: E402

PREPARED = Path("data/prepared")
MODEL = Path("models/model.pt")


def main() -> None:
    params = load_params()
    p = params.train
    models.check_model_name(p.model)
    if models.onnx_source(p.model):
        # Nothing to train: the export stage takes the ONNX file. DVC still needs this stage's
        # outputs, so they say so: an empty state_dict and a metrics file naming the source.
        write_bytes(MODEL, models.state_dict_bytes(torch.nn.Module()))
        write_json("metrics/train.json", {"model": p.model, "skipped": "model brought as ONNX"})
        write_json("metrics/plots/train_curve.json", [])
        print(f"train: skipped, the model comes from {p.model}")
        return
    info = data.load_info(PREPARED)
    train, val = data.load_split(PREPARED, "train"), data.load_split(PREPARED, "val")
    torch.manual_seed(params.seed)
    model = models.build_model(p.model, info.channels, info.image_size, info.num_classes)
    history = models.train_model(
        model, data.normalize(train.x, info), train.y, data.normalize(val.x, info), val.y,
        epochs=p.epochs, batch_size=p.batch_size, lr=p.lr, max_shift=p.max_shift,
        seed=params.seed)
    write_bytes(MODEL, models.state_dict_bytes(model))
    last = history[-1]
    write_json("metrics/train.json", {
        "model": p.model, "parameters": sum(t.numel() for t in model.parameters()),
        "val_accuracy": last.val_accuracy, "val_loss": last.val_loss,
        "train_loss": last.train_loss, "seconds": round(sum(h.seconds for h in history), 2)})
    write_json("metrics/plots/train_curve.json", [asdict(h) for h in history])
    print(f"train: {p.model}, val accuracy {last.val_accuracy:.4f} -> {MODEL}")


if __name__ == "__main__":
    run_stage(main)
