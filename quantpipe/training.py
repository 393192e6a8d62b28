"""The training loop the detection and segmentation models share: AdamW with a one-cycle
schedule over shuffled full batches, deterministic for a seed on a given machine."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn


def accumulate(batch: int, micro_batch: int | None) -> list[slice]:
    """The slices of a batch of `batch` samples run one forward/backward each: equal parts of
    at most micro_batch samples (the whole batch when it is None or larger)."""
    parts = 1 if micro_batch is None else -(-batch // micro_batch)
    size = -(-batch // parts)
    return [slice(i, min(i + size, batch)) for i in range(0, batch, size)]


def one_cycle(optimizer: torch.optim.Optimizer, lr: float, steps: int):
    """OneCycleLR with a tenth of the steps warming up, and at least two: with fewer, torch
    divides by a warm-up of zero steps (a few hundred images at batch 32: 2 epochs x 5 steps).
    Under four steps there is no cycle to run: the learning rate stays at lr."""
    if steps < 4:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps,
                                               pct_start=max(0.1, 2.0 / steps))


def fit_epochs(model: nn.Module, n_train: int, batch_loss: Callable[[torch.Tensor], torch.Tensor],
               end_epoch: Callable[[int, float, float], object], *, epochs: int, batch_size: int,
               lr: float, seed: int,
               on_step: Callable[[nn.Module, int], None] | None = None,
               micro_batch: int | None = None) -> list:
    """Train `model` for `epochs` over n_train samples: batch_loss(indices) is the loss of a
    batch (the caller reads those rows), on_step(model, step) runs after each optimizer step
    (1, 2, ...), and end_epoch(epoch, mean train loss, start time) -> the epoch's record (its
    validation scores), called with the model in eval mode. micro_batch: samples per
    forward/backward, gradients accumulated over the batch (quantpipe.budget.training_plan).
    Returns the records."""
    torch.use_deterministic_algorithms(True)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps = epochs * max(1, n_train // batch_size)
    schedule = one_cycle(optimizer, lr, steps)
    history, step = [], 0
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        model.train()
        order = torch.randperm(n_train, generator=gen)
        total = 0.0
        batches = [b for b in order.split(batch_size) if len(b) == batch_size] or [order]
        for idx in batches:
            if step >= steps:
                break
            optimizer.zero_grad()
            for part in accumulate(len(idx), micro_batch):
                loss = batch_loss(idx[part])
                share = (part.stop - part.start) / len(idx)
                (loss if share == 1 else loss * share).backward()
                total += loss.item() * (part.stop - part.start)
            optimizer.step()
            schedule.step()
            step += 1
            if on_step is not None:
                on_step(model, step)
        model.eval()
        history.append(end_epoch(epoch, round(total / sum(map(len, batches)), 6), start))
    model.eval()
    return history
