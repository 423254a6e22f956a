"""trainer/compile/aot_checks.py: the packaging step's checks (aot_package.py): what a graph
break is and where (describe_break; trace: make_fx with its failures as refusals), the graph checks (random ops, non-deterministic ops,
custom ops), --deterministic's dry run, and --check (the package against the eager model)."""
from __future__ import annotations

import contextlib
import statistics
import time

from aot_common import EXIT_GRAPH_BREAK, EXIT_NO_FAKE_KERNEL, EXIT_NONDETERMINISTIC, Refusal, _is_this_file, _is_torch_file, log, source_text, user_frame


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


def op_name(node) -> str:
    t = node.target
    if hasattr(t, "_schema"):
        return t._schema.name
    return getattr(t, "__name__", str(t))


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
