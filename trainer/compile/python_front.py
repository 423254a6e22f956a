"""trainer/compile/python_front.py: a user's PyTorch module as the packaging step's model
(model.name = "python", aot_package.py --module): importing its factory, the example batch,
the initial weights (--init-out), keel's cross-entropy over its logits and the checks of what
the module returns, and the refusals that name the user's file and line."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
import tempfile

from aot_common import EXIT_USAGE, Refusal, _is_library_file, _is_this_file, _is_torch_file, sha256_file, source_text, user_frame


# keel's [model] keys (trainer/config/schema.cpp). Those that do not change the graph
# (name, path, factory, input, init_from) are accepted and ignored.
MODEL_KEYS = {"name", "path", "factory", "width", "depth", "heads", "context", "vocab", "input", "num_classes", "init_from",
              "kv_heads", "ffn_width", "rope_theta", "norm_eps", "tie_embeddings", "dropout", "hf_config"}


MODEL_DEFAULTS = {"width": 0, "depth": 0, "heads": 4, "context": 128, "vocab": 256, "num_classes": 10}


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
