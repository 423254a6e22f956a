#!/usr/bin/env python3
"""trainer/compile/aot_package.py: one training step of a model, compiled ahead of time by
AOTInductor into a .pt2 package that keel's C++ trainer loads and runs with no Python.

Run by keel (compile.mode = inductor) with keel's venv Python when a package is missing, or by
hand:

    python trainer/compile/aot_package.py --model gpt --model-config '{"width":64,"depth":2,
        "context":32}' --batch 4 --amp off --device cpu --out /cache/gpt.pt2 [--check]
    python trainer/compile/aot_package.py --module mypkg.net:make --batch 32 --out net.pt2
    python trainer/compile/aot_package.py --module net.py:build_model --example '{"input": {"shape": [32, 1,
        28, 28], "dtype": "float32"}, "target": {"shape": [32], "dtype": "int64"}, "classes": 10}' --batch 32
        --out net.pt2        # how keel runs it for model.name = "python" (--init-out: the initial weights only)

What is compiled: step(*params, *buffers, input, target[, grad_scale]) -> (loss, *grads[,
*updated buffers]): the model's forward (under bf16/fp16 autocast with --amp), keel's default
loss (cross-entropy over the last dimension, mean over every sample or token, cast to float32,
exactly as trainer/loss.cpp computes it) and the gradient of every parameter
(torch.autograd.grad), traced by make_fx into one flat ATen graph, exported with
torch.export.export(strict=False) and compiled by AOTInductor. Parameters, buffers and data are
graph INPUTS (no weights are baked in), so keel's optimizer, GradScaler, ZeRO, checkpoints and
DDP keep owning them. Optionally a second model, "forward": (params, buffers, input) -> logits
in eval mode, for evaluation at --eval-batch.

Outputs, published only when everything (including --check) passed: both are staged in a
fresh directory beside PATH and renamed into place, the package first, the manifest last:
  PATH.pt2   the package: model "train_step" (and "forward" unless --no-forward or it cannot be
             captured); each also carries metadata keel_format, keel_model, keel_signature
             (AOTIModelPackageLoader::get_metadata())
  PATH.json  the manifest ("format": "keel-aoti-step/1"): for each model its batch, graph_sha256
             and ordered inputs and outputs (name, kind, shape, dtype); versions, compiler,
             CPU ISA or GPU arch, threads, Inductor options, timings, SHA-256 of the package
A package without a manifest, or whose SHA-256 is not the manifest's, is incomplete or foreign
and must be rebuilt. --trace-only prints the manifest's signature part (with graph_sha256) in
a few seconds and writes nothing.

Exit codes (the last line on stderr is the one-line reason):
  0 ok; 1 any other failure (the compiler, a bug); 2 bad arguments or model config, or a --module
    that raises ("model.path FILE:LINE: TYPE: MESSAGE") or returns what keel's loss cannot take;
  3 graph break: "graph break at FILE:LINE: OP (REASON)[ in MODEL: SOURCE LINE]";
  4 --deterministic and a non-deterministic op: "non-deterministic op at FILE:LINE: OP (REASON)";
  5 --check: the package disagrees with eager PyTorch (nothing is written);
  6 a custom op without a fake (Meta) kernel: "custom op NS::OP has no fake kernel: ... (FIX)".
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import json
import linecache
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

FORMAT = "keel-aoti-step/1"
# The models whose transformer block --granularity blocks packages (their block at index 0 and
# the prefix of its parameters in the whole model's names).
BLOCK_MODELS = ("gpt", "gpt2", "llama")
EXIT_ERROR, EXIT_USAGE, EXIT_GRAPH_BREAK, EXIT_NONDETERMINISTIC, EXIT_CHECK, EXIT_NO_FAKE_KERNEL = 1, 2, 3, 4, 5, 6

# keel's [model] keys (trainer/config/schema.cpp). Those that do not change the graph
# (name, path, factory, input, init_from) are accepted and ignored.
MODEL_KEYS = {"name", "path", "factory", "width", "depth", "heads", "context", "vocab", "input", "num_classes", "init_from",
              "kv_heads", "ffn_width", "rope_theta", "norm_eps", "tie_embeddings", "dropout", "hf_config"}
MODEL_DEFAULTS = {"width": 0, "depth": 0, "heads": 4, "context": 128, "vocab": 256, "num_classes": 10}

# Random ops: keel's TorchScript list (trainer/compile/compile.cpp nondeterministic_ops()) plus
# the rest of ATen's samplers. Refused with --deterministic, listed in the manifest otherwise.
RANDOM_OPS = {
    "aten::dropout", "aten::dropout_", "aten::feature_dropout", "aten::alpha_dropout", "aten::native_dropout",
    "aten::bernoulli", "aten::bernoulli_", "aten::rand", "aten::randn", "aten::randint", "aten::randperm",
    "aten::rand_like", "aten::randn_like", "aten::randint_like", "aten::multinomial", "aten::normal",
    "aten::normal_", "aten::uniform", "aten::uniform_", "aten::exponential", "aten::exponential_", "aten::rrelu",
    "aten::rrelu_with_noise", "aten::rrelu_with_noise_functional", "aten::poisson", "aten::cauchy_",
    "aten::geometric_", "aten::log_normal_", "aten::random_", "aten::_fused_dropout", "aten::_standard_gamma",
    "aten::binomial", "aten::_sample_dirichlet", "prims::inductor_random", "prims::inductor_seeds",
}
# ATen kernels with no deterministic CUDA implementation (torch.use_deterministic_algorithms'
# list). index_put/scatter with accumulate are NOT here: with --deterministic Inductor falls
# back to ATen's kernels for them, which are deterministic when the runtime sets
# at::globalContext().setDeterministicAlgorithms(true, false) (the manifest says so).
CUDA_NONDETERMINISTIC_OPS = {
    "aten::avg_pool3d_backward", "aten::_adaptive_avg_pool2d_backward", "aten::_adaptive_avg_pool3d_backward",
    "aten::max_pool3d_with_indices_backward", "aten::adaptive_max_pool2d_backward",
    "aten::adaptive_max_pool3d_backward", "aten::fractional_max_pool2d_backward",
    "aten::fractional_max_pool3d_backward", "aten::max_unpool1d", "aten::max_unpool2d", "aten::max_unpool3d",
    "aten::upsample_linear1d_backward", "aten::upsample_bilinear2d_backward", "aten::upsample_bicubic2d_backward",
    "aten::upsample_trilinear3d_backward", "aten::_upsample_bilinear2d_aa_backward",
    "aten::reflection_pad1d_backward", "aten::reflection_pad2d_backward", "aten::reflection_pad3d_backward",
    "aten::replication_pad1d_backward", "aten::replication_pad2d_backward", "aten::replication_pad3d_backward",
    "aten::nll_loss2d_forward", "aten::_ctc_loss_backward", "aten::_embedding_bag_dense_backward",
    "aten::_embedding_bag_per_sample_weights_backward", "aten::put", "aten::put_", "aten::histc",
    "aten::bincount", "aten::kthvalue", "aten::median", "aten::nanmedian", "aten::grid_sampler_2d_backward",
    "aten::grid_sampler_3d_backward",
}


def log(msg: str) -> None:
    print(f"aot_package: {msg}", file=sys.stderr, flush=True)


class Refusal(Exception):
    """A reason to stop with a given exit code and a one-line message."""

    def __init__(self, code: int, line: str):
        super().__init__(line)
        self.code = code
        self.line = line


# ---------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="aot_package.py",
        description="Compile one training step (forward + cross-entropy + backward) ahead of time with AOTInductor.",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--graph", metavar="FILE.json",
                       help="the training step keel traced from its C++ model (keel-graph/1, with FILE.json.pt)")
    which.add_argument("--model", choices=["mlp", "cnn", "gpt", "gpt2", "llama"], help="a keel built-in model")
    which.add_argument("--module", metavar="PKG.MOD:FACTORY",
                       help="a user's nn.Module: FACTORY([batch=B], [device=D]) returns (module, example_input, "
                            "example_target[, loss_fn(output, target)])")
    p.add_argument("--example", metavar="JSON",
                   help="with --module: the shapes and dtypes of the batches ({\"input\": {\"shape\": [B, ...], "
                        "\"dtype\": \"float32\"}, \"target\": {...}, \"classes\": N}); the factory may then "
                        "return the module alone (how keel's model.name = \"python\" calls it)")
    p.add_argument("--init-out", metavar="PATH.safetensors",
                   help="with --module: write the module's initial parameters and buffers (after torch.manual_seed("
                        "--seed)) and stop; nothing is traced")
    p.add_argument("--model-config", default="{}", metavar="JSON",
                   help="keel's [model] keys as a JSON object (or @file.json): width, depth, heads, context, vocab, "
                        "num_classes; 0 or absent = keel's default")
    p.add_argument("--batch", type=int, help="per-rank micro-batch of the training step (required with --model)")
    p.add_argument("--eval-batch", type=int, help="batch of the 'forward' model (default: --batch)")
    p.add_argument("--amp", choices=["off", "bf16", "fp16"], default="off",
                   help="autocast traced into the step (fp16: CUDA only, adds the grad_scale input)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", metavar="PATH.pt2", help="the package (required unless --init-out)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU: intra-op threads the package is compiled for (Inductor bakes the count into its "
                        "kernels); 0 = torch.get_num_threads(). Must equal the trainer's per-rank threads")
    p.add_argument("--max-autotune", action="store_true", help="Inductor max_autotune (slower compile)")
    p.add_argument("--deterministic", action="store_true",
                   help="refuse non-deterministic ops (exit 4); compile with deterministic algorithms")
    p.add_argument("--fullgraph", action="store_true",
                   help="also treat data-dependent output shapes (x[mask], nonzero) as graph breaks")
    p.add_argument("--grad-scale-input", action="store_true",
                   help="add a float32 scalar input 'grad_scale': gradients are of loss * grad_scale (GradScaler, "
                        "1/grad_accum); the returned loss is unscaled. Implied by --amp fp16")
    p.add_argument("--no-forward", action="store_true", help="package only 'train_step' (no evaluation model)")
    p.add_argument("--load-library", action="append", default=[], metavar="LIB.so",
                   help="torch.ops.load_library() before tracing (custom ops registered with TORCH_LIBRARY)")
    p.add_argument("--trace-only", action="store_true",
                   help="trace, export and run the graph checks; write nothing (fast: no C++ compile)")
    p.add_argument("--check", action="store_true",
                   help="load the package, run it on random inputs and compare with eager PyTorch (exit 5 if off)")
    p.add_argument("--check-rtol", type=float, default=None,
                   help="--check: an output passes when max|compiled - eager| <= rtol * max|eager| + atol "
                        "(default rtol 1e-5; 3e-2 with --amp)")
    p.add_argument("--check-atol", type=float, default=None,
                   help="--check: see --check-rtol (default 1e-7; 1e-5 with --amp), for outputs that are ~0 "
                        "(e.g. the gradient of a bias followed by a normalisation)")
    p.add_argument("--seed", type=int, default=0, help="seed of the --check inputs and initial weights")
    p.add_argument("--granularity", choices=["step", "blocks"], default="step",
                   help="step: the whole training step as one model; blocks: a transformer block's forward and "
                        "backward as two models (block_forward, block_backward), reused for every block, and the "
                        "root's around them (embed_*, head_*, loss_*)")
    p.add_argument("--ignore-index", type=int, default=-100,
                   help="train.ignore_index: targets equal to it count for nothing in keel's cross-entropy")
    p.add_argument("--tp", type=int, default=1,
                   help="--granularity blocks under tensor parallelism: the block's two regions between its "
                        "collectives as one of N tp ranks holds them (attention_*, mlp_* models), not the block")
    p.add_argument("--verbose", action="store_true", help="Python tracebacks on failure")
    a = p.parse_args(argv)
    if a.out is None and not a.init_out:
        p.error("--out is required")
    if a.out is not None and not a.out.endswith(".pt2"):
        p.error("--out must end with .pt2")
    if a.model and a.batch is None:
        p.error("--batch is required with --model")
    if (a.example or a.init_out) and not a.module:
        p.error("--example and --init-out go with --module")
    for name in ("batch", "eval_batch"):
        v = getattr(a, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.threads < 0:
        p.error("--threads must be >= 0")
    if a.granularity == "blocks" and (a.module or a.check or not (a.graph or a.model in BLOCK_MODELS)):
        p.error("--granularity blocks packages the units keel traced (--graph) or the block of " +
                ", ".join(BLOCK_MODELS) + " (not --module, --check)")
    if a.tp < 1 or (a.tp > 1 and a.granularity != "blocks"):
        p.error("--tp N > 1 goes with --granularity blocks")
    if a.amp == "fp16":
        if a.device != "cuda":
            p.error("--amp fp16 needs --device cuda (keel's amp.dtype = fp16 is CUDA only)")
        a.grad_scale_input = True
    return a


def read_model_config(text: str) -> dict:
    if text.startswith("@"):
        with open(text[1:]) as f:
            text = f.read()
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise Refusal(EXIT_USAGE, f"--model-config is not JSON: {e}")
    if not isinstance(cfg, dict):
        raise Refusal(EXIT_USAGE, "--model-config must be a JSON object of keel's [model] keys")
    unknown = sorted(set(cfg) - MODEL_KEYS)
    if unknown:
        raise Refusal(EXIT_USAGE, f"--model-config: unknown key(s) {', '.join(unknown)} (keel's [model] keys: "
                                  f"{', '.join(sorted(MODEL_KEYS))})")
    out = dict(MODEL_DEFAULTS)
    for k, v in cfg.items():
        if k in MODEL_DEFAULTS:
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise Refusal(EXIT_USAGE, f"--model-config: {k} must be a non-negative integer, got {v!r}")
            out[k] = v
    if isinstance(cfg.get("hf_config"), dict):
        out["hf_config"] = cfg["hf_config"]
    return out


# ---------------------------------------------------------------------------------------------
# Models


def load_reference_models():
    """tests/golden/reference_models.py: PyTorch twins of keel's C++ models, same names."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.environ.get("KEEL_REFERENCE_MODELS", ""), os.path.join(here, "reference_models.py"),
                  os.path.join(here, "..", "..", "tests", "golden", "reference_models.py")]
    for path in candidates:
        if path and os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("keel_reference_models", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod, os.path.realpath(path)
    raise Refusal(EXIT_ERROR, "cannot find reference_models.py (keel's PyTorch model twins); set KEEL_REFERENCE_MODELS "
                              "to its path (tests/golden/reference_models.py in the source tree)")


def cpp_parameter_names(model: str, cfg: dict) -> list:
    """Parameter names in the order keel's C++ model registers them (models/*.cpp,
    torch::nn::Module::named_parameters(recurse=true): own parameters, then submodules in
    registration order). The reference module must produce exactly these."""
    lin = lambda p: [f"{p}.weight", f"{p}.bias"]  # Linear, Conv2d, LayerNorm: weight then bias
    if model == "mlp":
        return [n for i in range(cfg["depth"] + 1) for n in lin(f"fc.{i}")]
    if model == "cnn":
        return lin("conv1") + lin("conv2") + lin("fc1") + lin("fc2")
    names = ["wte.weight", "wpe.weight"]
    for i in range(cfg["depth"]):
        b = f"h.{i}"
        names += lin(f"{b}.ln_1") + lin(f"{b}.attn.c_attn") + lin(f"{b}.attn.c_proj") + lin(f"{b}.ln_2")
        names += lin(f"{b}.mlp.c_fc") + lin(f"{b}.mlp.c_proj")
    return names + lin("ln_f")


def hf_model(name: str, cfg: dict, batch: int):
    """keel's gpt2 and llama (models/hf.h) are transformers' GPT2LMHeadModel and
    LlamaForCausalLM, same tensor names: packaged from transformers' own model of the run's
    config.json (keel passes it as hf_config), without dropout (keel refuses a compiled step for a
    model that drops out, so its probabilities here are 0 or a file's that model.dropout = 0 overrode)."""
    import torch
    try:
        import transformers
    except ImportError as e:
        raise Refusal(EXIT_ERROR, f"model.name = {name} with compile.mode = inductor packages transformers' model: "
                                  f"{e} (scripts/setup.sh installs transformers into keel's venv)")
    hf = dict(cfg.get("hf_config") or {})
    if hf.get("model_type") != name:
        raise Refusal(EXIT_USAGE, f"model.name = {name}: no Hugging Face config was given (hf_config)")
    for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout"):
        if k in hf:
            hf[k] = 0.0
    config = transformers.AutoConfig.for_model(name, **{k: v for k, v in hf.items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    base = transformers.GPT2LMHeadModel if name == "gpt2" else transformers.LlamaForCausalLM

    class Logits(base):
        def forward(self, idx):
            return super().forward(input_ids=idx, use_cache=False).logits

        def _apply(self, fn, *args, **kwargs):  # .to(device) moves the constants too
            out = super()._apply(fn, *args, **kwargs)
            for m in self.modules():
                for n in getattr(m, "_keel_constants", ()):
                    object.__setattr__(m, n, fn(getattr(m, n)))
            return out

    module = Logits(config)
    # Llama's rotary frequencies are non-persistent buffers: keel's C++ model computes them and
    # has no buffers, so the package keeps them as constants instead of taking them as inputs.
    for m in module.modules():
        names = list(m._non_persistent_buffers_set)
        for n in names:
            t = m._buffers.pop(n)
            m._non_persistent_buffers_set.discard(n)
            object.__setattr__(m, n, t)  # a plain attribute (Module.__setattr__ would make it a buffer again)
        if names:
            m._keel_constants = names
    vocab = config.vocab_size
    x = torch.randint(0, vocab, (batch, cfg["context"]))
    y = torch.randint(0, vocab, (batch, cfg["context"]))
    graph_cfg = {"hf_config": cfg["hf_config"], "context": cfg["context"]}
    return module, x, y, None, {"model": name, "model_config": graph_cfg, "input_kind": "tokens",
                                "num_classes": vocab, "reference": f"transformers {transformers.__version__}"}


def builtin_model(name: str, cfg: dict, batch: int):
    """keel's model `name` with keel's defaults (models/*.cpp make_*), its input kind and the
    example input and target of one micro-batch."""
    import torch

    if name in ("gpt2", "llama"):
        return hf_model(name, cfg, batch)
    ref, ref_path = load_reference_models()
    if name == "mlp":
        cfg["width"] = cfg["width"] or 256
        cfg["depth"] = cfg["depth"] or 8
        module = ref.Mlp(width=cfg["width"], depth=cfg["depth"], classes=cfg["num_classes"])
    elif name == "cnn":
        module = ref.Cnn(classes=cfg["num_classes"])
    else:
        cfg["width"] = cfg["width"] or 256
        cfg["depth"] = cfg["depth"] or 4
        if cfg["heads"] < 1 or cfg["width"] % cfg["heads"] != 0:
            raise Refusal(EXIT_USAGE, f"model: width {cfg['width']} is not divisible by model.heads = {cfg['heads']}")
        if cfg["vocab"] < 2 or cfg["context"] < 1:
            raise Refusal(EXIT_USAGE, "model: vocab must be >= 2 and context >= 1")
        module = ref.Gpt(vocab=cfg["vocab"], context=cfg["context"], layers=cfg["depth"], heads=cfg["heads"],
                         d=cfg["width"])
    if name in ("mlp", "cnn"):
        if cfg["num_classes"] < 2:
            raise Refusal(EXIT_USAGE, "model: num_classes must be >= 2")
        graph_cfg = {k: cfg[k] for k in (("width", "depth", "num_classes") if name == "mlp" else ("num_classes",))}
        kind, classes = "image", cfg["num_classes"]
        x = torch.randn(batch, 1, 28, 28)
        y = torch.randint(0, classes, (batch,))
    else:
        graph_cfg = {k: cfg[k] for k in ("width", "depth", "heads", "context", "vocab")}
        kind, classes = "tokens", cfg["vocab"]
        x = torch.randint(0, classes, (batch, cfg["context"]))
        y = torch.randint(0, classes, (batch, cfg["context"]))
    names = [n for n, _ in module.named_parameters()]
    want = cpp_parameter_names(name, cfg)
    if names != want:
        raise Refusal(EXIT_ERROR, f"{ref_path}: the {name} twin's parameter names differ from keel's C++ model "
                                  f"({names[:4]}... vs {want[:4]}...): fix reference_models.py")
    return module, x, y, None, {"model": name, "model_config": graph_cfg, "input_kind": kind,
                                "num_classes": classes, "reference": ref_path}


GRAPH_FORMAT = "keel-graph/1"
MEMORY_FORMATS = ("contiguous_format", "preserve_format", "channels_last", "channels_last_3d")  # c10::MemoryFormat
LAYOUTS = ("strided", "sparse_coo", "sparse_csr", "mkldnn", "sparse_csc", "sparse_bsr", "sparse_bsc")  # c10::Layout


def graph_value(arg: dict, vals: dict, constants: list, device):
    """One argument of a keel-graph/1 node (trainer/compile/graph_file.cpp's Writer::literal/arg)."""
    import torch

    (kind, v), = arg.items()
    if kind == "v":
        return vals[v]
    if kind == "t":
        return constants[v]
    if kind == "f":
        return float(v)
    if kind in ("i", "b", "s"):
        return v
    if kind == "none":
        return None
    if kind in ("ints", "bools"):
        return list(v)
    if kind == "list":
        return [graph_value(a, vals, constants, device) for a in v]
    if kind == "dtype":
        return getattr(torch, v)
    if kind == "device":
        return torch.device("cpu") if v == "cpu" else device
    if kind == "layout":
        return getattr(torch, LAYOUTS[v])
    if kind == "memory_format":
        return getattr(torch, MEMORY_FORMATS[v])
    raise Refusal(EXIT_USAGE, f"--graph: an argument of kind {kind!r} this script does not read (a newer keel?)")


def graph_op(name: str, overload: str):
    import torch

    ns, _, op = name.partition("::")
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), overload or "default")
    except (AttributeError, RuntimeError):
        raise Refusal(EXIT_GRAPH_BREAK, f"the graph calls {name}.{overload or 'default'}, which this Python's torch "
                                        f"does not have (a custom op: compile.libraries)")


WRAPPED_NUMBER_OPS = ("aten::add", "aten::sub", "aten::mul", "aten::div", "aten::rsub", "aten::to",
                      "aten::_to_copy", "aten::copy_", "aten::floor_divide")


def run_graph(g: dict, inputs: list, constants: list, device):
    """Replays keel's traced graph through torch.ops on `inputs` (its inputs in order): its outputs."""
    import torch

    vals = dict(enumerate(inputs))
    for k, node in enumerate(g["nodes"]):
        op = node["op"]
        args = [graph_value(a, vals, constants, device) for a in node["args"]]
        if op == "prim::ListConstruct":
            out = [args]
        elif op == "prim::TupleConstruct":
            out = [tuple(args)]
        elif op in ("prim::ListUnpack", "prim::TupleUnpack"):
            out = list(args[0])
        elif op in ("prim::NumToTensor", "aten::Int", "aten::Float", "aten::Bool", "aten::ScalarImplicit"):
            out = args[:1]  # sizes, numbers already (graph_file.cpp refuses a value read from a tensor)
        elif op == "aten::_convolution":  # what torch::conv2d records; Inductor lowers aten.convolution
            # (input, weight, bias, stride, padding, dilation, transposed, output_padding, groups), without
            # the backend flags (benchmark, deterministic, cudnn_enabled, allow_tf32)
            out = [graph_op("aten::convolution", "")(*args[:9])]
        else:
            fn = graph_op(op, node.get("overload", ""))
            for i, formal in enumerate(fn._schema.arguments[:len(args)]):
                # int[2] given as one value is that value twice (ATen's broadcast): written out, as
                # Python passes it, for Inductor's lowerings, which index both
                if formal.N and isinstance(args[i], list) and len(args[i]) == 1:
                    args[i] = args[i] * formal.N
                # A C++ number the op took as a (wrapped-number) tensor: torch.ops takes a Python
                # number there only for the arithmetic ops; elsewhere a 0-dim tensor of the dtype a
                # wrapped number promotes as (float32, int64, bool), which promotes alike
                if (str(formal.type) == "Tensor" and isinstance(args[i], (bool, int, float))
                        and op not in WRAPPED_NUMBER_OPS):
                    dtype = torch.bool if isinstance(args[i], bool) else (
                        torch.int64 if isinstance(args[i], int) else torch.float32)
                    args[i] = torch.scalar_tensor(args[i], dtype=dtype)
            formals = [f.name for f in fn._schema.arguments]
            if "kernel_size" in formals and "stride" in formals and args[formals.index("stride")] == []:
                # a pooling's empty stride is its kernel size (ATen's rule), written out likewise
                args[formals.index("stride")] = list(args[formals.index("kernel_size")])
            pos, kw = [], {}
            for formal, a in zip(fn._schema.arguments, args):
                (kw.__setitem__(formal.name, a) if formal.kwarg_only else pos.append(a))
            try:
                r = fn(*pos, **kw)
            except Refusal:
                raise
            except Exception as e:
                e.keel_node = (k, op)
                raise
            out = [r] if len(node["out"]) == 1 else list(r)
        vals.update(zip(node["out"], out))
    return [graph_value(a, vals, constants, device) for a in g["outputs"]]


class UnitReplay:
    """Marks a module that replays a unit keel traced: its autocast casts are in the graph, so the
    tracing here applies none (partition_block)."""
    traced_autocast = True


def graph_units(g: dict, tensors, dev):
    """(container, x, x, None, ident) of a keel-graphs/1 bundle (trainer/compile/unit_trace.h): each
    unit a module of the container whose parameters are registered flat ("ln_1__weight"; keel's
    names in keel_names, in the graph's order) and whose forward(x[, (target,)]) replays the unit.
    container.units: name -> (module, example input, {name: extra input}, the extra's kind)."""
    import torch

    class Unit(torch.nn.Module, UnitReplay):
        def __init__(self, u, constants):
            super().__init__()
            self.u, self.constants = u, constants
            self.keel_names = [i["name"] for i in u["inputs"] if i["kind"] == "parameter"]
            for i in u["inputs"]:
                if i["kind"] == "parameter":  # values of its own: the package takes keel's as inputs
                    t = torch.randn(i["shape"], dtype=getattr(torch, i["dtype"])) * 0.02
                    self.register_parameter(i["name"].replace(".", "__"), torch.nn.Parameter(t))

        def forward(self, x, position_embeddings=(), constants=None):  # partition_block passes the extras so
            extra, inputs = list(position_embeddings), []
            for i in self.u["inputs"]:
                kind = i["kind"]
                if kind not in ("parameter", "input", "target"):
                    raise Refusal(EXIT_USAGE, f"--graph: a unit input of kind {kind!r} this script does not take")
                inputs.append(getattr(self, i["name"].replace(".", "__")) if kind == "parameter"
                              else x if kind == "input" else extra.pop(0))
            return run_graph(self.u, inputs, self.constants if constants is None else constants, dev)[0]

    container = torch.nn.Module()
    container.units = {}
    for name, u in g["units"].items():
        base = u["tensor_base"]
        constants = [t.to(dev) for t in tensors[base:base + u["constants"]]]
        examples = {k: tensors[base + i] for k, i in u["examples"].items()}
        module = Unit(u, constants)
        container.add_module(name, module)
        extra = {k: examples[k] for k in (i["name"] for i in u["inputs"] if i["kind"] == "target")}
        container.units[name] = (module, examples["input"], extra, "target")
    first = next(iter(container.units.values()))[1]
    return container, first, first, None, {"model": "graph", "graph": sorted(g["units"]), "input_kind": "graph"}


def graph_model(path: str, device: str):
    """(module, x, y, None, ident) of --graph: keel's traced C++ step (trainer/compile/graph_file.h)
    as a module whose parameters and buffers carry keel's names and whose forward(input, target)
    replays the graph and returns the loss. The graph holds its own casts (autocast was traced).
    A bundle of units (--granularity blocks): graph_units."""
    import torch

    try:
        with open(path) as f:
            g = json.load(f)
        tensors = torch.load(path + ".pt", weights_only=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise Refusal(EXIT_USAGE, f"--graph {path}: cannot be read ({e})")
    dev = torch.device(device)
    if g.get("format") == "keel-graphs/1":
        return graph_units(g, tensors, dev)
    if g.get("format") != GRAPH_FORMAT:
        raise Refusal(EXIT_USAGE, f"--graph {path}: not a {GRAPH_FORMAT} file")
    constants = [t.to(dev) for t in tensors[:g["constants"]]]
    examples = {name: tensors[i] for name, i in g["examples"].items()}

    class Replay(torch.nn.Module):
        returns_loss = True

        def forward(self, x, y):
            inputs = []
            for spec in g["inputs"]:
                kind = spec["kind"]
                if kind in ("input", "target"):
                    inputs.append(x if kind == "input" else y)
                    continue
                t = self  # by attribute: functional_call puts plain tensors where the parameters were
                for part in spec["name"].split("."):
                    t = getattr(t, part)
                inputs.append(t)
            return run_graph(g, inputs, constants, dev)[0]

    module = Replay()
    torch.manual_seed(0)
    for spec in g["inputs"]:
        if spec["kind"] not in ("parameter", "buffer"):
            continue
        *path_, leaf = spec["name"].split(".")
        m = module
        for part in path_:
            if part not in m._modules:
                m.add_module(part, torch.nn.Module())
            m = m._modules[part]
        if spec["kind"] == "parameter":  # values of its own: the package takes keel's as inputs
            t = torch.randn(spec["shape"], dtype=getattr(torch, spec["dtype"])) * 0.02
            m.register_parameter(leaf, torch.nn.Parameter(t))
        else:
            m.register_buffer(leaf, examples[spec["name"]].clone())
    x, y = examples["input"], examples["target"]
    return module, x, y, None, {"model": "graph", "graph": g["what"], "input_kind": "graph"}


def import_factory(spec: str):
    """FACTORY of --module: PKG.MOD:FACTORY (imported from sys.path and the working directory) or
    FILE.py:FACTORY (keel's model.path; the file's directory goes first on sys.path, so that it
    can import its neighbours)."""
    if ":" not in spec:
        raise Refusal(EXIT_USAGE, f"--module {spec}: must be PKG.MOD:FACTORY or FILE.py:FACTORY")
    where, fn_name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise Refusal(EXIT_USAGE, f"--module {spec}: {where} is not a file")
            path = os.path.realpath(where)
            sys.path.insert(0, os.path.dirname(path))
            spec_ = importlib.util.spec_from_file_location("keel_user_model", path)
            mod = importlib.util.module_from_spec(spec_)
            sys.modules["keel_user_model"] = mod
            spec_.loader.exec_module(mod)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            mod = importlib.import_module(where)
    except Refusal:
        raise
    except SystemExit as e:  # sys.exit() while the user's module is imported
        raise Refusal(EXIT_USAGE, f"--module {spec}: importing it ended the interpreter (sys.exit({e.code!r}))")
    except Exception as e:  # the user's module failed to import: name the file and line
        found, _ = user_frame(e.__traceback__)
        at = f" at {found[1].f_code.co_filename}:{found[2]}" if found else ""
        raise Refusal(EXIT_USAGE, f"--module {spec}: importing it failed{at}: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}")
    factory = getattr(mod, fn_name, None)
    if not callable(factory):
        raise Refusal(EXIT_USAGE, f"--module {spec}: {where} has no function {fn_name}")
    return factory


def read_example(text: str):
    """--example: the shapes and dtypes of keel's batches, {"input": {"shape": [...], "dtype": "float32"},
    "target": {...}, "classes": N}; random tensors of them (integer tensors drawn in [0, classes))."""
    import torch

    try:
        ex = json.loads(text)
        classes = int(ex.get("classes", 0))
        out = []
        for k in ("input", "target"):
            shape, dtype = [int(d) for d in ex[k]["shape"]], getattr(torch, ex[k]["dtype"])
            out.append(torch.randn(shape, dtype=dtype) if dtype.is_floating_point else
                       torch.randint(0, max(classes, 1), shape, dtype=dtype))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise Refusal(EXIT_USAGE, f"--example: {type(e).__name__}: {e} (want {{\"input\": {{\"shape\": [...], "
                                  f"\"dtype\": \"float32\"}}, \"target\": {{...}}, \"classes\": N}})")
    return out[0], out[1], classes


def user_model(spec: str, batch, device: str, example: str = None, model_config: dict = None):
    """A user's module. FACTORY([batch=B], [device=D], [config=C]) returns (module, example_input,
    example_target[, loss_fn]); with --example (how keel calls it: its data decides the shapes) it
    may return the module alone. C is keel's [model] section as a dict."""
    import torch

    factory = import_factory(spec)
    params = inspect.signature(factory).parameters
    kw = {}
    # keel (--example) builds the module once for its weights and again to compile it: the factory
    # gets neither the batch nor the device then, so that both builds are the same module.
    if "batch" in params and batch is not None and example is None:
        kw["batch"] = batch
    if "device" in params and example is None:
        kw["device"] = device
    if "config" in params:
        kw["config"] = dict(model_config or {})
    try:
        got = factory(**kw)
    except SystemExit as e:  # sys.exit() in the user's factory: the module's doing, not a status of ours
        raise Refusal(EXIT_USAGE, f"--module {spec}: the factory ended the interpreter (sys.exit({e.code!r})) "
                                  f"instead of returning a module")
    except Exception as e:
        found, _ = user_frame(e.__traceback__)
        at = f" at {found[1].f_code.co_filename}:{found[2]}" if found else ""
        raise Refusal(EXIT_USAGE, f"--module {spec}: the factory failed{at}: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}")
    file = spec.rsplit(":", 1)[0]
    ident = {"module": spec, "input_kind": "features"}
    if file.endswith(".py"):
        ident["module_sha256"] = sha256_file(file)
    if example is not None:
        module = got[0] if isinstance(got, (tuple, list)) and got else got
        if isinstance(got, (tuple, list)) and len(got) == 4:
            raise Refusal(EXIT_USAGE, f"--module {spec}: the factory returns a loss_fn; keel trains a Python module "
                                      "with its cross-entropy over the last dimension (return the module alone)")
        if not isinstance(module, torch.nn.Module):
            raise Refusal(EXIT_USAGE, f"--module {spec}: the factory must return an nn.Module, got "
                                      f"{type(module).__name__}")
        x, y, classes = read_example(example)
        if batch is not None and x.shape[0] != batch:
            raise Refusal(EXIT_USAGE, f"--example: the input's batch is {x.shape[0]}, not --batch {batch}")
        return module, x, y, None, {**ident, "num_classes": classes, "loss": "cross_entropy"}
    if not isinstance(got, (tuple, list)) or len(got) not in (3, 4):
        raise Refusal(EXIT_USAGE, f"--module {spec}: the factory must return (module, example_input, example_target"
                                  f"[, loss_fn]), got {type(got).__name__}")
    module, x, y = got[:3]
    loss_fn = got[3] if len(got) == 4 else None
    if not isinstance(module, torch.nn.Module) or not torch.is_tensor(x) or not torch.is_tensor(y):
        raise Refusal(EXIT_USAGE, f"--module {spec}: expected (nn.Module, Tensor, Tensor), got "
                                  f"({type(module).__name__}, {type(x).__name__}, {type(y).__name__})")
    if batch is not None and x.shape[0] != batch:
        raise Refusal(EXIT_USAGE, f"--module {spec}: the example input's batch is {x.shape[0]}, not --batch {batch} "
                                  "(give the factory a `batch` parameter)")
    return module, x, y, loss_fn, {**ident, "loss": "custom" if loss_fn else "cross_entropy"}


def write_init(module, path: str, spec: str) -> None:
    """--init-out: the module's parameters and buffers (named_parameters()/named_buffers() order,
    tied weights once) as safetensors, with the module tree's order in the metadata, so that keel
    builds a C++ module holding exactly these tensors (trainer/compile/python_model.h)."""
    from safetensors.torch import save_file

    pnames = [n for n, _ in module.named_parameters()]
    bnames = [n for n, _ in module.named_buffers()]
    if not pnames:
        raise Refusal(EXIT_USAGE, f"--module {spec}: the module has no parameters")
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    if frozen:
        raise Refusal(EXIT_USAGE, f"--module {spec}: parameters with requires_grad = False ({', '.join(frozen[:3])}"
                                  f"{', ...' if len(frozen) > 3 else ''}): keel trains every parameter; register "
                                  "frozen tensors as buffers (register_buffer) instead")
    tensors = {n: t.detach().to("cpu").contiguous().clone() for n, t in
               list(module.named_parameters()) + list(module.named_buffers())}
    metadata = {"format": "keel-python-init/1", "module": spec,
                "parameters": json.dumps(pnames), "buffers": json.dumps(bnames),
                "modules": json.dumps([n for n, _ in module.named_modules() if n])}
    out = os.path.abspath(path)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(out), prefix=".init-")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"wrote {out}: {len(pnames)} parameters, {len(bnames)} buffers", flush=True)


