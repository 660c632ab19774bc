"""Job file: ResNet-18 (torchvision's and timm's layout) with BatchNorm, trained with AdamW on random images.

Run it with ``shardlang run examples/resnet.py --nproc 2``; check it with
``shardlang check examples/resnet.py --world-sizes 1,2,4 --dtype float64``.

What makes it a test of ``shardlang check``: under AdamW, the rounding noise of
near-zero gradients (BatchNorm's biases, the deep layers' weights) becomes
parameter changes of order lr with a random sign, so two correct runs that sum in
different orders differ by about 1e-9 in float64 after a few steps: the one-process
reference with its rows reversed differs from itself by 1.3e-9 after 8 steps,
above the fixed float64 tolerance (1e-9). `check` measures that floor and passes
a world size within 10 times it (docs/cli.md, "The noise floor").

Module names (the spec's units refer to them): ``conv1``, ``bn1``,
``layer{1..4}.{0,1}.{conv1,bn1,conv2,bn2,downsample.0,downsample.1}``, ``fc``.
BatchNorm runs in training mode, synchronised over the ranks (its batch
statistics are those of the global batch, as one process computes them).
"""

from __future__ import annotations

import torch
from torch import nn

import shardlang as sl

GLOBAL_BATCH = 8  # divides by 1, 2 and 4
IMAGE = 64  # pixels a side: small enough for a CPU, large enough for every stage to keep a spatial extent
CLASSES = 10


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm, and the identity (or a 1x1 projection) added back."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    """The stem (7x7 convolution, BatchNorm, max-pool), four stages of two blocks, global pooling, a classifier."""

    def __init__(self, classes: int = CLASSES):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        c_in = 64
        for i, c in enumerate((64, 128, 256, 512)):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(c_in, c, stride), BasicBlock(c, c)))
            c_in = c
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(x.mean((2, 3)))


def build_model() -> nn.Module:
    return ResNet18()


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return nn.functional.cross_entropy(model(images), labels)


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: random images and labels, the same at every world size."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 3, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (GLOBAL_BATCH,),
                                                                                   generator=g)


spec = sl.Spec(mesh=sl.Mesh(fsdp=-1), units=["layer1.*", "layer2.*", "layer3.*", "layer4.*"])
optimizer = sl.AdamW(lr=1e-3)
