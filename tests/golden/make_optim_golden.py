"""Writes OUT (default tests/golden/optim.pt) for tests/test_optim.cpp: 20 steps of PyTorch 2.11's fused
optimizers (torch.optim.AdamW(fused=True), torch.optim.SGD(fused=True)) on CPU, from given
parameters and gradients, with a learning rate that changes every step and one step skipped
through `found_inf` (as GradScaler hands it to a fused optimizer).

Run from the repository root:  ~/.cache/keel/venv/bin/python tests/golden/make_optim_golden.py [OUT]
tests/test_optim.cpp runs it into a folder of its own at test time, so that PyTorch's kernels and
keel's are the same kernel set (ATEN_CPU_CAPABILITY, which the test process passes on): a fused
kernel's vector path (FMA) and its scalar one (ATen's `default`) round differently.
For each case the file holds "<case>/param/<i>" (initial), "<case>/grad/<step>/<i>",
"<case>/lr" (per step), "<case>/skip" (per step, 1 = found_inf set), "<case>/final/<i>" and the
state: "<case>/step/<i>", "<case>/exp_avg/<i>", "<case>/exp_avg_sq/<i>", "<case>/momentum_buffer/<i>".
"""
import os
import sys

import torch

SHAPES = [(7, 5), (5,), (3, 4, 2), (1,)]
STEPS = 20
# Steps skipped through found_inf: the very first (state created, nothing applied) and one in the
# middle. Not the first for SGD with momentum: PyTorch's _fused_sgd makes its buffers with
# torch.empty_like on the first step and the skipped kernel leaves them uninitialised (the next
# step reads garbage: final parameters off by ~1e36 here). keel starts them at zero instead,
# which tests/test_optim.cpp checks against the loop optimizer.
SKIP_AT = {"adamw": {0, 7}, "sgd": {7}, "sgd_plain": {0, 7}}

CASES = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.05, fused=True),
    "sgd_plain": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.0, weight_decay=0.0, fused=True),
}


def run(name, make, out):
    params = [torch.randn(s) for s in SHAPES]
    for i, p in enumerate(params):
        out[f"{name}/param/{i}"] = p.clone()
    params = [torch.nn.Parameter(p) for p in params]
    opt = make(params)
    lrs, skips = [], []
    for step in range(STEPS):
        lr = 1e-2 * (0.5 + 0.5 * ((step * 7) % 11) / 10)  # changes every step, as a schedule does
        for g in opt.param_groups:
            g["lr"] = lr
        for i, p in enumerate(params):
            p.grad = torch.randn_like(p) * (10.0 if step == 3 else 1.0)
            out[f"{name}/grad/{step}/{i}"] = p.grad.clone()
        skip = step in SKIP_AT[name]
        if skip:
            opt.found_inf = torch.ones(())
        opt.step()
        if skip:
            del opt.found_inf
        lrs.append(lr)
        skips.append(1 if skip else 0)
    out[f"{name}/lr"] = torch.tensor(lrs, dtype=torch.float64)
    out[f"{name}/skip"] = torch.tensor(skips, dtype=torch.int64)
    for i, p in enumerate(params):
        out[f"{name}/final/{i}"] = p.detach().clone()
        for k, v in opt.state[p].items():
            if v is not None:
                out[f"{name}/{k}/{i}"] = v.detach().clone()


def main():
    torch.manual_seed(4321)
    out = {}
    for name, make in CASES.items():
        run(name, make, out)
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "optim.pt")
    torch.save(out, path)
    print(f"{path}: {len(out)} tensors")


if __name__ == "__main__":
    main()