IGNORE_INDEX = -100  # --ignore-index (main() sets it before anything is traced)


def keel_cross_entropy(logits, target):
    """trainer/loss.cpp cross_entropy(): over the last dimension, the sum over the targets that are
    not IGNORE_INDEX divided by their count (at least 1): PyTorch's mean where any target counts,
    0 where none does."""
    import torch.nn.functional as F

    t = target.reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), t, reduction="sum", ignore_index=IGNORE_INDEX)
    return total / t.ne(IGNORE_INDEX).sum().clamp_min(1).to(total.dtype)


# ---------------------------------------------------------------------------------------------
# The traced functions


class TrainStep:
    """step(*params, *buffers, input, target[, grad_scale]) -> (loss, *grads, *new buffers)."""

    def __init__(self, module, pnames, bnames, loss_fn, amp_dtype, device_type, grad_scale):
        self.module, self.pnames, self.bnames = module, pnames, bnames
        self.loss_fn = loss_fn or keel_cross_entropy
        self.amp_dtype, self.device_type, self.grad_scale = amp_dtype, device_type, grad_scale
        # Indices of the buffers returned (updated) after the gradients: all of them while
        # tracing; then only those the graph mutates (prune_buffer_outputs()).
        self.returned = None
        # A user's module with keel's loss: what its output must be (expected_logits()).
        self.expect = None

    def __call__(self, *flat):
        import torch

        n_p, n_b = len(self.pnames), len(self.bnames)
        params, bufs = flat[:n_p], flat[n_p:n_p + n_b]
        x, y = flat[n_p + n_b], flat[n_p + n_b + 1]
        with torch.enable_grad():
            ps = [p.detach().requires_grad_(True) for p in params]
            # Buffers are copied so that the graph stays functional: a forward that updates
            # them (BatchNorm running stats) updates the copies, returned as extra outputs.
            bs = [b.clone() for b in bufs]
            state = dict(zip(self.pnames, ps))
            state.update(zip(self.bnames, bs))
            if getattr(self.module, "returns_loss", False):  # keel's traced step: its casts are in the graph
                loss = torch.func.functional_call(self.module, state, (x, y), strict=True, tie_weights=True)
            else:
                amp = (torch.autocast(self.device_type, dtype=self.amp_dtype) if self.amp_dtype is not None
                       else contextlib.nullcontext())
                with amp:  # as keel: forward and loss under autocast, the loss then cast to float32
                    out = torch.func.functional_call(self.module, state, (x,), strict=True, tie_weights=True)
                    if self.expect is not None:
                        check_logits(out, y, self.expect)
                    loss = self.loss_fn(out, y).to(torch.float32)
            seed = loss * flat[n_p + n_b + 2] if self.grad_scale else loss
            grads = torch.autograd.grad(seed, ps, allow_unused=True, materialize_grads=True)
        returned = range(len(bs)) if self.returned is None else self.returned
        return (loss.detach(), *grads, *(bs[i] for i in returned))


