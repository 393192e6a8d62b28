"""Helpers of the study scripts (scripts/engines.py, families.py, qat_hard.py) and the tests: run
the pipeline in a clone of the project with changed params, and the synthetic inputs the
studies share. Never imported by a stage."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from quantpipe import dvcrun

# Outlier channel of the PTQ-hard case: scale and channel of the first conv (see
# quantpipe.onnxutil.with_outlier_channel); plain ORT PTQ loses ~19 pp on it.
HARD_SCALE, HARD_CHANNEL = 300.0, 5


def merge(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def set_params(repo: Path, changes: dict) -> None:
    path = repo / "params.yaml"
    path.write_text(yaml.safe_dump(merge(yaml.safe_load(path.read_text()), changes), sort_keys=False))


def colour_folder(root: Path, n: int = 5000, size: int = 32, seed: int = 0) -> None:
    """n RGB PNGs in root/<digit>/: MNIST digits in a random colour on a random background."""
    from PIL import Image

    from quantpipe import sources

    split = sources.load_mnist5k()
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(split.y))[:n]
    for k, i in enumerate(idx):
        ink = split.x[i, 0].astype(np.float32)[..., None] / 255  # (28, 28, 1)
        fg, bg = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
        while np.abs(fg - bg).sum() < 200:  # keep the digit visible
            fg = rng.integers(0, 256, 3)
        rgb = (ink * fg + (1 - ink) * bg + rng.normal(0, 8, (28, 28, 3))).clip(0, 255)
        folder = root / str(int(split.y[i]))
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rgb.astype(np.uint8)).resize((size, size), Image.BILINEAR).save(folder / f"{k}.png")


def clone(root: Path, workdir: Path) -> tuple[Path, Path]:
    """A fresh `git clone` of root at workdir/repo (its own DVC cache: a study's runs never
    reach the project's run cache) and the log file for its DVC runs."""
    import shutil

    repo = workdir / "repo"
    if repo.exists():
        shutil.rmtree(repo)
    workdir.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "clone", "-q", str(root), str(repo)], check=True)
    return repo, workdir / "repro.log"


def dvc(repo: Path, log: Path, *args: str) -> None:
    """`dvc <args>` in repo with this interpreter's environment, output appended to log."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "DVC_NO_ANALYTICS": "1"}
    with log.open("a") as out:
        done = subprocess.run(dvcrun.command(list(args)), cwd=repo, stdout=out,
                              stderr=subprocess.STDOUT, env=env)
    if done.returncode:
        raise SystemExit(f"dvc {' '.join(args)} failed in {repo}; see {log}")


def repro(repo: Path, log: Path) -> float:
    start = time.perf_counter()
    dvc(repo, log, "repro")
    return time.perf_counter() - start


TEXTURES = ("hgrating", "vgrating", "dgrating", "checker", "dots", "rings")


def texture_folder(root: Path, per_class: int = 60, size: int = 256, seed: int = 7) -> None:
    """An image folder of RGB JPEGs at `size` px, `per_class` per texture class (TEXTURES: three
    gratings, a checkerboard, dots, rings), each a random frequency, phase and colour under
    noise: a dataset of the size people deploy classifiers at, made here (nothing downloaded)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size]
    for name in TEXTURES:
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            f, ph = rng.uniform(0.05, 0.2), rng.uniform(0, 6.28)
            # Every pattern is drawn (the rings' centre from the generator too), one kept: the
            # images of the deploy-size recipe as its check makes them, byte for byte.
            g = {"hgrating": np.sin(f * yy + ph), "vgrating": np.sin(f * xx + ph),
                 "dgrating": np.sin(f * (xx + yy) / 1.4 + ph),
                 "checker": np.sign(np.sin(f * xx)) * np.sign(np.sin(f * yy + ph)),
                 "dots": (np.sin(f * xx + ph) * np.sin(f * yy) > 0.6) * 2 - 1.0,
                 "rings": np.sin(f * np.hypot(xx - rng.uniform(0, size),
                                              yy - rng.uniform(0, size)))}[name]
            colour = rng.uniform(40, 215, 3)
            img = colour[None, None, :] + 40 * g[..., None] + rng.normal(0, 20, (size, size, 3))
            Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(root / name / f"{i:03d}.jpg",
                                                                   quality=90)
