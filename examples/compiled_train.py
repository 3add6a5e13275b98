"""The Python twin of examples/compiled_train.cpp's model, and its loss.

tools/export_compiled.py compiles one training step of it (forward, loss,
backward) into a package; the C++ program trains its own Net with it. The two
definitions must agree on the parameter and buffer names and shapes (checked
when the package is opened) and on what forward computes (the C++ forward is
used for inference after training). The C++ model's initial weights are its
own: the package takes the parameters as inputs.

    python tools/export_compiled.py examples/compiled_train.py:make --train \
        --loss examples/compiled_train.py:loss --input 64,64 --input 64:int64 -o net_train.pt2
"""
import torch
import torch.nn.functional as F


class Net(torch.nn.Module):
    def __init__(self, features=64, hidden=256, classes=10, p=0.1):
        super().__init__()
        self.p = p
        self.fc1 = torch.nn.Linear(features, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc2 = torch.nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(F.dropout(F.gelu(self.norm(self.fc1(x))), self.p, self.training))


def make():
    return Net()


def loss(model, x, y):
    return F.cross_entropy(model(x), y)
