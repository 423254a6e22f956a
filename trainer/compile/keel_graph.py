"""trainer/compile/keel_graph.py: keel's traced graphs replayed through torch.ops (issue 65: the
model compiled is the C++ model trained). A keel-graph/1 file (trainer/compile/graph_file.h: the
whole training step) becomes a module whose forward(input, target) returns the loss; a
keel-graphs/1 bundle (trainer/compile/unit_trace.h: the block, the root's embed, head and loss,
or the tensor-parallel regions) a module per unit, forward(x[, (target,)]). Their parameters
carry keel's names; the graphs hold their own autocast casts."""
from __future__ import annotations

import json

from aot_common import EXIT_GRAPH_BREAK, EXIT_USAGE, Refusal


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


def stand_in(spec: dict):
    """A parameter of the graph input `spec`'s shape and dtype, with values of its own: the package
    takes keel's as inputs."""
    import torch

    return torch.nn.Parameter(torch.randn(spec["shape"], dtype=getattr(torch, spec["dtype"])) * 0.02)


def graph_units(g: dict, tensors, dev):
    """(container, x, x, None, ident) of a keel-graphs/1 bundle (trainer/compile/unit_trace.h): each
    unit a module of the container whose parameters are registered flat ("ln_1__weight"; keel's
    names in keel_names, in the graph's order) and whose forward(x[, (target,)]) replays the unit.
    container.units: name -> (module, example input, {name: extra input}, the extra's kind)."""
    import torch

    class Unit(torch.nn.Module):
        traced_autocast = True  # its casts are in the graph: partition_block applies no autocast

        def __init__(self, u, constants):
            super().__init__()
            self.u, self.constants = u, constants
            self.keel_names = [i["name"] for i in u["inputs"] if i["kind"] == "parameter"]
            for i in u["inputs"]:
                if i["kind"] == "parameter":
                    self.register_parameter(i["name"].replace(".", "__"), stand_in(i))

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
        if spec["kind"] == "parameter":
            m.register_parameter(leaf, stand_in(spec))
        else:
            m.register_buffer(leaf, examples[spec["name"]].clone())
    x, y = examples["input"], examples["target"]
    return module, x, y, None, {"model": "graph", "graph": g["what"], "input_kind": "graph"}
