"""The end-to-end jobs' models in Python; bench/e2e/models.h holds their C++ twins
(same layers, same parameter and buffer names, so one saved state dict
initialises both)."""
import os
import sys

import torch
from torch import nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from resnet import ResNet  # noqa: E402  (bench/resnet.py, twin of bench/resnet.h)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Gpt(nn.Module):
    """A small decoder-only transformer: token + position embeddings, pre-LN blocks, tied-free head."""

    def __init__(self, vocab, d, layers, heads, context):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def mlp(inputs=512, hidden=1024, classes=10):
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


# Sizes per job and device: (model factory, sample shapes). Kept in one place for both languages:
# bench/e2e/run.py passes them to the C++ runner on its command line.
JOBS = {
    "cnn": {"cpu": dict(width=16, image=64, batch=32), "cuda": dict(width=64, image=224, batch=128)},
    "transformer": {"cpu": dict(vocab=256, d=128, layers=2, heads=4, context=64, batch=16),
                    "cuda": dict(vocab=8192, d=512, layers=6, heads=8, context=256, batch=32)},
    "mlp": {"cpu": dict(inputs=512, hidden=1024, classes=10, batch=64),
            "cuda": dict(inputs=512, hidden=1024, classes=10, batch=64)},
}


def make(job, size):
    if job == "cnn":
        return ResNet(size["width"], 10)
    if job == "transformer":
        return Gpt(size["vocab"], size["d"], size["layers"], size["heads"], size["context"])
    if job == "mlp":
        return mlp(size["inputs"], size["hidden"], size["classes"])
    raise ValueError(f"unknown job {job!r} (cnn, transformer, mlp)")


def make_data(job, size, samples, seed=1):
    """The job's synthetic data set: (inputs, targets), identical for both languages (saved by run.py)."""
    g = torch.Generator().manual_seed(seed)
    if job == "cnn":
        x = torch.randn(samples, 3, size["image"], size["image"], generator=g)
        y = torch.randint(0, 10, (samples,), generator=g)
        return x, y
    if job == "transformer":
        tokens = torch.randint(0, size["vocab"], (samples, size["context"] + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if job == "mlp":
        x = torch.randn(samples, size["inputs"], generator=g)
        w = torch.randn(size["inputs"], size["classes"], generator=g)
        return x, (x @ w).argmax(1)  # learnable labels, so the loss falls
    raise ValueError(job)


def loss(model, x, y):
    """The jobs' loss, as train.py and e2e.cpp compute it (tools/export_compiled.py --train compiles it)."""
    out = model(x)
    return torch.nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))
