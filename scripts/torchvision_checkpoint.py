"""Train a torchvision classifier on an image folder the way it is done outside quantpipe, and save
the state_dict that `train.weights` takes: the model you already have, for trying that path.

    python scripts/torchvision_checkpoint.py --folder inputs/flowers --model resnet18 \\
        --epochs 1 --resize 256 --crop 224 --out inputs/resnet18.pth [--predictions preds.json]

Plain torchvision, nothing of quantpipe: ImageFolder, RandomResizedCrop + flip for training,
Resize(resize) + CenterCrop(crop) + ImageNet normalization for evaluation (torchvision's
reference recipe). --predictions writes the checkpoint's own top-1 class of every image under
the evaluation transform ({path relative to the folder: class}), which quantpipe's FP32 ONNX
model must reproduce (tests/test_checkpoint_pipeline.py). Then, in quantpipe:

    dvc exp run -S prepare.source=imagefolder -S prepare.path=inputs/flowers \\
        -S prepare.resize=256 -S prepare.crop=224 -S prepare.mean=imagenet \\
        -S train.model=resnet18 -S train.weights=inputs/resnet18.pth -S train.epochs=0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torchvision
from torchvision import transforms

IMAGENET = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}


def eval_transform(resize: int, crop: int):
    return transforms.Compose([transforms.Resize(resize), transforms.CenterCrop(crop),
                               transforms.ToTensor(), transforms.Normalize(**IMAGENET)])


def train(folder: Path, model_name: str, epochs: int, resize: int, crop: int, lr: float,
          batch_size: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    data = torchvision.datasets.ImageFolder(str(folder), transform=transforms.Compose([
        transforms.RandomResizedCrop(crop, scale=(0.5, 1.0)), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(**IMAGENET)]))
    model = torchvision.models.get_model(model_name, weights=None, num_classes=len(data.classes))
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    model.train()
    for epoch in range(epochs):
        total, seen = 0.0, 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total, seen = total + loss.item() * len(y), seen + len(y)
        print(f"epoch {epoch + 1}/{epochs}: loss {total / max(seen, 1):.4f}")
    return model.eval()


@torch.no_grad()
def predictions(model: torch.nn.Module, folder: Path, resize: int, crop: int) -> dict[str, int]:
    """Top-1 class of every image of the folder under the evaluation transform."""
    data = torchvision.datasets.ImageFolder(str(folder), transform=eval_transform(resize, crop))
    model.eval()
    out = {}
    for (path, _), (x, _) in zip(data.samples, data):
        out[Path(path).relative_to(folder).as_posix()] = int(model(x[None]).argmax(1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, required=True, help="<folder>/<class>/<image>")
    parser.add_argument("--model", default="resnet18", help="a torchvision classification model")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--resize", type=int, default=256)
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="where the state_dict goes")
    parser.add_argument("--predictions", type=Path, help="write the checkpoint's predictions here")
    args = parser.parse_args()
    model = train(args.folder, args.model, args.epochs, args.resize, args.crop, args.lr,
                  args.batch_size, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), args.out)
    print(f"state_dict of {args.model} -> {args.out}")
    if args.predictions:
        args.predictions.write_text(json.dumps(predictions(model, args.folder, args.resize,
                                                           args.crop), indent=1) + "\n")


if __name__ == "__main__":
    main()
