"""trainer/compile/aot_package.py: one training step of a model, compiled ahead of time by
AOTInductor into a .pt2 package that keel's C++ trainer loads and runs with no Python.

Graph in -> joint forward and backward -> partition -> AOTInductor -> manifest. The graph is
the one keel traced from the C++ model it trains (issue 65; keel_graph.py replays it): the whole
step (--graph FILE.json, keel-graph/1), or the units of --granularity blocks (a keel-graphs/1
bundle: the block, the root's embed, head and loss, or the tensor-parallel regions); or a user's
PyTorch module (--module, model.name = "python"; python_front.py). No model is rebuilt here by
name. Its modules: aot_common.py, keel_graph.py, python_front.py, aot_checks.py, beside this file
(keel's compile cache keys the package by all five).

Run by keel (compile.mode = inductor) with keel's venv Python when a package is missing, or by
hand:

    python trainer/compile/aot_package.py --graph /cache/KEY.graph.json --batch 4 --out /cache/KEY.pt2
    python trainer/compile/aot_package.py --module mypkg.net:make --batch 32 --out net.pt2
    python trainer/compile/aot_package.py --module net.py:build_model --example '{"input": {"shape": [32, 1,
        28, 28], "dtype": "float32"}, "target": {"shape": [32], "dtype": "int64"}, "classes": 10}' --batch 32
        --out net.pt2        # how keel runs it for model.name = "python" (--init-out: the initial weights only)

What is compiled: step(*params, *buffers, input, target[, grad_scale]) -> (loss, *grads[,
*updated buffers]): the model's forward (under bf16/fp16 autocast with --amp; a traced graph holds
its own casts), the loss (keel's traced one, or for a Python module keel's default (cross-entropy over the last dimension, mean over every sample or token, cast to float32,
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
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback

# Its modules beside it, found also under `python -I` or PYTHONSAFEPATH (no script directory on sys.path).
sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))

import python_front  # noqa: E402
from aot_checks import check_graph, deterministic_dry_run, op_name, run_check, trace  # noqa: E402
from aot_common import EXIT_CHECK, EXIT_ERROR, EXIT_GRAPH_BREAK, EXIT_USAGE, Refusal, log, sha256_file  # noqa: E402
from keel_graph import graph_model  # noqa: E402
from python_front import blaming_user, check_logits, expected_logits, keel_cross_entropy, read_model_config, user_model, write_init  # noqa: E402


FORMAT = "keel-aoti-step/1"


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="aot_package.py",
        description="Compile one training step (forward + cross-entropy + backward) ahead of time with AOTInductor.",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--graph", metavar="FILE.json",
                       help="what keel traced from its C++ model, with FILE.json.pt: the training step (keel-graph/1) "
                            "or the units of --granularity blocks (keel-graphs/1)")
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
    p.add_argument("--batch", type=int, help="per-rank micro-batch of the training step (with --module)")
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
    if (a.example or a.init_out) and not a.module:
        p.error("--example and --init-out go with --module")
    for name in ("batch", "eval_batch"):
        v = getattr(a, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.threads < 0:
        p.error("--threads must be >= 0")
    if a.granularity == "blocks" and (not a.graph or a.check):
        p.error("--granularity blocks packages the units keel traced (--graph; not --check)")
    if a.tp < 1 or (a.tp > 1 and a.granularity != "blocks"):
        p.error("--tp N > 1 goes with --granularity blocks")
    if a.amp == "fp16":
        if a.device != "cuda":
            p.error("--amp fp16 needs --device cuda (keel's amp.dtype = fp16 is CUDA only)")
        a.grad_scale_input = True
    return a


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
    """(module, x, y, loss_fn, ident) of --graph or --module; None once --init-out is written."""
    if args.graph:
        module, x, y, loss_fn, ident = graph_model(args.graph, args.device)
    else:
        cfg = read_model_config(args.model_config)
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


def trace_blocks(job: Job) -> None:
    """--granularity blocks: each unit of keel's bundle (keel_graph.graph_units: the block, the
    root's embed, head and loss; or, at --tp N, the attention and mlp regions as one tp rank
    computes them) traced by trace_unit into job.models[unit + "_forward"] and ["_backward"]."""
    t0 = time.perf_counter()
    if not hasattr(job.module, "units"):
        raise Refusal(EXIT_USAGE, f"--granularity blocks: {job.args.graph} is the graph of a whole step, "
                                  "not a bundle of units (keel-graphs/1)")
    job.models = {}
    for name, (module, x, extra, kind) in job.module.units.items():
        extra = {k: v.to(job.device) for k, v in extra.items()}
        job.models.update(trace_unit(job, name, module, x.to(job.device), extra, extra_kind=kind))
    job.timings["trace_s"] = time.perf_counter() - t0
    job.forward_skipped = "--granularity blocks"
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
                                              f"than {python_front.IGNORE_INDEX}, float32"),
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
    args = parse_args(argv)
    python_front.IGNORE_INDEX = args.ignore_index
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
