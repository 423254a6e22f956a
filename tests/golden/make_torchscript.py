"""Writes tests/golden/tiny_classifier.pt, a small TorchScript classifier (784 -> 32 -> 10) that
tests/test_models.cpp trains through keel's torchscript model. Run from the repository root:
~/.cache/keel/venv/bin/python tests/golden/make_torchscript.py"""
import os

import torch
import torch.nn as nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


torch.manual_seed(0)
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_classifier.pt")
torch.jit.save(torch.jit.script(Tiny()), path)
print(path)
