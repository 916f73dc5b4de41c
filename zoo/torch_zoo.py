"""A zoo of small PyTorch architectures for checking graphopt's training-graph builder
against torch autograd (tests/test_builder_vs_torch.py).

Each entry of ``ZOO`` is a constructor returning a ``ZooEntry``: the module (seeded,
deterministic), its inputs (name -> tensor, in the order of ``forward``'s arguments), the
loss kind for ``build_training_graph`` ("cross_entropy" or "mse") and the labels tensor.
The modules return the prediction only (logits, or the image for the U-Net): the loss is
the builder's job.

``export(entry)`` exports with the legacy (TorchScript) exporter the way model zoos hold
models: eval mode (BatchNormalization in inference form), constant folding off; the
Dropout model alone is exported in training mode (an eval export removes Dropout).
``op_types(name)`` / ``op_coverage()`` give the ONNX operator types of each forward model.
"""
from __future__ import annotations

import io
import math
import random
from dataclasses import dataclass, field
from typing import Callable

import onnx
import torch
from torch import nn
from torch.nn import functional as F

OPSET = 17


@dataclass
class ZooEntry:
    name: str
    module: nn.Module
    inputs: dict[str, torch.Tensor]
    loss: str                      # "cross_entropy" | "mse"
    labels: torch.Tensor
    class_axis: int | None = None  # None: the builder's default (1 for rank 2, last for rank >= 3)
    training_export: bool = False  # export in TrainingMode.TRAINING (the Dropout model)
    notes: dict = field(default_factory=dict)


# ------------------------------------------------------------------ building blocks --

class SelfAttention(nn.Module):
    """Multi-head self-attention written with MatMul / Softmax (not nn.MultiheadAttention)."""

    def __init__(self, dim, heads, causal_len=None):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        if causal_len is not None:
            # a bool buffer: not a floating initializer, so never taken for a parameter
            self.register_buffer("causal", torch.ones(causal_len, causal_len, dtype=torch.bool).tril())
        else:
            self.causal = None

    def forward(self, x):
        b, t, d = x.shape
        h, hd = self.heads, self.head_dim
        q = self.q(x).reshape(b, t, h, hd).transpose(1, 2)
        k = self.k(x).reshape(b, t, h, hd).transpose(1, 2)
        v = self.v(x).reshape(b, t, h, hd).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(hd)
        if self.causal is not None:
            scores = scores.masked_fill(~self.causal[:t, :t], float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, d)
        return self.proj(out)


class TransformerBlock(nn.Module):
    def __init__(self, dim, heads, hidden, causal_len=None, pre_norm=True):
        super().__init__()
        self.pre_norm = pre_norm
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, causal_len)
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def ffn(self, x):
        return self.fc2(F.gelu(self.fc1(x)))

    def forward(self, x):
        if self.pre_norm:
            x = x + self.attn(self.ln1(x))
            return x + self.ffn(self.ln2(x))
        x = self.ln1(x + self.attn(x))        # BERT: post-norm
        return self.ln2(x + self.ffn(x))


def _conv_bn(cin, cout, k=3, stride=1, groups=1):
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(cout))


def _ce_labels(batch, classes, generator):
    return torch.randint(0, classes, (batch,), generator=generator)


def _gen(seed):
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed + 1000)


# --------------------------------------------------------------------------- models --

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 5)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(F.relu(self.fc1(x)))))


def mlp():
    g = _gen(1)
    module = MLP()
    return ZooEntry("mlp", module, {"x": torch.randn(4, 16, generator=g)}, "cross_entropy",
                    _ce_labels(4, 5, g))