class Forward:
    """forward(*params, *buffers, input) -> logits, in eval mode, no autocast (as keel's evaluate())."""

    def __init__(self, module, pnames, bnames):
        self.module, self.pnames, self.bnames = module, pnames, bnames

    def __call__(self, *flat):
        import torch

        n_p, n_b = len(self.pnames), len(self.bnames)
        state = dict(zip(self.pnames, flat[:n_p]))
        state.update(zip(self.bnames, [b.clone() for b in flat[n_p:n_p + n_b]]))
        with torch.no_grad():
            out = torch.func.functional_call(self.module, state, (flat[n_p + n_b],), strict=True, tie_weights=True)
        return tuple(torch.utils._pytree.tree_leaves(out))


def expected_logits(module, spec: str, classes, x) -> dict:
    """What TrainStep checks of a user's module's output before keel's loss (cross-entropy over
    the last dimension, one row per target): a floating-point tensor [*target.shape, classes].
    Without the check, a last dimension other than keel's class count compiles and then reads out
    of bounds inside the package at run time."""
    file = spec.rsplit(":", 1)[0]
    where = f"model.path {file}" if file.endswith(".py") else f"--module {spec}"
    name = f"{type(module).__name__}.forward"
    try:
        fn = type(module).forward
        src = inspect.getsourcefile(fn)
        if src and not _is_torch_file(src):
            where = f"model.path {src}:{inspect.getsourcelines(fn)[1]}"
    except (TypeError, OSError, AttributeError):
        pass
    # keel gives token models (integer inputs) model.vocab classes, the others model.num_classes
    key = "model.vocab" if not x.is_floating_point() else "model.num_classes"
    return {"classes": int(classes) if classes else None, "key": key, "where": f"{where} ({name})"}


