"""train: fit train.model on data/prepared; write models/model.pt (a state_dict) and metrics."""

import time
from dataclasses import asdict

import torch

from quantpipe import budget, data, models, params
from quantpipe.tasks import bind
from quantpipe.io import resources, run_stage, stage_args, write_bytes, write_json
from quantpipe.schemas.train import TrainParams


def main(argv: list[str]) -> None:
    args = stage_args("train", argv, "data", "model", "metrics", "curve")
    p, seed = params.load(TrainParams), params.seed()  # a bad key stops before the data is read
    info = data.load_info(args.data)
    p = p.for_task(info.task)
    bind.check_model(info.task, p.model)
    if models.onnx_source(p.model):
        # Nothing to train: the export stage takes the ONNX file. DVC still needs this stage's
        # outputs, so they say so: an empty state_dict and a metrics file naming the source.
        write_bytes(args.model, models.state_dict_bytes(torch.nn.Module()))
        write_json(args.metrics, {"model": p.model, "skipped": "model brought as ONNX"})
        write_json(args.curve, [])
        print(f"train: skipped, the model comes from {p.model}")
        return
    weights = models.weights_source(p.weights, p.model) if p.weights else None
    train, val = data.load_split(args.data, "train"), data.load_split(args.data, "val")
    torch.manual_seed(seed)
    model = models.build_model(p.model, info.channels, info.image_size, info.num_classes)
    if weights:
        models.load_checkpoint(model, weights, p.model, info.num_classes)
    x_train, x_val = data.Normalized(train.x, info), data.Normalized(val.x, info)
    task = bind.for_data(info)
    start = time.perf_counter()
    # Micro-batches (gradients accumulated to train.batch_size) that fit the memory budget.
    memory = budget.load()
    plan = models.training_plan(memory, model, info.input_shape, p.batch_size,
                                what=f"train ({p.model} at {info.image_size} px)", key="train.batch_size")
    # The checkpoint's own scores: what epochs 0 ships, what fine-tuning starts from.
    brought = {}
    if weights:
        test = data.load_split(args.data, "test")
        for name, (x, split) in {"val": (x_val, val),
                                 "test": (data.Normalized(test.x, info), test)}.items():
            brought.update({f"{name}_{k}": v for k, v in task.torch_scores(
                model, x, split, batch_size=plan.eval_batch).items()})
    history = task.fit(model, x_train, train, x_val, val, epochs=p.epochs, batch_size=p.batch_size,
                       lr=p.lr, max_shift=p.max_shift, seed=seed, plan=plan) if p.epochs else []
    if history:
        last = history[-1]
        summary = {task.history_key: getattr(last, task.history_key), "val_loss": last.val_loss,
                   "train_loss": last.train_loss,
                   **({"checkpoint": brought} if weights else {})}
    else:
        summary = brought
    write_bytes(args.model, models.state_dict_bytes(model))
    write_json(args.metrics, {
        "model": p.model, **({"weights": p.weights} if weights else {}), "epochs": p.epochs,
        "parameters": sum(t.numel() for t in model.parameters()), **summary, **plan.record,
        "seconds": round(time.perf_counter() - start, 2),
        # Images through the model: every epoch's training set, and the brought weights' scoring.
        "resources": resources(p.epochs * len(train) + (len(val) + len(test) if weights else 0),
                               time.perf_counter() - start, memory.total_mb)})
    write_json(args.curve, [asdict(h) for h in history])
    shown = {k: v for k, v in summary.items() if isinstance(v, float)}
    print(f"train: {p.model}{f' from {weights}' if weights else ''}, {p.epochs} epoch(s), "
          + ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in shown.items())
          + f" -> {args.model}")


if __name__ == "__main__":
    run_stage(main)
