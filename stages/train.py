"""train: fit train.model on data/prepared; write models/model.pt (a state_dict) and metrics."""

from dataclasses import asdict

import torch

from quantpipe import data, models, params
from quantpipe.io import run_stage, stage_args, write_bytes, write_json
from quantpipe.schemas.train import TrainParams


def main(argv: list[str]) -> None:
    args = stage_args("train", argv, "data", "model", "metrics", "curve")
    p, seed = params.load(TrainParams), params.seed()
    models.check_model_name(p.model)
    if models.onnx_source(p.model):
        # Nothing to train: the export stage takes the ONNX file. DVC still needs this stage's
        # outputs, so they say so: an empty state_dict and a metrics file naming the source.
        write_bytes(args.model, models.state_dict_bytes(torch.nn.Module()))
        write_json(args.metrics, {"model": p.model, "skipped": "model brought as ONNX"})
        write_json(args.curve, [])
        print(f"train: skipped, the model comes from {p.model}")
        return
    info = data.load_info(args.data)
    train, val = data.load_split(args.data, "train"), data.load_split(args.data, "val")
    torch.manual_seed(seed)
    model = models.build_model(p.model, info.channels, info.image_size, info.num_classes)
    history = models.train_model(
        model, data.normalize(train.x, info), train.y, data.normalize(val.x, info), val.y,
        epochs=p.epochs, batch_size=p.batch_size, lr=p.lr, max_shift=p.max_shift,
        seed=seed)
    write_bytes(args.model, models.state_dict_bytes(model))
    last = history[-1]
    write_json(args.metrics, {
        "model": p.model, "parameters": sum(t.numel() for t in model.parameters()),
        "val_accuracy": last.val_accuracy, "val_loss": last.val_loss,
        "train_loss": last.train_loss, "seconds": round(sum(h.seconds for h in history), 2)})
    write_json(args.curve, [asdict(h) for h in history])
    print(f"train: {p.model}, val accuracy {last.val_accuracy:.4f} -> {args.model}")


if __name__ == "__main__":
    run_stage(main)