def check_logits(out, target, expect: dict) -> None:
    import math

    import torch

    classes, key, where = expect["classes"], expect["key"], expect["where"]
    loss = "keel's loss is cross-entropy over the last dimension"
    if not torch.is_tensor(out):
        raise Refusal(EXIT_USAGE, f"{where}: returns a {type(out).__name__}, not a tensor of logits ({loss}: return "
                                  f"one tensor of shape {list(target.shape) + [classes or 'classes']})")
    shape = list(out.shape)
    want = list(target.shape) + [classes if classes else shape[-1] if shape else "classes"]
    # Fewer logits than classes reads out of bounds; more (a vocabulary padded to 50304) is fine.
    if out.dim() >= 2 and classes and shape[-1] < classes:
        raise Refusal(EXIT_USAGE, f"{where}: returns logits of shape {shape}, whose last dimension {shape[-1]} is "
                                  f"less than {key} = {classes} ({loss}, over {key} classes: want {want})")
    if out.dim() < 2 or math.prod(shape[:-1]) != target.numel():
        raise Refusal(EXIT_USAGE, f"{where}: returns logits of shape {shape} for targets of shape "
                                  f"{list(target.shape)} ({loss}, one row per target: want {want})")
    if not out.is_floating_point():
        raise Refusal(EXIT_USAGE, f"{where}: returns {str(out.dtype).replace('torch.', '')} logits; {loss}, which "
                                  "takes floating-point logits")


# ---------------------------------------------------------------------------------------------
# Where a failure comes from


def _is_torch_file(path: str) -> bool:
    import torch

    torch_dir = os.path.dirname(os.path.realpath(torch.__file__))
    real = os.path.realpath(path)
    return real.startswith(torch_dir + os.sep) or real.startswith(os.path.dirname(contextlib.__file__) + os.sep)


def _is_this_file(path: str) -> bool:
    return os.path.realpath(path) == os.path.realpath(__file__)


def user_frame(tb):
    """(index, frame, lineno) of the innermost frame of the user's (or keel's) code in a traceback."""
    entries = []
    while tb is not None:
        entries.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    best = None
    for i, (fr, line) in enumerate(entries):
        path = fr.f_code.co_filename
        if _is_torch_file(path) or path.startswith("<"):
            continue
        if _is_this_file(path) and best is not None and not _is_this_file(best[1].f_code.co_filename):
            continue  # prefer model code over this script's wrappers
        best = (i, fr, line)
    return best, entries


def _is_library_file(path: str) -> bool:
    parts = os.path.realpath(path).split(os.sep)
    return "site-packages" in parts or "dist-packages" in parts


def user_refusal(e: BaseException, spec: str, what: str):
    """A Refusal(EXIT_USAGE) naming the user's FILE:LINE when `e` was raised by (or through) the
    user's code: the innermost frame of the traceback in the module's file or in another file of
    the user's (not torch, a library in site-packages, the standard library or this script).
    None when no frame is the user's: then the failure is keel's own (exit 1)."""
    module_file = spec.rsplit(":", 1)[0]
    module_file = os.path.realpath(module_file) if module_file.endswith(".py") else None
    inner = None
    tb = e.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        ours = not (path.startswith("<") or _is_torch_file(path) or _is_this_file(path) or _is_library_file(path))
        if ours or (module_file and os.path.realpath(path) == module_file):
            inner = (path, tb.tb_lineno)
        tb = tb.tb_next
    if inner is None:
        return None
    file, line = inner
    if module_file and os.path.realpath(file) == module_file:
        where = f"model.path {file}:{line}"
    elif module_file:
        where = f"model.path {spec.rsplit(':', 1)[0]}: at {file}:{line}"
    else:
        where = f"--module {spec}: at {file}:{line}"
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    src = source_text(file, line)
    return Refusal(EXIT_USAGE, f"{where}: {type(e).__name__}: {msg} (in {what}{': ' + src if src else ''})")


@contextlib.contextmanager
def blaming_user(spec, what: str):
    """Around code that runs the user's module (spec: --module; None for a built-in model): an
    exception raised through the user's code becomes Refusal(EXIT_USAGE) naming the file and line."""
    try:
        yield
    except Refusal:
        raise
    except MemoryError:
        raise  # the machine's, not the user's line
    except Exception as e:
        if type(e).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError
            raise
        r = user_refusal(e, spec, what) if spec else None
        if r is None:
            raise
        raise r from e


def describe_break(e: BaseException):
    """(file, line, op, reason) of a construct make_fx could not capture."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    if hasattr(e, "keel_node"):  # a node of keel's graph file: its index and op
        k, op = e.keel_node
        return "the traced step, node", k, op, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    found, entries = user_frame(e.__traceback__)
    file, line, op = "<unknown>", 0, None
    if found:
        i, fr, line = found
        file = fr.f_code.co_filename
        for fr2, _ in entries[i + 1:]:
            func = fr2.f_locals.get("func")
            if callable(func) and not isinstance(func, type):
                op = getattr(func, "__qualname__", None) or str(func)
                op = op.replace("TensorBase.", "Tensor.").replace("_TensorBase.", "Tensor.")
                if hasattr(func, "_schema"):
                    op = func._schema.name
                break
            name = fr2.f_code.co_name
            if name.startswith("__") and name.endswith("__"):
                self_obj = fr2.f_locals.get("self")
                op = f"{type(self_obj).__name__}.{name}" if self_obj is not None else name
                break
    func = getattr(e, "func", None)
    if func is not None and hasattr(func, "_schema"):
        op = op or func._schema.name
    op = op or type(e).__name__
    if isinstance(e, DynamicOutputShapeException):
        reason = "output shape depends on tensor values"
    elif isinstance(e, DataDependentOutputException):
        reason = "a Python value read from a tensor"
    elif op.endswith("__bool__"):
        reason = "data-dependent control flow: a Python branch on a tensor's value"
    elif any(op.endswith(s) for s in ("__int__", "__float__", "__index__", "item", "tolist")):
        reason = "a Python number read from a tensor's value"
    else:
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
    return file, line, op, reason


def location_of_node(node):
    """FILE:LINE of the innermost user frame in a traced node's stack trace."""
    st = node.meta.get("stack_trace") or ""
    best = None
    for ln in st.splitlines():
        ln = ln.strip()
        if ln.startswith('File "'):
            try:
                path = ln.split('"')[1]
                lineno = int(ln.split("line ")[1].split(",")[0])
            except (IndexError, ValueError):
                continue
            if _is_torch_file(path) or path.startswith("<"):
                continue
            if _is_this_file(path) and best is not None and not _is_this_file(best[0]):
                continue
            best = (path, lineno)
    return best or ("<unknown>", 0)


def source_text(file: str, line: int) -> str:
    return linecache.getline(file, line).strip() if line else ""


def op_name(node) -> str:
    t = node.target
    if hasattr(t, "_schema"):
        return t._schema.name
    return getattr(t, "__name__", str(t))


# ---------------------------------------------------------------------------------------------
# Trace, export, compile


