"""ResNet-50 as a flat list of 18 blocks: stem, 16 bottlenecks, head. No torchvision needed.

Shapes: (B, 3, H, W) -> stem (B, 64, H/4, W/4) -> ... -> (B, 2048, H/32, W/32) -> head (B, classes).
Same layer layout and initialisation as torchvision's resnet50 (v1.5: stride on the 3×3 conv).
"""

from __future__ import annotations

import torch
from torch import nn


class Stem(nn.Sequential):
    def __init__(self):
        super().__init__(
            nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1):
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or in_ch != out_ch:
            self.down = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class Head(nn.Module):
    def __init__(self, num_classes: int):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 2048, h, w) -> (B, classes)
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet50(num_classes: int = 1000) -> list[nn.Module]:
    """ResNet-50 blocks: [Stem, 3 + 4 + 6 + 3 Bottlenecks, Head]."""
    blocks: list[nn.Module] = [Stem()]
    in_ch = 64
    for width, n, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(n):
            blocks.append(Bottleneck(in_ch, width, stride if i == 0 else 1))
            in_ch = width * Bottleneck.expansion
    blocks.append(Head(num_classes))
    for m in nn.ModuleList(blocks).modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    return blocks
