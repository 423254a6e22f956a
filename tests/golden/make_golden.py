"""Writes the golden files of tests/test_models.cpp: weights, input, target, logits and
parameter gradients of the cnn and a small gpt, computed by PyTorch 2.11 (the venv of scripts/setup.sh).

Run from the repository root:  ~/.cache/keel/venv/bin/python tests/golden/make_golden.py
The C++ test loads the weights into keel's models by parameter name, runs the same input
and compares logits and gradients (tolerances in the test, with the reasons).
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from reference_models import Cnn, Gpt  # noqa: E402


def golden(model, x, target, path):
    # Perturb the default init so that biases and LayerNorm affine parameters are not trivial.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    loss.backward()
    out = {"input": x, "target": target, "logits": logits.detach(), "loss": loss.detach()}
    for name, p in model.named_parameters():
        out["param/" + name] = p.detach().clone()
        out["grad/" + name] = p.grad.detach().clone()
    torch.save(out, path)
    print(f"{path}: {sum(p.numel() for p in model.parameters())} parameters, loss {loss.item():.6f}")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    torch.manual_seed(1234)
    golden(Cnn(), torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,)), os.path.join(here, "cnn.pt"))
    torch.manual_seed(5678)
    # A reduced gpt (width 64, 2 blocks, context 16): every code path of the default size at a
    # fraction of the file size. tests/test_models.cpp builds keel's gpt with the same fields.
    idx = torch.randint(0, 256, (2, 16))
    # The explicit masked softmax (sdpa=False): keel's fused attention is checked against it.
    golden(Gpt(vocab=256, context=16, layers=2, heads=4, d=64, sdpa=False), idx, torch.randint(0, 256, (2, 16)),
           os.path.join(here, "gpt_small.pt"))


if __name__ == "__main__":
    main()