def trace(fn, example, what: str):
    import torch
    from torch._subclasses.fake_tensor import UnsupportedOperatorException
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    # Batch norm's forward kernels update the running statistics in place without saying so in
    # their schemas (aten::native_batch_norm has no Tensor(a!)); export would then drop the
    # update. Decomposed, the update is an explicit copy_ into the buffer's copy, which export
    # turns into an output.
    aten = torch.ops.aten
    bn = [aten.native_batch_norm, aten._native_batch_norm_legit, aten._batch_norm_with_update, aten.cudnn_batch_norm]
    if hasattr(aten, "miopen_batch_norm"):
        bn.append(aten.miopen_batch_norm)
    decompositions = torch._decomp.get_decompositions(bn)
    try:
        return make_fx(fn, decomposition_table=decompositions, tracing_mode="fake", record_stack_traces=True,
                       _allow_non_fake_inputs=True)(*example)
    except UnsupportedOperatorException as e:
        func = getattr(e, "func", None)
        name = func._schema.name if func is not None and hasattr(func, "_schema") else str(func)
        ns = name.split("::")[0]
        file, line, _, _ = describe_break(e)
        if ns not in ("aten", "prims"):
            raise Refusal(EXIT_NO_FAKE_KERNEL,
                          f"custom op {name} has no fake kernel: the graph cannot be traced at {file}:{line} "
                          f"(register one: torch.library.register_fake(\"{name}\") in Python, or a Meta kernel, "
                          f"TORCH_LIBRARY_IMPL({ns}, Meta, m), in C++, loaded with --load-library)")
        raise Refusal(EXIT_GRAPH_BREAK, f"graph break at {file}:{line}: {name} (no fake-tensor kernel)")
    except (GuardOnDataDependentSymNode, torch._subclasses.fake_tensor.DataDependentOutputException,
            torch._subclasses.fake_tensor.DynamicOutputShapeException) as e:
        file, line, op, reason = describe_break(e)
        raise Refusal(EXIT_GRAPH_BREAK, f"graph break at {file}:{line}: {op} ({reason}) in {what}: "
                                        f"{source_text(file, line)}")


def name_placeholders(gm, names):
    """Gives the graph's inputs keel's names (cosmetic: the package is called by position)."""
    import re

    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(nodes) == len(names), (len(nodes), len(names))
    for node, name in zip(nodes, names):
        ident = re.sub(r"\W", "_", name)
        if ident[:1].isdigit():
            ident = "_" + ident
        node._rename(ident)
        node.target = node.name
    gm.recompile()


def prune_buffer_outputs(gm, example, n_params: int, n_buffers: int, n_grads: int):
    """The traced step returns every buffer's copy after the gradients; keep only those the step
    changes. Schemas do not say it reliably (aten::native_batch_norm updates its running stats
    with no Tensor(a!) annotation), so the graph is exported once (export functionalizes it) and
    a buffer whose output is still a plain copy of its input is dropped. Returns the indices of
    the buffers kept."""
    import torch

    if n_buffers == 0:
        return []
    ep = torch.export.export(gm, tuple(example), strict=False)
    out = [n for n in ep.graph.nodes if n.op == "output"][0]
    bufs = list(out.args[0])[1 + n_grads:]
    assert len(bufs) == n_buffers, (len(bufs), n_buffers)
    keep = []
    for i, node in enumerate(bufs):
        while node.op == "call_function" and op_name(node) in ("aten::clone", "aten::alias", "aten::detach"):
            node = node.args[0]
        if node.op != "placeholder":
            keep.append(i)
    out = [n for n in gm.graph.nodes if n.op == "output"][0]
    vals = list(out.args[0])
    out.args = (tuple(vals[:1 + n_grads] + [vals[1 + n_grads + i] for i in keep]),)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return keep


def check_graph(gm, args, device: str, label: str):
    """Graph-level pitfalls: random and non-deterministic ops, data-dependent shapes, device
    transfers, baked-in tensor constants. Returns findings; raises with --deterministic and
    --fullgraph."""
    import torch

    found = {"random": [], "nondeterministic": [], "dynamic_shapes": [], "device_transfers": [], "constants": []}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            val = getattr(gm, node.target, None)
            if torch.is_tensor(val) and all(c["name"] != node.target for c in found["constants"]):
                found["constants"].append({"name": node.target, "shape": list(val.shape),
                                           "dtype": str(val.dtype).replace("torch.", "")})
            continue
        if node.op != "call_function":
            continue
        name = op_name(node)
        file, line = location_of_node(node)
        where = {"op": name, "file": file, "line": line}
        if name in RANDOM_OPS:
            found["random"].append(where)
        elif device == "cuda" and name in CUDA_NONDETERMINISTIC_OPS:
            found["nondeterministic"].append(where)
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        if any(torch.is_tensor(v) and any(not isinstance(s, int) for s in v.shape) for v in vals):
            found["dynamic_shapes"].append(where)
        if name in ("aten::_to_copy", "aten::to") and "device" in node.kwargs:
            dev = node.kwargs["device"]
            if dev is not None and torch.device(dev).type != device:
                found["device_transfers"].append(dict(where, to=str(dev)))
    if args.deterministic:
        bad = found["random"] + found["nondeterministic"]
        if bad:
            first = bad[0]
            others = sorted({b["op"] for b in bad} - {first["op"]})
            kind = "random" if first in found["random"] else "no deterministic CUDA kernel"
            raise Refusal(EXIT_NONDETERMINISTIC,
                          f"non-deterministic op at {first['file']}:{first['line']}: {first['op']} ({kind}"
                          f"{'; also ' + ', '.join(others) if others else ''})")
    if args.fullgraph:
        for key, why in (("dynamic_shapes", "output shape depends on tensor values"),
                         ("device_transfers", "a device transfer inside the graph")):
            if found[key]:
                f = found[key][0]
                raise Refusal(EXIT_GRAPH_BREAK, f"graph break at {f['file']}:{f['line']}: {f['op']} ({why})")
    for key in ("random", "nondeterministic", "dynamic_shapes", "device_transfers"):
        unique = {}
        for f in found[key]:
            unique.setdefault((f["op"], f["file"], f["line"]), f)
        found[key] = list(unique.values())
        for f in found[key]:
            log(f"warning: {label}: {key.replace('_', ' ')}: {f['op']} at {f['file']}:{f['line']}")
    if found["constants"]:
        log(f"warning: {label}: tensor constants baked into the graph (not parameters or buffers): "
            f"{', '.join(c['name'] for c in found['constants'])}")
    return found


def deterministic_dry_run(step, real_inputs):
    """One eager step with torch.use_deterministic_algorithms(True): ATen raises for kernels
    with no deterministic implementation on this device; name the op and the line."""
    import torch

    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        step(*real_inputs)
    except RuntimeError as e:
        msg = str(e)
        if "does not have a deterministic implementation" not in msg:
            raise
        op = msg.split(" does not have a deterministic implementation")[0].strip()
        found, _ = user_frame(e.__traceback__)
        file, line = (found[1].f_code.co_filename, found[2]) if found else ("<unknown>", 0)
        raise Refusal(EXIT_NONDETERMINISTIC, f"non-deterministic op at {file}:{line}: {op} (no deterministic "
                                             f"kernel on this device)")
    finally:
        torch.use_deterministic_algorithms(prev)


def tensor_spec(name, t, kind):
    return {"name": name, "kind": kind, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}


def compile_one(ep, options):
    import torch

    gm = ep.module(check_guards=False)
    ex_args, ex_kwargs = ep.example_inputs
    return torch._inductor.aot_compile(gm, ex_args, ex_kwargs, options=options)


def graph_fingerprint(gm) -> str:
    """SHA-256 of a graph's nodes: op, target, arguments, output shapes, dtypes and strides; no
    source locations (the same model from another checkout hashes the same)."""
    import torch

    def meta(v):
        if isinstance(v, (tuple, list)):
            return [meta(x) for x in v]
        if torch.is_tensor(v):
            return [str(v.dtype), [str(s) for s in v.shape], [str(s) for s in v.stride()], v.device.type]
        return repr(type(v).__name__)

    h = hashlib.sha256()
    for n in gm.graph.nodes:
        target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        if hasattr(n.target, "_schema"):
            target = f"{n.target._schema.name}.{n.target._overloadname}"
        h.update(repr((n.op, n.name, target, str(n.args), str(sorted(n.kwargs.items())),
                       meta(n.meta.get("val")))).encode())
        h.update(b"\n")
    return h.hexdigest()


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def environment(device: str, threads: int) -> dict:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.version.cuda,
           "machine": platform.machine()}
    if device == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler
            from torch._inductor.cpu_vec_isa import pick_vec_isa

            cxx = get_cpp_compiler()
            ver = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
            env["cxx"] = {"path": cxx, "version": ver.splitlines()[0] if ver else ""}
            env["cpu_vec_isa"] = str(pick_vec_isa()) or "none"
        except Exception as e:  # informative only
            env["cxx"] = {"error": str(e)}
        env["threads"] = threads
    else:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                      "arch": f"sm_{props.major}{props.minor}"}
    return env


def stage(path: str):
    """A fresh directory beside `path` and the path of a file in it with `path`'s name (a PT2
    archive records its file name inside, so the staged package is the final one byte for
    byte). publish() renames it over `path`: readers see the old file or the whole new one."""
    d = os.path.dirname(os.path.abspath(path)) or "."
    tmpdir = tempfile.mkdtemp(dir=d, prefix="." + os.path.basename(path) + ".tmp-")
    return tmpdir, os.path.join(tmpdir, os.path.basename(path))


def publish(tmp: str, path: str) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def discard(tmpdir: str) -> None:
    import shutil

    shutil.rmtree(tmpdir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Check


def compare(name, got, want):
    import torch

    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    if got.shape != want.shape:
        return {"name": name, "abs": float("inf"), "rel": float("inf"), "scale": 0.0, "note": f"shape {list(got.shape)} vs "
                                                                              f"{list(want.shape)}"}
    diff = (got - want).abs().max().item() if got.numel() else 0.0
    scale = want.abs().max().item() if want.numel() else 0.0
    finite = bool(torch.isfinite(got).all()) and bool(torch.isfinite(want).all())
    rel = diff / scale if scale > 0 else diff
    return {"name": name, "abs": diff if finite else float("inf"), "rel": rel if finite else float("inf"),
            "scale": scale}


def median_ms(fn, reps=5):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times), statistics.median(times)


def run_check(path, models, rtol, atol, device):
    import torch
    from torch._inductor.package import load_package

    report = {"rtol": rtol, "atol": atol, "models": {}}
    ok = True
    for model_name, (fn, inputs, out_names, unscale) in models.items():
        compiled = load_package(path, model_name)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        got = compiled(*inputs)
        want = fn(*inputs)
        # gradients of loss * grad_scale are compared unscaled, so that atol means the same
        rows = [compare(n, g / u, w / u) for n, g, w, u in zip(out_names, got, want, unscale)]
        worst = max(rows, key=lambda r: r["rel"])
        for r in rows:
            r["pass"] = r["abs"] <= rtol * r["scale"] + atol
        passed = len(got) == len(want) and all(r["pass"] for r in rows)
        ok &= passed
        grads = [r for r in rows if r["name"].startswith("grad:")]
        line = f"check {model_name}: "
        if rows[0]["name"] == "loss":
            line += f"loss rel {rows[0]['rel']:.2e} (abs {rows[0]['abs']:.2e})"
            if grads:
                g = max(grads, key=lambda r: r["rel"])
                line += f"; worst of {len(grads)} gradients {g['name'][5:]} rel {g['rel']:.2e} (abs {g['abs']:.2e})"
        else:
            line += f"{rows[0]['name']} rel {rows[0]['rel']:.2e} (abs {rows[0]['abs']:.2e})"
        timing = {}
        with torch.no_grad() if model_name == "forward" else contextlib.nullcontext():
            timing["compiled_ms_min"], timing["compiled_ms_median"] = median_ms(lambda: (compiled(*inputs), sync()))
            timing["eager_ms_min"], timing["eager_ms_median"] = median_ms(lambda: (fn(*inputs), sync()))
        failed = [r["name"] for r in rows if not r["pass"]]
        line += (f"; max rel {worst['rel']:.2e} (tolerance rtol {rtol:g} + atol {atol:g}): "
                 f"{'pass' if passed else 'FAIL ' + ', '.join(failed)}"
                 f"; {timing['compiled_ms_min']:.2f} ms compiled vs {timing['eager_ms_min']:.2f} ms eager "
                 f"(best of 5; a rough figure, not a benchmark)")
        print(line, flush=True)
        report["models"][model_name] = {"passed": passed, "max_rel": worst["rel"],
                                        "max_abs": max(r["abs"] for r in rows), "outputs": rows, **timing}
    report["passed"] = ok
    return report


# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Job:
    """What main()'s phases share: the arguments, the model on its device, and what each phase
    adds (the traced models, their findings, the timings)."""

    args: argparse.Namespace
    threads: int
    device: object  # torch.device
    module: object
    x: object
    y: object
    loss_fn: object
    ident: dict
    batch: int = 0
    eval_batch: int = 0
    pnames: list = dataclasses.field(default_factory=list)
    bnames: list = dataclasses.field(default_factory=list)
    params: list = dataclasses.field(default_factory=list)
    buffers: list = dataclasses.field(default_factory=list)
    step: object = None  # TrainStep
    in_specs: list = dataclasses.field(default_factory=list)
    example: list = dataclasses.field(default_factory=list)
    mutated: list = dataclasses.field(default_factory=list)
    findings: object = None
    models: dict = dataclasses.field(default_factory=dict)
    forward_skipped: str | None = None
    timings: dict = dataclasses.field(default_factory=dict)


def set_up_torch(args):
    """Custom op libraries, the device, the threads, the seed: (threads, torch.device)."""
    import torch

    for lib in args.load_library:
        torch.ops.load_library(lib)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise Refusal(EXIT_ERROR, "--device cuda: no CUDA device visible to this process")
    threads = args.threads or torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(threads)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    return threads, device


def load_model(args):
    """(module, x, y, loss_fn, ident) of --model or --module; None once --init-out is written."""
    cfg = read_model_config(args.model_config)
    if args.graph:
        module, x, y, loss_fn, ident = graph_model(args.graph, args.device)
    elif args.model:
        module, x, y, loss_fn, ident = builtin_model(args.model, cfg, args.batch)
    else:
        module, x, y, loss_fn, ident = user_model(args.module, args.batch, args.device, args.example, cfg)
        if args.init_out:
            write_init(module, args.init_out, args.module)
            return None
    return module, x, y, loss_fn, ident


def place_on_device(job: Job) -> None:
    """The module and the example batch on the device; the parameters' and buffers' names."""
    job.batch = job.x.shape[0]
    job.eval_batch = job.args.eval_batch or job.batch
    job.module = job.module.to(job.device)
    job.x, job.y = job.x.to(job.device), job.y.to(job.device)
    job.pnames = [n for n, _ in job.module.named_parameters()]
    job.bnames = [n for n, _ in job.module.named_buffers()]
    job.params = [p.detach() for _, p in job.module.named_parameters()]
    job.buffers = [b.detach() for _, b in job.module.named_buffers()]


def trace_train_step(job: Job) -> None:
    """Traces the training step into job.models["train_step"] (its specs, findings, timing)."""
    import torch

    args, module, pnames, bnames, x, y = job.args, job.module, job.pnames, job.bnames, job.x, job.y
    amp_dtype = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    step = TrainStep(module, pnames, bnames, job.loss_fn, amp_dtype, args.device, args.grad_scale_input)
    if args.module and job.loss_fn is None:
        step.expect = expected_logits(module, args.module, job.ident.get("num_classes"), x)
    in_specs = ([tensor_spec(n, t, "parameter") for n, t in zip(pnames, job.params)] +
                [tensor_spec(n, t, "buffer") for n, t in zip(bnames, job.buffers)] +
                [tensor_spec("input", x, "input"), tensor_spec("target", y, "target")])
    example = [*job.params, *job.buffers, x, y]
    if args.grad_scale_input:
        gs = torch.ones((), dtype=torch.float32, device=job.device)
        example.append(gs)
        in_specs.append(tensor_spec("grad_scale", gs, "grad_scale"))
    module.train()
    t0 = time.perf_counter()
    with blaming_user(args.module, "the training step"):
        gm = trace(step, example, "the training step")
    job.timings["trace_s"] = time.perf_counter() - t0
    step.returned = prune_buffer_outputs(gm, example, len(pnames), len(bnames), len(pnames))
    mutated = [bnames[i] for i in step.returned]
    name_placeholders(gm, [s["name"] for s in in_specs])
    job.findings = check_graph(gm, args, args.device, "train_step")
    fake_out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    out_vals = [o.meta["val"] for o in fake_out]
    out_specs = [tensor_spec("loss", out_vals[0], "loss")]
    out_specs += [tensor_spec(f"grad:{n}", v, "grad") for n, v in zip(pnames, out_vals[1:1 + len(pnames)])]
    out_specs += [tensor_spec(f"buffer:{n}", v, "buffer_update") for n, v in zip(mutated, out_vals[1 + len(pnames):])]
    if args.deterministic:
        with blaming_user(args.module, "the training step, run eagerly"):
            deterministic_dry_run(step, example)
    job.step, job.in_specs, job.example, job.mutated = step, in_specs, example, mutated
    job.models = {"train_step": {"gm": gm, "example": example, "inputs": in_specs, "outputs": out_specs,
                                 "batch": job.batch, "amp": args.amp, "mode": "train"}}


def trace_forward(job: Job) -> None:
    """Traces the evaluation forward into job.models["forward"], or says in job.forward_skipped
    why there is none (--no-forward, or a graph break without --fullgraph)."""
    import torch

    args, module, x, device, eval_batch = job.args, job.module, job.x, job.device, job.eval_batch
    job.forward_skipped = "--no-forward" if args.no_forward else None
    if args.no_forward:
        return
    module.eval()
    if eval_batch == job.batch:
        xe = x
    elif x.is_floating_point():
        xe = torch.randn(eval_batch, *x.shape[1:], device=device, dtype=x.dtype)
    else:
        hi = job.ident.get("num_classes") or int(x.max().item()) + 1
        xe = torch.randint(0, hi, (eval_batch, *x.shape[1:]), device=device, dtype=x.dtype)
    fwd = Forward(module, job.pnames, job.bnames)
    f_example = [*job.params, *job.buffers, xe]
    f_specs = job.in_specs[:len(job.pnames) + len(job.bnames)] + [tensor_spec("input", xe, "input")]
    t0 = time.perf_counter()
    try:
        with blaming_user(args.module, "the evaluation forward"):
            fgm = trace(fwd, f_example, "the evaluation forward")
        name_placeholders(fgm, [s["name"] for s in f_specs])
        check_graph(fgm, args, args.device, "forward")
    except Refusal as r:
        # The training step is what matters: without --fullgraph an evaluation forward that
        # cannot be captured is left out (keel evaluates eagerly), with a warning.
        if args.fullgraph or r.code != EXIT_GRAPH_BREAK:
            raise
        log(f"warning: no 'forward' model: {r.line}")
        job.forward_skipped = r.line
    job.timings["trace_s"] += time.perf_counter() - t0
    module.train()
    if job.forward_skipped is None:
        fout = [n for n in fgm.graph.nodes if n.op == "output"][0].args[0]
        fvals = [o.meta["val"] for o in fout]
        f_outs = ([tensor_spec("logits", fvals[0], "logits")] if len(fvals) == 1 else
                  [tensor_spec(f"output:{i}", v, "output") for i, v in enumerate(fvals)])
        job.models["forward"] = {"gm": fgm, "example": f_example, "inputs": f_specs, "outputs": f_outs,
                                 "batch": eval_batch, "amp": "off", "mode": "eval"}


