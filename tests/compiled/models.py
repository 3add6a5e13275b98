"""The models perf's CompiledModel tests export (tests/compiled/make_packages.py); their C++ twins,
with the same parameter and buffer names, are in models.h."""
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
        self.conv1 = torch.nn.Conv2d(3, 16, 3, padding=1, bias=False)  # BatchNorm follows
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


def make_cnn_frozen():
    """make_cnn with its parameters frozen (requires_grad_(False)), as an inference model often is: such
    parameters met AOTInductor's stale plan for CUDA channels-last convolutions (tests/test_compiled.cpp)."""
    return make_cnn().requires_grad_(False)


def make_two_in_two_out():
    return TwoInTwoOut()


class TinyGpt(torch.nn.Module):
    """One pre-LN transformer block with dropout, for compiled training (twin in tests/test_compiled_train.cpp)."""

    def __init__(self, vocab=32, d=16, heads=2, context=8, p=0.1):
        super().__init__()
        self.heads, self.p = heads, p
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(context, d)
        self.ln1 = torch.nn.LayerNorm(d)
        # No qkv bias: its key third has no gradient (softmax ignores it), so two programs'
        # rounding noise would walk it apart under Adam, as it does a convolution bias before BatchNorm.
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        b, t = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + torch.nn.functional.dropout(self.proj(a.transpose(1, 2).reshape(b, t, -1)), self.p, self.training)
        x = x + torch.nn.functional.dropout(self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x)))), self.p,
                                            self.training)
        return self.head(x)


def make_tiny_gpt():
    return TinyGpt()


def classify_loss(model, x, y):
    """Cross-entropy over the last dimension (one class per row, or per token)."""
    out = model(x)
    return torch.nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))
