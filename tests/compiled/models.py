"""The models perf's CompiledModel tests export (tests/compiled/make_packages.py)."""
import torch


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 64)
        self.fc2 = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Cnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(16)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.fc = torch.nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1))


class TwoInTwoOut(torch.nn.Module):
    """Token ids (int64) and features (float) in; per-token logits and pooled features out."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.proj = torch.nn.Linear(8, 5)

    def forward(self, tokens, feats):
        h = self.embed(tokens) + feats.unsqueeze(1)
        return self.proj(h), h.mean(dim=1)


def make_mlp():
    return Mlp()


def make_cnn():
    m = Cnn()
    with torch.no_grad():  # non-trivial running statistics, so freezing BN is exercised
        m.bn1.running_mean.uniform_(-0.5, 0.5)
        m.bn1.running_var.uniform_(0.5, 2.0)
    return m


def make_two_in_two_out():
    return TwoInTwoOut()