class VGG(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Linear(16 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def vgg():
    g = _gen(2)
    module = VGG()
    return ZooEntry("vgg", module, {"x": torch.randn(2, 3, 16, 16, generator=g)}, "cross_entropy",
                    _ce_labels(2, 10, g))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1, self.conv2 = _conv_bn(cin, cout, 3, stride), _conv_bn(cout, cout, 3)
        self.shortcut = _conv_bn(cin, cout, 1, stride) if (stride != 1 or cin != cout) else None

    def forward(self, x):
        out = self.conv2(F.relu(self.conv1(x)))
        skip = x if self.shortcut is None else self.shortcut(x)
        return F.relu(out + skip)


class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = _conv_bn(3, 8)
        self.layer1 = BasicBlock(8, 8, 1)
        self.layer2 = BasicBlock(8, 16, 2)     # 1x1 conv projection on the skip
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.layer2(self.layer1(F.relu(self.stem(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet():
    g = _gen(3)
    module = ResNet()
    _randomize_norms(module, g)
    return ZooEntry("resnet", module, {"x": torch.randn(4, 3, 16, 16, generator=g)},
                    "cross_entropy", _ce_labels(4, 10, g))


class DenseLayer(nn.Module):
    def __init__(self, cin, growth):
        super().__init__()
        self.bn, self.conv = nn.BatchNorm2d(cin), nn.Conv2d(cin, growth, 3, padding=1, bias=False)

    def forward(self, x):
        return torch.cat([x, self.conv(F.relu(self.bn(x)))], 1)


class DenseNet(nn.Module):
    def __init__(self, growth=4):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        c = 8
        layers = []
        for _ in range(3):
            layers.append(DenseLayer(c, growth))
            c += growth
        self.block1 = nn.Sequential(*layers)
        self.transition = nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c // 2, 1, bias=False),
                                        nn.AvgPool2d(2))
        c //= 2
        layers = []
        for _ in range(2):
            layers.append(DenseLayer(c, growth))
            c += growth
        self.block2 = nn.Sequential(*layers)
        self.norm = nn.BatchNorm2d(c)
        self.fc = nn.Linear(c, 6)

    def forward(self, x):
        x = self.block2(self.transition(self.block1(self.stem(x))))
        x = F.relu(self.norm(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def densenet():
    g = _gen(4)
    module = DenseNet()
    _randomize_norms(module, g)
    return ZooEntry("densenet", module, {"x": torch.randn(2, 3, 16, 16, generator=g)},
                    "cross_entropy", _ce_labels(2, 6, g))


class InvertedResidual(nn.Module):
    def __init__(self, cin, cout, stride, expand, act):
        super().__init__()
        hidden = cin * expand
        self.act = act
        self.expand = _conv_bn(cin, hidden, 1)
        self.depthwise = _conv_bn(hidden, hidden, 3, stride, groups=hidden)
        self.project = _conv_bn(hidden, cout, 1)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        out = self.project(self.act(self.depthwise(self.act(self.expand(x)))))
        return x + out if self.residual else out


class MobileNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = _conv_bn(3, 8, 3, 2)
        self.block1 = InvertedResidual(8, 8, 1, 2, nn.ReLU6())
        self.block2 = InvertedResidual(8, 16, 2, 2, nn.Hardswish())
        self.fc = nn.Linear(16, 7)

    def forward(self, x):
        x = F.relu6(self.stem(x))
        x = self.block2(self.block1(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def mobilenet():
    g = _gen(5)
    module = MobileNet()
    _randomize_norms(module, g)
    return ZooEntry("mobilenet", module, {"x": torch.randn(4, 3, 16, 16, generator=g)},
                    "cross_entropy", _ce_labels(4, 7, g))


class UNet(nn.Module):
    def __init__(self):
        super().__init__()
        def double(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU())
        self.enc1, self.enc2, self.bottom = double(1, 8), double(8, 16), double(16, 32)
        self.up2 = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.dec2 = double(32, 16)
        self.up1 = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.dec1 = double(16, 8)
        self.out = nn.Conv2d(8, 1, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        b = self.bottom(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(b), e2], 1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], 1))
        return self.out(d1)


def unet():
    g = _gen(6)
    module = UNet()
    x = torch.randn(2, 1, 16, 16, generator=g)
    return ZooEntry("unet", module, {"x": x}, "mse", torch.randn(2, 1, 16, 16, generator=g))


class LSTMClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=1, batch_first=True)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.fc(out[:, -1])


def lstm():
    g = _gen(7)
    module = LSTMClassifier()
    return ZooEntry("lstm", module, {"x": torch.randn(3, 6, 8, generator=g)}, "cross_entropy",
                    _ce_labels(3, 4, g))


class BERT(nn.Module):
    def __init__(self, vocab=50, seq=8, dim=32, heads=4, layers=2, classes=3):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.ln = nn.LayerNorm(dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads, 2 * dim, pre_norm=False)
                                    for _ in range(layers))
        self.head = nn.Linear(dim, classes)

    def forward(self, input_ids):
        t = input_ids.shape[1]
        positions = torch.arange(t, device=input_ids.device)
        x = self.ln(self.tokens(input_ids) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(x[:, 0])            # classifier on the first ([CLS]) token


def bert():
    g = _gen(8)
    module = BERT()
    _randomize_norms(module, g)
    ids = torch.randint(0, 50, (2, 8), generator=g)
    ids[:, 0] = 1                            # [CLS]
    return ZooEntry("bert", module, {"input_ids": ids}, "cross_entropy", _ce_labels(2, 3, g))


class ALBERT(nn.Module):
    """ALBERT's weight sharing: one transformer layer applied `layers` times (every layer's gradient
    contributions add up in each shared weight's gradient), a factorized embedding."""

    def __init__(self, vocab=50, seq=8, embed=16, dim=32, heads=4, layers=4, classes=3):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, embed), nn.Embedding(seq, embed)
        self.project = nn.Linear(embed, dim)
        self.ln = nn.LayerNorm(embed)
        self.block = TransformerBlock(dim, heads, 2 * dim, pre_norm=False)
        self.layers = layers
        self.head = nn.Linear(dim, classes)

    def forward(self, input_ids):
        t = input_ids.shape[1]
        x = self.project(self.ln(self.tokens(input_ids) + self.positions(torch.arange(t, device=input_ids.device))))
        for _ in range(self.layers):
            x = self.block(x)
        return self.head(x[:, 0])


def albert():
    g = _gen(15)
    module = ALBERT()
    _randomize_norms(module, g)
    ids = torch.randint(0, 50, (2, 8), generator=g)
    return ZooEntry("albert", module, {"input_ids": ids}, "cross_entropy", _ce_labels(2, 3, g))


class GPT(nn.Module):
    def __init__(self, vocab=40, seq=8, dim=32, heads=4, layers=2):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads, 4 * dim, causal_len=seq)
                                    for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        t = input_ids.shape[1]
        x = self.tokens(input_ids) + self.positions(torch.arange(t, device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))    # [B, T, V]: the class axis is the last one


def gpt():
    """Wider than the rest on purpose: the embedding gradient (ScatterND with reduction=add
    in a reverse-mode graph) must be big enough for ONNX Runtime's CPU kernel to split it
    over threads, which it does from about 2^18 update elements (8 x 128 tokens x 256 here;
    at 131072 it ran single-threaded and never raced in 20 runs, at 262144 it gave wrong
    sums in 20 of 20 runs with 4 threads, onnxruntime 1.32)."""
    g = _gen(9)
    module = GPT(vocab=40, seq=128, dim=256, heads=4, layers=2)
    _randomize_norms(module, g)
    # few distinct tokens: every id repeats, so the embedding gradient must accumulate
    stream = torch.randint(0, 12, (8, 129), generator=g)
    ids, labels = stream[:, :-1].contiguous(), stream[:, 1:].contiguous()
    entry = ZooEntry("gpt", module, {"input_ids": ids}, "cross_entropy", labels)
    entry.notes["repeated_ids"] = int(ids.numel() - ids.unique().numel())
    return entry


class ViT(nn.Module):
    def __init__(self, image=16, patch=4, dim=32, heads=4, layers=2, classes=5):
        super().__init__()
        n = (image // patch) ** 2
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads, 2 * dim) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        p = self.patch(x).flatten(2).transpose(1, 2)          # [B, N, D]
        cls = self.cls_token.expand(p.shape[0], -1, -1)
        x = torch.cat([cls, p], 1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x)[:, 0])


def vit():
    g = _gen(10)
    module = ViT()
    _randomize_norms(module, g)
    return ZooEntry("vit", module, {"x": torch.randn(2, 3, 16, 16, generator=g)}, "cross_entropy",
                    _ce_labels(2, 5, g))


class DropoutMLP(nn.Module):
    """An MLP with two Dropouts (different widths, so their masks are told apart by shape).
    With ``masks`` set (a list, one per Dropout), they are applied instead of drawing
    new ones: x * mask / (1 - p)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 24), nn.Linear(24, 12), nn.Linear(12, 5)
        self.drop1, self.drop2 = nn.Dropout(0.5), nn.Dropout(0.25)
        self.masks = None

    def _drop(self, i, layer, x):
        if self.masks is None:
            return layer(x)
        return x * self.masks[i].to(x.dtype) / (1.0 - layer.p)

    def forward(self, x):
        x = self._drop(0, self.drop1, F.relu(self.fc1(x)))
        x = self._drop(1, self.drop2, F.relu(self.fc2(x)))
        return self.fc3(x)


def dropout_mlp():
    g = _gen(11)
    module = DropoutMLP()
    return ZooEntry("dropout_mlp", module, {"x": torch.randn(4, 16, generator=g)}, "cross_entropy",
                    _ce_labels(4, 5, g), training_export=True)


class RandWire(nn.Module):
    """A randomly wired cell network: a seeded random DAG (each node reads 1-3 earlier
    nodes, the stem included); a node sums its inputs, then ReLU -> 3x3 conv -> BN; the
    nodes nobody reads are averaged into the output."""

    def __init__(self, nodes=6, channels=8, seed=12):
        super().__init__()
        rng = random.Random(seed)
        self.stem = _conv_bn(3, channels, 3, 2)
        self.preds = []
        for i in range(1, nodes + 1):                # node i reads from 0 (stem) .. i-1
            k = rng.randint(1, min(3, i))
            self.preds.append(sorted(rng.sample(range(i), k)))
        read = {p for preds in self.preds for p in preds}
        self.sinks = [i for i in range(1, nodes + 1) if i not in read]
        self.cells = nn.ModuleList(_conv_bn(channels, channels) for _ in range(nodes))
        self.fc = nn.Linear(channels, 4)

    def forward(self, x):
        outs = [self.stem(x)]
        for preds, cell in zip(self.preds, self.cells):
            s = outs[preds[0]]
            for p in preds[1:]:
                s = s + outs[p]
            outs.append(cell(F.relu(s)))
        y = outs[self.sinks[0]]
        for s in self.sinks[1:]:
            y = y + outs[s]
        y = F.relu(y / len(self.sinks))
        return self.fc(F.adaptive_avg_pool2d(y, 1).flatten(1))


def randwire():
    g = _gen(12)
    module = RandWire()
    _randomize_norms(module, g)
    return ZooEntry("randwire", module, {"x": torch.randn(2, 3, 16, 16, generator=g)},
                    "cross_entropy", _ce_labels(2, 4, g))


def _randomize_norms(module, g):
    """Non-trivial normalization parameters and BatchNorm running statistics, as a trained
    model has: inference-form and training-form BatchNorm then really differ, and no two
    parameters hold equal values (the legacy exporter merges initializers with equal
    values, e.g. every LayerNorm's fresh ones and zeros, into one)."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
                shape = m.weight.shape
                m.weight.copy_(1 + 0.2 * torch.randn(shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(shape, generator=g))
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.running_mean.copy_(0.5 * torch.randn(n, generator=g))
                m.running_var.copy_(0.5 + torch.rand(n, generator=g))


class FeaturePyramid(nn.Module):
    """Split channels into two paths (Split), one at half resolution brought back by
    bilinear and nearest Resize, LeakyRelu and Sigmoid; Slice; Concat; a 1x1 Conv head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 8, 3, padding=1)
        self.down = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.side = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Conv2d(12, 2, 1)

    def forward(self, x):
        a, b = torch.split(F.leaky_relu(self.stem(x), 0.1), 4, dim=1)
        low = torch.sigmoid(self.down(a))
        up_bilinear = F.interpolate(low, scale_factor=2.0, mode="bilinear", align_corners=False)
        up_nearest = F.interpolate(low, scale_factor=2.0, mode="nearest")
        side = self.side(b)[:, :, 1:-1, 1:-1]
        side = F.pad(side, (1, 1, 1, 1))
        return self.head(torch.cat([up_bilinear, up_nearest, side], dim=1))


def fpn():
    g = _gen(13)
    module = FeaturePyramid()
    x = torch.randn(2, 2, 12, 12, generator=g)
    return ZooEntry("fpn", module, {"x": x}, "mse", torch.randn(2, 2, 12, 12, generator=g))


class ConvForms(nn.Module):
    """The convolution shapes whose weight gradients the builder writes in different forms
    (graphopt/builder/rules.py): a 3-channel stem (whole-map convolution), a dilated 3x3 over 8
    channels (per tap), a dilated 3x3 from 16 channels to 8 (per tap, the adjoint moved), a 1x1
    (per tap; its input gradient a Conv), a strided depthwise 3x3 (per tap, elementwise), a
    grouped 3x3 (groups of 4 channels: whole-map, grouped), a strided 1x1, a transposed 3x3 at
    stride 2, a strided dilated Conv1d and a Conv3d."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.dilated = nn.Conv2d(8, 16, 3, padding=2, dilation=2, bias=False)
        self.narrow = nn.Conv2d(16, 8, 3, padding=2, dilation=2)
        self.widen = nn.Conv2d(8, 16, 1)
        self.depthwise = nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=16)
        self.grouped = nn.Conv2d(16, 16, 3, padding=1, groups=4, bias=False)
        self.pointwise = nn.Conv2d(16, 16, 1, stride=2)
        self.up = nn.ConvTranspose2d(16, 8, 3, stride=2, padding=1, output_padding=1)
        self.line = nn.Conv1d(8, 8, 5, stride=2, padding=4, dilation=2)
        self.volume = nn.Conv3d(8, 8, 3, padding=1, bias=False)
        self.head = nn.Linear(8 * 32, 4)

    def forward(self, x):
        x = torch.tanh(self.stem(x))                       # [N, 8, 16, 16]
        x = torch.tanh(self.dilated(x))                    # [N, 16, 16, 16]
        x = x + torch.tanh(self.widen(torch.tanh(self.narrow(x))))
        x = torch.tanh(self.grouped(self.depthwise(x)))    # [N, 16, 8, 8]
        x = torch.tanh(self.up(self.pointwise(x)))         # [N, 16, 4, 4] -> [N, 8, 8, 8]
        x = torch.tanh(self.line(x.reshape(x.shape[0], 8, 64)))                  # [N, 8, 32]
        x = torch.tanh(self.volume(x.reshape(x.shape[0], 8, 2, 4, 4)))           # [N, 8, 2, 4, 4]
        return self.head(x.reshape(x.shape[0], -1))


def convs():
    g = _gen(14)
    module = ConvForms()
    x = torch.randn(2, 3, 16, 16, generator=g)
    return ZooEntry("convs", module, {"x": x}, "cross_entropy", _ce_labels(2, 4, g))


ZOO: dict[str, Callable[[], ZooEntry]] = {
    "mlp": mlp, "vgg": vgg, "resnet": resnet, "densenet": densenet, "mobilenet": mobilenet,
    "unet": unet, "lstm": lstm, "bert": bert, "gpt": gpt, "vit": vit,
    "dropout_mlp": dropout_mlp, "randwire": randwire, "fpn": fpn, "convs": convs, "albert": albert,
}


# ------------------------------------------------------------------------- export --

def export(entry: ZooEntry, opset: int = OPSET) -> onnx.ModelProto:
    """The forward model (no loss) as the legacy exporter writes it; output ``logits``."""
    module = entry.module
    mode = torch.onnx.TrainingMode.TRAINING if entry.training_export else torch.onnx.TrainingMode.EVAL
    was_training = module.training
    buffers = {k: v.clone() for k, v in module.state_dict().items()}
    buffer = io.BytesIO()
    try:
        torch.onnx.export(module, tuple(entry.inputs.values()), buffer, dynamo=False,
                          opset_version=opset, input_names=list(entry.inputs),
                          output_names=["logits"], do_constant_folding=False, training=mode)
    finally:
        module.train(was_training)
        # a training-mode export runs the module once: put its buffers back
        module.load_state_dict(buffers)
    return onnx.load_from_string(buffer.getvalue())


def op_types(name: str, model: onnx.ModelProto | None = None) -> set[str]:
    """The ONNX operator types of the forward model of zoo entry `name` (subgraphs included)."""
    if model is None:
        model = export(ZOO[name]())
    found = set()

    def walk(graph):
        for node in graph.node:
            found.add(node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}:{node.op_type}")
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    walk(attribute.g)
                for g in attribute.graphs:
                    walk(g)
    walk(model.graph)
    return found


def op_coverage(names=None) -> dict[str, list[str]]:
    """architecture -> sorted ONNX operator types of its forward model (for the README table)."""
    return {name: sorted(op_types(name)) for name in (names or ZOO)}


if __name__ == "__main__":  # python zoo/torch_zoo.py: print the coverage
    for arch, ops in op_coverage().items():
        print(f"{arch:12s} {' '.join(ops)}")
