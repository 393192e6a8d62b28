"""train: fit train.model on data/prepared; write models/model.pt (a state_dict) and metrics."""

from dataclasses import asdict

import torch

from quantpipe import data, models, params
from quantpipe.io import run_stage, stage_args, write_bytes, write_json
from quantpipe.schemas.detect import DetectParams
from quantpipe.schemas.train import TrainParams


def main(argv: list[str]) -> None:
    args = stage_args("train", argv, "data", "model", "metrics", "curve")
    p, seed = params.load(TrainParams), params.seed()  # a bad key stops before the data is read
    info = data.load_info(args.data)
    p = p.for_task(info.task)
    models.check_model_name(p.model, info.task)
    if models.onnx_source(p.model):
        # Nothing to train: the export stage takes the ONNX file. DVC still needs this stage's
        # outputs, so they say so: an empty state_dict and a metrics file naming the source.
        write_bytes(args.model, models.state_dict_bytes(torch.nn.Module()))
        write_json(args.metrics, {"model": p.model, "skipped": "model brought as ONNX"})
        write_json(args.curve, [])
        print(f"train: skipped, the model comes from {p.model}")
        return
    train, val = data.load_split(args.data, "train"), data.load_split(args.data, "val")
    torch.manual_seed(seed)
    model = models.build_model(p.model, info.channels, info.image_size, info.num_classes)
    x_train, x_val = data.normalize(train.x, info), data.normalize(val.x, info)
    if info.task == "detection":
        from quantpipe.detection import task
        from quantpipe.detection.model import train_detector

        detect = params.load(DetectParams)

        def val_map_50(m: torch.nn.Module) -> float:
            with torch.no_grad():
                out = models.predict_torch(m, x_val)
            return task.scored(out, val, info, detect)[0]["map_50"]

        history = train_detector(model, x_train, train.objects, x_val, val.objects,
                                 epochs=p.epochs, batch_size=p.batch_size, lr=p.lr, seed=seed,
                                 score_map_50=val_map_50)
        summary = {"val_map_50": history[-1].val_map_50}
    else:
        history = models.train_model(model, x_train, train.y, x_val, val.y, epochs=p.epochs,
                                     batch_size=p.batch_size, lr=p.lr, max_shift=p.max_shift,
                                     seed=seed)
        summary = {"val_accuracy": history[-1].val_accuracy}
    write_bytes(args.model, models.state_dict_bytes(model))
    last = history[-1]
    write_json(args.metrics, {
        "model": p.model, "parameters": sum(t.numel() for t in model.parameters()), **summary,
        "val_loss": last.val_loss, "train_loss": last.train_loss,
        "seconds": round(sum(h.seconds for h in history), 2)})
    write_json(args.curve, [asdict(h) for h in history])
    print(f"train: {p.model}, " + ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in summary.items())
          + f" -> {args.model}")


if __name__ == "__main__":
    run_stage(main)
