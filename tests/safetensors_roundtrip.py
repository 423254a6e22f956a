#!/usr/bin/env python3
"""keel's checkpoints and the real safetensors library (the `safetensors` package from PyPI,
`safetensors.torch`), both ways, with the PyTorch models of tests/golden/reference_models.py.

  safetensors_roundtrip.py logits STEP_DIR KEEL_OUT MODEL ARGS_JSON
      Loads every model shard of a keel checkpoint step with safetensors.torch.load_file,
      following model.safetensors.index.json, into the reference MODEL (mlp | gpt) built with
      ARGS_JSON, runs KEEL_OUT's "input" through it and compares with KEEL_OUT's "logits" (what
      keel computed from the same step). Prints the largest difference; exit 1 above 1e-5.
  safetensors_roundtrip.py init OUT.safetensors ARGS_JSON BATCH
      Builds the reference mlp (seed 123), saves its weights with safetensors.torch.save_file,
      and prints (JSON) the cross-entropy of the first batch keel trains on with
      data.name = "synthetic", data.shuffle = false, run.seed = 0: keel's synthetic data,
      regenerated here with the same generators.

Exit 77 when the safetensors package is not installed.
"""
import json
import os
import sys

try:
    from safetensors.torch import load_file, save_file
except ImportError as e:
    print(f"SKIPPED: the safetensors package is not installed ({e}); scripts/setup.sh installs it into keel's venv")
    sys.exit(77)
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden"))
import reference_models as ref  # noqa: E402


def build(name, args):
    if name == "mlp":
        return ref.Mlp(width=args["width"], depth=args["depth"])
    if name == "gpt":
        return ref.Gpt(vocab=256, context=args["context"], layers=args["depth"], heads=args["heads"], d=args["width"])
    raise SystemExit(f"unknown model {name}")


def logits(step_dir, keel_out, name, args):
    with open(os.path.join(step_dir, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    state = {}
    for shard in sorted(set(weight_map.values())):
        part = load_file(os.path.join(step_dir, shard))
        for k in part:
            assert weight_map.get(k) == shard, f"{k} is in {shard}, the index says {weight_map.get(k)}"
        state.update(part)
    model = build(name, args)
    model.load_state_dict(state, strict=True)
    model.eval()
    keel = load_file(keel_out)
    with torch.no_grad():
        mine = model(keel["input"])
    diff = (mine - keel["logits"]).abs().max().item()
    print(json.dumps({"shards": len(set(weight_map.values())), "tensors": len(state), "max_abs_diff": diff}))
    return 0 if diff <= 1e-5 else 1


def init(out, args, batch):
    torch.manual_seed(123)
    model = build("mlp", args)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out)
    # keel's synthetic image data (trainer/data/datasets.cpp make_synthetic) at run.seed = 0.
    n, s = 4096, 0 * 1000003 + 17
    x = torch.randn((n, 1, 28, 28), generator=torch.Generator().manual_seed(s))
    rule = torch.randn((784, 10), generator=torch.Generator().manual_seed(s + 2))
    y = (x.view(n, 784) @ rule).argmax(1)
    with torch.no_grad():
        loss = F.cross_entropy(model(x[:batch]), y[:batch]).item()
    print(json.dumps({"first_loss": loss}))
    return 0


def main():
    if sys.argv[1] == "logits":
        return logits(sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5]))
    if sys.argv[1] == "init":
        return init(sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
