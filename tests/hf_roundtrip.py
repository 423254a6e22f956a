"""Hugging Face transformers on the other side of keel's gpt2 and llama (issue 28, items 1-3).

Run by tests/test_hf.cpp with keel's venv Python; exit 77 when transformers is not installed
(the test skips), 1 with the reason when a comparison fails.

    hf_roundtrip.py make FAMILY DIR CONFIG_JSON SEED [--legacy] [--sharded]
        a random transformers model (every parameter perturbed, so that every one matters),
        written by save_pretrained into DIR; --legacy (gpt2): the tensor names of GPT-2 files
        from before the base-model prefix, with their causal-mask buffers
    hf_roundtrip.py logits DIR KEEL_SAFETENSORS RTOL
        transformers' logits of DIR on KEEL_SAFETENSORS' "input" against its "logits"
    hf_roundtrip.py steps DIR TOKENS B T LR
        the losses of a keel run on the token file TOKENS (llm.c .bin, windows in order, batch
        B of T tokens, plain SGD at LR): the first batch's before a step, the second's after
    hf_roundtrip.py load OUT KEEL_SAFETENSORS RTOL
        AutoModelForCausalLM.from_pretrained(OUT): no missing, unexpected or mismatched
        tensor, no warning about weights; its logits against keel's
"""
import json
import logging
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only: never the network

EXIT_SKIP = 77


def fail(msg):
    print(msg)
    sys.exit(1)


try:
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
except ImportError as e:
    print(f"transformers is not installed in keel's venv ({e}); scripts/setup.sh installs it")
    sys.exit(EXIT_SKIP)

transformers.utils.logging.disable_progress_bar()


def make(family, out, cfg, seed, legacy, sharded):
    torch.manual_seed(seed)
    if family == "gpt2":
        config = transformers.GPT2Config(**cfg)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(**cfg)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, max_shard_size="20KB" if sharded else "5GB")
    if legacy:
        sd = {k[len("transformer."):]: v.contiguous() for k, v in model.state_dict().items()
              if k.startswith("transformer.")}
        n_pos = cfg["n_positions"]
        mask = torch.tril(torch.ones(n_pos, n_pos, dtype=torch.uint8)).view(1, 1, n_pos, n_pos)
        for i in range(cfg["n_layer"]):
            sd[f"h.{i}.attn.bias"] = mask.clone()
        save_file(sd, f"{out}/model.safetensors", metadata={"format": "pt"})


def compare(name, got, want, rtol):
    scale = max(want.abs().max().item(), 1e-30)
    err = (got - want).abs().max().item()
    print(f"{name}: max |diff| {err:.3g}, max |value| {scale:.3g}, relative {err / scale:.3g} (tolerance {rtol})")
    if not err <= rtol * scale:
        fail(f"{name}: transformers and keel differ by {err / scale:.3g} relative, more than {rtol}")


def logits(model, x):
    model.eval()
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits


def batch(tokens, i0, b, t):
    idx = torch.stack([tokens[(i0 + i) * t:(i0 + i) * t + t + 1] for i in range(b)])
    return idx[:, :-1], idx[:, 1:]


def steps(path, tokens_file, b, t, lr):
    import numpy as np

    raw = np.fromfile(tokens_file, dtype=np.int32, count=256)
    width = 2 if raw[0] == 20240520 else 4
    tokens = np.fromfile(tokens_file, dtype=np.uint16 if width == 2 else np.uint32, offset=1024)
    tokens = torch.from_numpy(tokens.astype(np.int64))
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model.train()
    for m in model.modules():  # the keel run sets model.dropout = 0
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(2):
        x, y = batch(tokens, step * b, b, t)
        out = model(input_ids=x, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(json.dumps({"losses": losses}))


def load(out, keel_file, rtol):
    records = []

    class Catch(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    transformers.logging.set_verbosity_warning()
    transformers.logging.get_logger().addHandler(Catch())
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(key):
            fail(f"from_pretrained({out}): {key} {sorted(info[key])}")
    bad = [r for r in records if "weight" in r.lower() or "initialized" in r.lower()]
    if bad:
        fail(f"from_pretrained({out}) warned: {bad}")
    keel = load_file(keel_file)
    compare("logits", logits(model, keel["input"]), keel["logits"], rtol)


def main(argv):
    cmd = argv[1]
    if cmd == "make":
        make(argv[2], argv[3], json.loads(argv[4]), int(argv[5]), "--legacy" in argv, "--sharded" in argv)
    elif cmd == "logits":
        model = transformers.AutoModelForCausalLM.from_pretrained(argv[2])
        keel = load_file(argv[3])
        compare("logits", logits(model, keel["input"]), keel["logits"], float(argv[4]))
    elif cmd == "steps":
        steps(argv[2], argv[3], int(argv[4]), int(argv[5]), float(argv[6]))
    elif cmd == "load":
        load(argv[2], argv[3], float(argv[4]))
    else:
        fail(f"unknown command {cmd}")


if __name__ == "__main__":
    main(sys.argv)
