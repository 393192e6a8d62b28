"""Changes to a torch model's layers that both model zoos make (quantpipe.models and
quantpipe.detection.zoo): here so that neither imports the other."""

from __future__ import annotations

from torch import nn

from quantpipe.errors import UserError


def replace_first_conv(model: nn.Module, channels: int) -> None:
    """torchvision models expect RGB; swap the stem conv for one with `channels` inputs."""
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                setattr(parent, child_name, nn.Conv2d(
                    channels, child.out_channels, child.kernel_size, child.stride, child.padding,
                    child.dilation, child.groups, child.bias is not None, child.padding_mode))
                return
    raise UserError("train.model has no Conv2d to adapt to the input channels")
