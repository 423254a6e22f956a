"""examples/python_model/net.py: a user's own PyTorch module, trained by keel with no Python in
the training loop (model.name = "python", compile.mode = "inductor"; configs/python_model.toml).

keel calls build_model(config) once to take the initial weights (after torch.manual_seed(run.seed))
and again, ahead of time, to compile the training step with AOTInductor. `config` is keel's
[model] section as a dict (width, depth, num_classes, ...: 0 = not set). The module returns
logits over the last dimension; keel's loss is cross-entropy. Buffers (BatchNorm's running
statistics) are fine: keel keeps them and the package updates them.
"""
import torch
from torch import nn


class ResidualBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.BatchNorm1d(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc(torch.relu(self.norm(x)))


class Net(nn.Module):
    """An image classifier: flatten, a stem, residual blocks with BatchNorm, a head."""

    def __init__(self, width: int = 128, depth: int = 2, classes: int = 10, pixels: int = 28 * 28):
        super().__init__()
        self.stem = nn.Linear(pixels, width)
        self.blocks = nn.Sequential(*[ResidualBlock(width) for _ in range(depth)])
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.stem(x.flatten(1))
        return self.head(torch.relu(self.blocks(h)))


def build_model(config):
    return Net(width=config.get("width") or 128, depth=config.get("depth") or 2,
               classes=config.get("num_classes") or 10)