def tuple_module(gm):
    """A GraphModule as an nn.Module returning a tuple (what torch.export takes)."""
    import torch

    class TupleOut(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gm = gm

        def forward(self, *args):
            return tuple(self.gm(*args))

    return TupleOut()


def block_of(job: Job):
    """(block module, example input, extra inputs) of --granularity blocks: block 0 of the model,
    a hidden state of the training batch's shape (every block of the model has the same shapes)
    and what else the block takes: llama's rotary cos and sin, (1, T, head_dim) float32, as
    keel's C++ model computes them."""
    import torch

    cfg = job.ident["model_config"]
    extra = {}
    if job.args.model == "gpt":
        block, width = job.module.h[0], cfg["width"]
    elif job.args.model == "gpt2":  # transformers' GPT2Block
        block, width = job.module.transformer.h[0], job.module.config.n_embd
    else:  # transformers' LlamaDecoderLayer, given position_embeddings = (cos, sin)
        block, width = job.module.model.layers[0], job.module.config.hidden_size
        pos = torch.arange(cfg["context"], device=job.device)[None]
        probe = torch.zeros(1, device=job.device)
        cos, sin = job.module.model.rotary_emb(probe, pos)
        extra = {"cos": cos.float(), "sin": sin.float()}
    x = torch.randn(job.batch, cfg["context"], width, device=job.device)
    return block, x, extra


def partition_block(block, params, x, extra, amp_dtype, device_type):
    """AOTAutograd's forward and backward graphs of the block (min-cut partitioned, views of
    inputs recomputed in backward rather than saved): (fw gm, bw gm). The graphs' inputs are
    the parameters, the block's input, then `extra`'s tensors."""
    import torch
    import torch._functorch.config as functorch_config
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    names = [n for n, _ in block.named_parameters()]
    n, e = len(names), len(extra)
    # A unit keel traced: its casts are in the graph, and its tensor constants (llama's rotary cos
    # and sin, read by the C++ block from outside it) go in as inputs, the fake tensors tracing
    # takes, then back into both graphs as constants (bake_constants).
    consts = list(getattr(block, "constants", []))
    if getattr(block, "traced_autocast", False):
        amp_dtype = None

    def fn(*args):
        ctx = torch.autocast(device_type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
        # the extra inputs: llama's rotary (cos, sin); the loss's target (RootPart)
        kwargs = {"position_embeddings": tuple(args[n + 1:n + 1 + e])} if extra else {}
        if consts:
            kwargs["constants"] = list(args[n + 1 + e:])
        with ctx:
            out = torch.func.functional_call(block, dict(zip(names, args[:n])), (args[n],), kwargs)
        return out[0] if isinstance(out, tuple) else out

    graphs = {}

    def capture(which):
        def compiler(gm, _example):
            graphs[which] = gm
            return gm

        return compiler

    with functorch_config.patch(recompute_views=True):
        f = aot_function(fn, capture("fw"), capture("bw"), partition_fn=min_cut_rematerialization_partition)
        # token ids (the root's embed) take no gradient
        x_in = x.detach().clone().requires_grad_(x.is_floating_point())
        y = f(*[p.detach().clone().requires_grad_(True) for p in params], x_in, *extra.values(), *consts)
        y.backward(torch.ones_like(y))
    fw, bw = graphs["fw"], graphs["bw"]
    if consts:
        placeholders = [nd.name for nd in fw.graph.nodes if nd.op == "placeholder"]
        values = dict(zip(placeholders[n + 1 + e:], consts))
        bake_constants(fw, values)
        bake_constants(bw, values)
    return fw, bw


def bake_constants(gm, values: dict) -> None:
    """Each placeholder of `gm` named in `values` becomes a constant of that value (a buffer of the
    graph module, which export lifts and AOTInductor holds in the package)."""
    for node in list(gm.graph.nodes):
        if node.op == "placeholder" and node.name in values:
            attr = f"keel_constant_{node.name}"
            gm.register_buffer(attr, values[node.name].detach().clone())
            with gm.graph.inserting_before(node):
                const = gm.graph.get_attr(attr)
            node.replace_all_uses_with(const)
            gm.graph.erase_node(node)
    gm.recompile()


def keep_outputs(gm, keep) -> list:
    """Rewrites `gm`'s output to the nodes `keep(outputs)` returns; returns them."""
    out_node = [n for n in gm.graph.nodes if n.op == "output"][0]
    kept = keep(list(out_node.args[0]))
    out_node.args = (tuple(kept),)
    gm.recompile()
    return kept


def trace_unit(job: Job, unit: str, module, x, extra, extra_kind="rotary") -> dict:
    """{unit}_forward (params, input, extra) -> (output, *saved) and {unit}_backward (what it
    reads: parameters, the input, extra, saved tensors; the output's gradient) -> (each
    parameter's gradient, the input's: none for an integer input, token ids), traced from
    `module` on `x`. `extra` (no gradient) are listed as of kind `extra_kind`: "rotary" (llama's
    cos and sin) or "target" (the loss's). A saved tensor that is an input of the forward is not
    returned by it: keel passes the live tensor (with dist.zero = 3, the block's parameters
    gathered again for the backward)."""
    import torch

    args = job.args
    module.train()
    names = getattr(module, "keel_names", None) or [n for n, _ in module.named_parameters()]
    params = [p.detach() for p in module.parameters()]
    amp_dtype = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    fw, bw = partition_block(module, params, x, extra, amp_dtype, args.device)
    inputs = [(nm, p, "parameter") for nm, p in zip(names, params)] + [("input", x, "input")]
    inputs += [(nm, t, extra_kind) for nm, t in extra.items()]
    fw_in = [n for n in fw.graph.nodes if n.op == "placeholder"]
    if len(fw_in) != len(inputs):
        raise Refusal(EXIT_ERROR, f"{unit} forward graph has {len(fw_in)} inputs, expected {len(inputs)}")
    source_of_input = {node.name: inputs[i] for i, node in enumerate(fw_in)}
    kept = keep_outputs(fw, lambda outs: [outs[0]] + [o for o in outs[1:] if o.op not in ("placeholder", "get_attr")])
    kept_index = {node.name: k for k, node in enumerate(kept[1:])}
    fw_example = [t for _, t, _ in inputs]
    fw_out = fw(*fw_example)
    fw_in_specs = [tensor_spec(nm, t, kind) for nm, t, kind in inputs]
    fw_out_specs = [tensor_spec("output", fw_out[0], "output")]
    fw_out_specs += [tensor_spec(f"saved:{k}", v, "saved") for k, v in enumerate(fw_out[1:])]
    bw_example, bw_in_specs = [], []
    for node in [n for n in bw.graph.nodes if n.op == "placeholder"]:
        if node.name.startswith("tangents"):
            # keel hands the backward a contiguous gradient: traced as one
            spec = ("grad:output", torch.randn(fw_out[0].shape, dtype=fw_out[0].dtype, device=fw_out[0].device),
                    "grad_output")
        elif node.name in source_of_input:
            spec = source_of_input[node.name]
        elif node.name in kept_index:
            k = kept_index[node.name]
            spec = (f"saved:{k}", fw_out[1 + k], "saved")
        else:
            raise Refusal(EXIT_ERROR, f"{unit} backward graph reads {node.name}, which the forward does not give")
        bw_example.append(spec[1])
        bw_in_specs.append(tensor_spec(*spec))
    x_grad = x.is_floating_point()
    n_grads = len(params) + x_grad  # the parameters' and the input's; extra inputs take none
    grads = keep_outputs(bw, lambda outs: outs[:n_grads] if all(o is None for o in outs[n_grads:]) else outs)
    bw_out = bw(*bw_example)
    if len(bw_out) != n_grads or any(g is None for g in grads):
        raise Refusal(EXIT_ERROR, f"{unit} backward graph does not give exactly every parameter "
                                  f"{'and the input ' if x_grad else ''}a gradient")
    bw_out_specs = [tensor_spec(f"grad:{nm}", g, "grad") for nm, g in zip(names, bw_out[:len(params)])]
    if x_grad:
        bw_out_specs.append(tensor_spec("grad:input", bw_out[-1], "grad_input"))
    mode = {"batch": job.batch, "amp": args.amp, "mode": "train"}
    return {
        f"{unit}_forward": {"gm": tuple_module(fw), "example": fw_example, "inputs": fw_in_specs,
                            "outputs": fw_out_specs, **mode},
        f"{unit}_backward": {"gm": tuple_module(bw), "example": bw_example, "inputs": bw_in_specs,
                             "outputs": bw_out_specs, **mode},
    }


def root_of(job: Job, hidden):
    """The root of the model as keel's C++ families split it around their blocks (models/gpt.cpp,
    gpt2.cpp, llama.cpp: BlockStructure::root_call): embed (token ids -> the first block's input),
    head (the last block's output -> logits: the final norm and the output projection, tied or
    not) and loss (logits, target -> keel's cross-entropy, in float32), each an nn.Module whose
    keel_names are the whole model's names of its parameters (a tied weight under the name it has
    there); with examples: the token ids, and the logits the head gives `hidden` (in the dtype
    that the run's autocast gives them), and the target."""
    import torch

    m, model, args = job.module, job.args.model, job.args
    owner = {}
    for n, p in m.named_parameters():  # transformers' tied lm_head.weight is listed once, as the embedding
        owner.setdefault(id(p), n)

    class Part(torch.nn.Module):
        def __init__(self, modules, fn):
            super().__init__()
            for k, mod in modules.items():
                self.add_module(k, mod)
            self.fn = fn
            self.keel_names = [owner[id(p)] for p in self.parameters()]

        def forward(self, x, position_embeddings=()):  # partition_block passes the extra inputs so
            return self.fn(self, x, *position_embeddings)

    def positions(idx):
        return torch.arange(idx.shape[1], device=idx.device)

    if model == "gpt":
        embed = Part({"wte": m.wte, "wpe": m.wpe}, lambda s, idx: s.wte(idx) + s.wpe(positions(idx)))
        head = Part({"ln_f": m.ln_f, "wte": m.wte}, lambda s, x: s.ln_f(x) @ s.wte.weight.t())
        vocab = job.ident["model_config"]["vocab"]
    elif model == "gpt2":
        t = m.transformer
        embed = Part({"wte": t.wte, "wpe": t.wpe}, lambda s, idx: s.wte(idx) + s.wpe(positions(idx)))
        head = Part({"ln_f": t.ln_f, "lm_head": m.lm_head}, lambda s, x: s.lm_head(s.ln_f(x)))
        vocab = m.config.vocab_size
    else:
        embed = Part({"embed_tokens": m.model.embed_tokens}, lambda s, idx: s.embed_tokens(idx))
        head = Part({"norm": m.model.norm, "lm_head": m.lm_head}, lambda s, x: s.lm_head(s.norm(x)))
        vocab = m.config.vocab_size
    loss = Part({}, lambda s, logits, target: keel_cross_entropy(logits, target).to(torch.float32))
    ids = torch.randint(0, vocab, tuple(hidden.shape[:2]), device=hidden.device)
    target = torch.randint(0, vocab, tuple(hidden.shape[:2]), device=hidden.device)
    amp_dtype = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    with torch.no_grad(), (torch.autocast(args.device, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()):
        logits = head(hidden).detach()
    return embed, head, loss, ids, logits, target


def trace_blocks(job: Job) -> None:
    """--granularity blocks: job.models["block_forward"] and ["block_backward"] (trace_unit) of
    the model's block 0, and the root's units around the blocks (root_of): embed_*, head_* and
    loss_*."""
    t0 = time.perf_counter()
    if hasattr(job.module, "units"):  # keel's traced units (--graph)
        job.models = {}
        for name, (module, x, extra, kind) in job.module.units.items():
            x = x.to(job.device)
            extra = {k: v.to(job.device) for k, v in extra.items()}
            job.models.update(trace_unit(job, name, module, x, extra, extra_kind=kind))
        job.timings["trace_s"] = time.perf_counter() - t0
        job.forward_skipped = "--granularity blocks"
        job.findings = {}
        return
    block, x, extra = block_of(job)
    job.models = trace_unit(job, "block", block, x, extra)
    embed, head, loss, ids, logits, target = root_of(job, x)
    job.models.update(trace_unit(job, "embed", embed, ids, {}))
    job.models.update(trace_unit(job, "head", head, x, {}))
    job.models.update(trace_unit(job, "loss", loss, logits, {"target": target}, extra_kind="target"))
    job.timings["trace_s"] = time.perf_counter() - t0
    job.forward_skipped = "--granularity blocks"
    job.findings = {}


class TpRegion:
    """Builds the two regions of a transformer block that one tensor-parallel rank computes between
    the block's collectives (models/transformer.cpp: after tp.enter, before tp.leave): attention
    (its heads' q, k and v, causal attention, the output projection's partial product without its
    bias) and the MLP (its ffn / tp columns, the down projection's partial product). Parameters are
    named as keel's block names them, with one rank's shapes (the values are the tracer's own: every
    rank's regions have the same shapes, and the package reads the parameters as inputs)."""

    def __init__(self, job: Job, tp: int):
        import torch

        cfg = job.ident["model_config"]
        self.torch, self.tp, self.model = torch, tp, job.args.model
        self.config = getattr(job.module, "config", None)  # transformers' config (gpt2, llama)
        if self.model == "gpt":
            self.block = job.module.h[0]
            self.C, self.H = cfg["width"], cfg["heads"]
            self.KV, self.hd = self.H, self.C // self.H
        else:
            c = job.module.config
            self.block = job.module.transformer.h[0] if self.model == "gpt2" else job.module.model.layers[0]
            self.C = c.n_embd if self.model == "gpt2" else c.hidden_size
            self.H = c.n_head if self.model == "gpt2" else c.num_attention_heads
            self.KV = self.H if self.model == "gpt2" else c.num_key_value_heads
            self.hd = self.C // self.H if self.model == "gpt2" else getattr(c, "head_dim", None) or self.C // self.H
        for what, n in (("heads", self.H), ("key/value heads", self.KV)):
            if n % tp:
                raise Refusal(EXIT_USAGE, f"--tp {tp}: the block's {what} ({n}) do not divide by it")
        self.full = dict(self.block.named_parameters())

    def local(self, name, dim, parts=1):
        """A parameter of `name` with one rank's share along `dim` (each of `parts` equal parts split
        on its own, as a fused q, k, v projection), or whole (dim None)."""
        t = self.full[name].detach()
        shape = list(t.shape)
        if dim is not None:
            if shape[dim] % (self.tp * parts):
                raise Refusal(EXIT_USAGE, f"--tp {self.tp}: {name} {shape} does not split along dim {dim}")
            shape[dim] //= self.tp
        return self.torch.nn.Parameter(self.torch.randn(shape, dtype=t.dtype, device=t.device) * 0.02)

    def modules(self):
        """(attention region, mlp region) as nn.Modules: forward(x[, position_embeddings]) -> partial."""
        torch, F, region = self.torch, self.torch.nn.functional, self
        job_config = self.config
        conv1d = self.model == "gpt2"
        H, KV, hd = self.H // self.tp, self.KV // self.tp, self.hd

        def dense(x, w, b):  # keel's dense_product: Linear x W^T + b, or GPT-2's Conv1D x W + b
            if conv1d:
                y = torch.addmm(b, x.reshape(-1, x.shape[-1]), w) if b is not None else x.reshape(-1, x.shape[-1]) @ w
                return y.view(*x.shape[:-1], w.shape[-1])
            return F.linear(x, w, b)

        class Region(torch.nn.Module):
            def __init__(self, spec, fn):
                super().__init__()
                self.keel_names = []  # the package's parameter names: keel's, relative to the block
                for name, dim, parts in spec:
                    if name not in region.full:
                        continue  # a bias the family does not have
                    self.register_parameter(name.replace(".", "__"), region.local(name, dim, parts))
                    self.keel_names.append(name)
                self.fn = fn

            def forward(self, x, position_embeddings=None):
                p = {n: getattr(self, n.replace(".", "__")) for n in self.keel_names}
                return self.fn(p, x, position_embeddings)

        def attend(q, k, v, B, T):
            qh = q.view(B, T, H, hd).transpose(1, 2)
            kh = k.view(B, T, KV, hd).transpose(1, 2)
            vh = v.view(B, T, KV, hd).transpose(1, 2)
            return qh, kh, vh

        def rotate_half(t):
            a, b = t.chunk(2, dim=-1)
            return torch.cat((-b, a), dim=-1)

        col, row = (1, 0) if conv1d else (0, 1)  # the output and input dims of a dense weight
        if self.model in ("gpt", "gpt2"):
            a = "attn"
            attn_spec = [(f"{a}.c_attn.weight", col, 3), (f"{a}.c_attn.bias", 0, 3), (f"{a}.c_proj.weight", row, 1)]

            def attn_fn(p, x, _pos):
                B, T = x.shape[0], x.shape[1]
                q, k, v = dense(x, p[f"{a}.c_attn.weight"], p.get(f"{a}.c_attn.bias")).split(H * hd, dim=2)
                qh, kh, vh = attend(q, k, v, B, T)
                y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2).reshape(B, T, H * hd)
                return dense(y, p[f"{a}.c_proj.weight"], None)

            mlp_spec = [("mlp.c_fc.weight", col, 1), ("mlp.c_fc.bias", 0, 1), ("mlp.c_proj.weight", row, 1)]
            # keel's gpt: exact GELU; gpt2: its config.json's (gelu_new and gelu_pytorch_tanh: tanh; gelu: exact)
            act = getattr(job_config, "activation_function", "gelu_new") if self.model == "gpt2" else "gelu"
            approximate = "none" if act == "gelu" else "tanh"

            def mlp_fn(p, x, _pos):
                h = F.gelu(dense(x, p["mlp.c_fc.weight"], p.get("mlp.c_fc.bias")), approximate=approximate)
                return dense(h, p["mlp.c_proj.weight"], None)
        else:  # llama: separate q, k, v, rotary angles, grouped-query heads, SwiGLU
            a = "self_attn"
            attn_spec = [(f"{a}.{n}.{w}", 0, 1) for n in ("q_proj", "k_proj", "v_proj") for w in ("weight", "bias")]
            attn_spec.append((f"{a}.o_proj.weight", 1, 1))

            def attn_fn(p, x, pos):
                B, T = x.shape[0], x.shape[1]
                q, k, v = (dense(x, p[f"{a}.{n}.weight"], p.get(f"{a}.{n}.bias")) for n in ("q_proj", "k_proj", "v_proj"))
                qh, kh, vh = attend(q, k, v, B, T)
                cos, sin = pos
                qh = qh * cos + rotate_half(qh) * sin
                kh = kh * cos + rotate_half(kh) * sin
                if KV != H:
                    kh = kh.repeat_interleave(H // KV, 1)
                    vh = vh.repeat_interleave(H // KV, 1)
                y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2).reshape(B, T, H * hd)
                return dense(y, p[f"{a}.o_proj.weight"], None)

            mlp_spec = [(f"mlp.{n}.{w}", 0, 1) for n in ("gate_proj", "up_proj") for w in ("weight", "bias")]
            mlp_spec.append(("mlp.down_proj.weight", 1, 1))

            def mlp_fn(p, x, _pos):
                g = dense(x, p["mlp.gate_proj.weight"], p.get("mlp.gate_proj.bias"))
                u = dense(x, p["mlp.up_proj.weight"], p.get("mlp.up_proj.bias"))
                return dense(F.silu(g) * u, p["mlp.down_proj.weight"], None)

        return Region(attn_spec, attn_fn), Region(mlp_spec, mlp_fn)


def trace_tp_regions(job: Job) -> None:
    """--granularity blocks --tp N: the block's attention and MLP regions as one tp rank computes
    them (TpRegion), each traced by trace_unit: attention_forward/_backward (the input after
    tp's enter, the whole sequence; llama's rotary cos and sin) and mlp_forward/_backward."""
    t0 = time.perf_counter()
    _block, x, extra = block_of(job)
    attention, mlp = TpRegion(job, job.args.tp).modules()
    job.models = {**trace_unit(job, "attention", attention, x, extra), **trace_unit(job, "mlp", mlp, x, {})}
    job.timings["trace_s"] = time.perf_counter() - t0
    job.forward_skipped = "--granularity blocks --tp"
    job.findings = {}


def export_models(job: Job) -> None:
    """torch.export of every traced model (m["ep"]), each checked to take the inputs it lists."""
    import torch

    t0 = time.perf_counter()
    for name, m in job.models.items():
        m["ep"] = torch.export.export(m["gm"], tuple(m["example"]), strict=False)
        # Tensor constants of the traced graph (a module's plain tensor attributes) come back
        # lifted as buffers or constants: they are baked into the package (listed in findings).
        n_in = sum(1 for s in m["ep"].graph_signature.input_specs if str(s.kind) == "InputKind.USER_INPUT")
        if n_in != len(m["inputs"]):
            raise Refusal(EXIT_ERROR, f"{name}: exported graph has {n_in} inputs, expected {len(m['inputs'])}")
    job.timings["export_s"] = time.perf_counter() - t0


def describe_models(job: Job):
    """(Inductor options, environment, signature): the signature is the manifest's part that
    --trace-only prints, each model's graph_sha256 included."""
    args = job.args
    options = {"fallback_random": True}  # random ops draw from ATen's generators, as eager does
    if args.device == "cpu":
        options["cpp.threads"] = job.threads
    if args.max_autotune:
        options["max_autotune"] = True
    if args.deterministic:
        options["deterministic"] = True
    env = environment(args.device, job.threads)
    # graph_sha256: SHA-256 of the exported graph's code (ATen ops, shapes, dtypes in its
    # annotations), the same for the same model, shapes and torch version. --trace-only gives it
    # in seconds, so a compile cache can be keyed on it before anything is compiled.
    for m in job.models.values():
        m["graph_sha256"] = graph_fingerprint(m["ep"].graph_module)
    signature = {"format": FORMAT, **job.ident, "device": args.device, "amp": args.amp,
                 "models": {n: {"batch": m["batch"], "mode": m["mode"], "amp": m["amp"],
                                "graph_sha256": m["graph_sha256"], "inputs": m["inputs"], "outputs": m["outputs"]}
                            for n, m in job.models.items()}}
    return options, env, signature


def compile_models(job: Job, options: dict, signature: dict) -> dict:
    """AOTInductor's files for each model (deterministic algorithms on with --deterministic:
    Inductor then avoids atomic-add scatters)."""
    import torch

    timings = job.timings
    det = contextlib.ExitStack()
    if job.args.deterministic:
        prev = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        det.callback(torch.use_deterministic_algorithms, prev)
    files = {}
    with det:
        for name, m in job.models.items():
            t0 = time.perf_counter()
            opts = dict(options)
            opts["aot_inductor.package"] = True
            opts["aot_inductor.metadata"] = {"keel_format": FORMAT, "keel_model": name,
                                             "keel_signature": json.dumps(signature["models"][name])}
            files[name] = compile_one(m["ep"], opts)
            timings[f"compile_{name}_s"] = time.perf_counter() - t0
            log(f"compiled {name} in {timings[f'compile_{name}_s']:.1f} s")
    timings["compile_s"] = sum(v for k, v in timings.items() if k.startswith("compile_") and k != "compile_s")
    return files


def check_package(job: Job, staged: str) -> dict:
    """--check: the staged package against eager PyTorch on fresh inputs; a Refusal (EXIT_CHECK)
    when they disagree."""
    import torch

    args, module, pnames, bnames = job.args, job.module, job.pnames, job.bnames
    t0 = time.perf_counter()
    torch.manual_seed(args.seed + 1)
    amp = args.amp != "off"
    rtol = args.check_rtol if args.check_rtol is not None else (3e-2 if amp else 1e-5)
    atol = args.check_atol if args.check_atol is not None else (1e-5 if amp else 1e-7)
    chk = {}
    for name, m in job.models.items():
        fresh = []
        for t, spec in zip(m["example"], m["inputs"]):
            if spec["kind"] == "input" and t.is_floating_point():
                fresh.append(torch.randn_like(t))
            elif spec["kind"] == "grad_scale":
                fresh.append(torch.full_like(t, 256.0))  # a GradScaler-like scale
            elif spec["kind"] in ("input", "target") and not t.is_floating_point():
                hi = job.ident.get("num_classes") or int(t.max().item()) + 1
                fresh.append(torch.randint_like(t, 0, max(hi, 1)))
            else:
                fresh.append(t.clone())
        fn = job.step if name == "train_step" else Forward(module, pnames, bnames)
        scale = fresh[-1].item() if name == "train_step" and args.grad_scale_input else 1.0
        chk[name] = (wrap_mode(module, name, fn), fresh, [o["name"] for o in m["outputs"]],
                     [scale if o["kind"] == "grad" else 1.0 for o in m["outputs"]])
    check = run_check(staged, chk, rtol, atol, args.device)
    job.timings["check_s"] = time.perf_counter() - t0
    if not check["passed"]:
        worst = max(m["max_rel"] for m in check["models"].values())
        raise Refusal(EXIT_CHECK, f"check failed: the package disagrees with eager PyTorch (max rel "
                                  f"{worst:.2e}, tolerance rtol {rtol:g} + atol {atol:g}); nothing written")
    return check


def make_manifest(job: Job, out: str, staged: str, digest: str, options: dict, env: dict, signature: dict,
                  check) -> dict:
    args, timings = job.args, job.timings
    return {
        **signature,
        "package": os.path.basename(out),
        "sha256": digest,
        "bytes": os.path.getsize(staged),
        "compile_seconds": round(timings["compile_s"] + timings["trace_s"] + timings["export_s"], 3),
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
        "environment": env,
        "inductor_options": options,
        "deterministic": args.deterministic,
        "fullgraph": args.fullgraph,
        "max_autotune": args.max_autotune,
        "grad_scale_input": args.grad_scale_input,
        "loss": "custom" if job.loss_fn else ("cross_entropy over the last dimension, mean over the targets other "
                                              f"than {IGNORE_INDEX}, float32"),
        "runtime": {
            "threads": job.threads if args.device == "cpu" else None,
            "deterministic_algorithms": args.deterministic,
            "buffers_updated": job.mutated,
        },
        "forward_skipped": job.forward_skipped,
        "check": check,
    }


def package_and_publish(job: Job, files: dict, options: dict, env: dict, signature: dict, t_start: float):
    """The package staged beside --out, checked (--check), then published: the package, then the
    manifest, each by rename. A package that fails --check is never published. Returns (out,
    manifest path, manifest, package SHA-256)."""
    from torch._inductor.package import package_aoti

    out = os.path.abspath(job.args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmpdir, staged = stage(out)
    try:
        t0 = time.perf_counter()
        package_aoti(staged, files)
        digest = sha256_file(staged)
        job.timings["package_s"] = time.perf_counter() - t0
        check = None
        if job.args.check:
            check = check_package(job, staged)
        job.timings["total_s"] = time.perf_counter() - t_start
        manifest = make_manifest(job, out, staged, digest, options, env, signature, check)
        manifest_path = os.path.splitext(out)[0] + ".json"
        staged_manifest = os.path.join(tmpdir, os.path.basename(manifest_path))
        with open(staged_manifest, "w") as f:
            json.dump(manifest, f, indent=1)
            f.write("\n")
        publish(staged, out)
        publish(staged_manifest, manifest_path)
    finally:
        discard(tmpdir)
    return out, manifest_path, manifest, digest


def main(argv=None) -> int:
    global IGNORE_INDEX
    args = parse_args(argv)
    IGNORE_INDEX = args.ignore_index
    t_start = time.perf_counter()
    threads, device = set_up_torch(args)
    loaded = load_model(args)
    if loaded is None:  # --init-out: the initial weights are written, nothing is traced
        return 0
    job = Job(args, threads, device, *loaded)
    place_on_device(job)
    if args.granularity == "blocks":
        job.ident["granularity"] = "blocks"
        if args.tp > 1:
            job.ident["tp"] = args.tp
        if args.tp > 1 and not hasattr(job.module, "units"):
            trace_tp_regions(job)
        else:
            trace_blocks(job)
    else:
        trace_train_step(job)
        trace_forward(job)
    export_models(job)
    options, env, signature = describe_models(job)
    timings = job.timings
    if args.trace_only:
        print(json.dumps({**signature, "findings": job.findings, "forward_skipped": job.forward_skipped,
                          "timings_s": timings}, indent=1))
        return 0
    files = compile_models(job, options, signature)
    out, manifest_path, manifest, digest = package_and_publish(job, files, options, env, signature, t_start)
    print(f"wrote {out} ({manifest['bytes']} bytes, sha256 {digest[:16]}...) and {manifest_path}; trace "
          f"{timings['trace_s']:.1f} s, export {timings['export_s']:.1f} s, compile {timings['compile_s']:.1f} s",
          flush=True)
    return 0


def wrap_mode(module, name, fn):
    def run(*a):
        module.train(name == "train_step")
        try:
            return fn(*a)
        finally:
            module.train()

    return run


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch-internal deprecations, not the user's
    verbose = "--verbose" in sys.argv
    try:
        sys.exit(main())
    except Refusal as r:
        if verbose:
            traceback.print_exc()
        print(r.line, file=sys.stderr, flush=True)
        sys.exit(r.code)
    except SystemExit:
        raise
    except BaseException as e:  # one line for the C++ side; the traceback with --verbose
        if verbose:
            traceback.print_exc()
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"aot_package: error: {type(e).__name__}: {first}", file=sys.stderr, flush=True)
        sys.exit(EXIT_ERROR)
