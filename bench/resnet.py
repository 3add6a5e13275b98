"""Python twin of bench/resnet.h: the same ResNet-style CNN, the same parameter names.

Used by scripts/bench-compiled.sh (exported with tools/export_compiled.py) and by
bench/e2e (the same job in both languages)."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        h = torch.relu(self.b1(self.c1(x)))
        h = self.b2(self.c2(h))
        return torch.relu(h + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet-18-like at reduced width: stem, 4 stages of 2 blocks, pooled linear head."""

    def __init__(self, width=32, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        cin = width
        for s in range(4):
            cout = width << s
            for b in range(2):
                setattr(self, f"block{s}_{b}", Block(cin, cout, 2 if (s > 0 and b == 0) else 1))
                cin = cout
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.stem(x)
        for s in range(4):
            for b in range(2):
                x = getattr(self, f"block{s}_{b}")(x)
        return self.head(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1))


def make_resnet(width=32, classes=10):
    return ResNet(width, classes)
