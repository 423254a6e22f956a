"""PyTorch reference for bench.py and scripts/gpu_check.sh: the same model, batch, optimizer,
thread count and synthetic data as a keel run, timed the same way (median step time after the
first 5 steps).

  ~/.cache/keel/venv/bin/python bench/torch_ref.py --model cnn --batch 64 --steps 60 --threads 1
  ... --compile            # torch.compile (Inductor), in the order place -> compile -> DDP: DDP(torch.compile(m))
  ... --compile --compile-order ddp   # torch.compile(DDP(m)): PyTorch's documented order, whose
                           # DDPOptimizer splits the graph at the bucket boundaries so that the
                           # all-reduces overlap the backward (the same as the default at one rank)
  ... --compile --fsdp     # FSDP2 with every block compiled on its own before fully_shard (torchtitan's way)
  ... --compile --compile-mode max-autotune-no-cudagraphs   # another torch.compile mode
  ... --device cuda        # on the GPU (DDP over NCCL under torchrun)
  ... --fused              # torch.optim.AdamW(fused=True) instead of PyTorch's default implementation
  ... --zero               # torch.distributed.optim.ZeroRedundancyOptimizer (ZeRO stage 1) over AdamW
  ... --fsdp               # FSDP2: fully_shard on each block (gpt's h.N, mlp's layers), then the root
  ... --tp                 # gpt: DTensor tensor parallelism over the whole world (parallelize_module:
                           # ColwiseParallel q/k/v and c_fc, RowwiseParallel c_proj, the token embedding
                           # vocabulary-parallel, the tied output projection and loss_parallel over vocabulary shards)
  ... --tp --sp            # and SequenceParallel norms (torchtitan's plan)
  ... --context 512 --ac   # gpt at another context; --ac: every block checkpointed (torch.utils.checkpoint)
  ... --context 512 --ac selective   # every block checkpointed, its matmuls' outputs saved
  ... --count-memory       # CPU: after the timed steps, one step under torch.profiler's memory
                           # tracking: tensor_step_peak_mb, the peak bytes of live CPU tensors
                           # over those alive when that step ends (keel: cpu_tensor_peak_mb -
                           # cpu_tensor_end_mb, run.count_tensor_memory)

Prints one JSON line. Under a launcher (WORLD_SIZE > 1, or MASTER_ADDR set) the model is
wrapped in DistributedDataParallel (Gloo on CPU, NCCL on CUDA) and each rank uses --batch
samples per step. compile_ms is the time of the first step (Inductor compiles there).
optimizer_state_bytes is the optimizer state this rank holds; peak_rss_mb its peak resident set;
parameter_bytes and gradient_bytes the parameters and gradients it holds after the last step
(with --fsdp, its local shards).
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden"))
from reference_models import Cnn, Gpt, Mlp  # noqa: E402


SAMPLES = 4096  # the synthetic data set's size


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, choices=["mlp", "cnn", "gpt"])
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model before wrapping it in DDP")
    ap.add_argument("--compile-order", default="model", choices=["model", "ddp"],
                    help="with --compile under DDP: model = DDP(torch.compile(m)) (compile, then distribute); "
                         "ddp = torch.compile(DDP(m)) (DDPOptimizer: the graph split at the bucket boundaries)")
    ap.add_argument("--compile-mode", default="default",
                    help="torch.compile's mode: default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--fused", action="store_true",
                    help="torch.optim.AdamW(fused=True): one kernel for all parameters (default: PyTorch's default "
                         "implementation, the for-loop on CPU and foreach on CUDA)")
    ap.add_argument("--zero", action="store_true", help="ZeroRedundancyOptimizer: the AdamW state partitioned across ranks")
    ap.add_argument("--fsdp", action="store_true",
                    help="FSDP2 (torch.distributed.fsdp.fully_shard) per block and at the root, instead of DDP")
    ap.add_argument("--tp", action="store_true",
                    help="gpt: tensor parallelism over the whole world (torch.distributed.tensor.parallel), instead of DDP")
    ap.add_argument("--sp", action="store_true", help="with --tp: sequence parallelism (SequenceParallel norms)")
    ap.add_argument("--context", type=int, default=128, help="gpt's context (and the windows' length)")
    ap.add_argument("--width", type=int, default=256, help="gpt's width")
    ap.add_argument("--depth", type=int, default=4, help="gpt's blocks")
    ap.add_argument("--vocab", type=int, default=256, help="gpt's vocabulary (the tokens drawn below it)")
    ap.add_argument("--losses", action="store_true", help="also print every step's loss (checks: --tp's losses are "
                    "one rank's)")
    ap.add_argument("--ac", nargs="?", const="blocks", choices=["blocks", "selective"],
                    help="activation checkpointing of every block (torch.utils.checkpoint, non-reentrant); "
                         "selective: its matmuls' outputs saved, the rest recomputed (selective activation "
                         "checkpointing, torchtitan's op policy for mm and addmm)")
    ap.add_argument("--count-memory", action="store_true",
                    help="CPU: after the timed steps, one more step with torch.profiler's memory tracking, whose "
                         "peak bytes of live tensors over those at its end is printed (tensor_step_peak_mb)")
    return ap.parse_args()


def synthetic_data(model_name, device, context=128, vocab=256):
    """(data, labels or None, tokens per sample): token windows for gpt, images and labels otherwise."""
    if model_name == "gpt":
        data = torch.randint(0, vocab, (SAMPLES, context + 1))
        labels = None
        tokens_per_sample = context
    else:
        data = torch.randn(SAMPLES, 1, 28, 28)
        labels = torch.randint(0, 10, (SAMPLES,))
        tokens_per_sample = 0
    data = data.to(device)
    if model_name != "gpt":
        labels = labels.to(device)
    return data, labels, tokens_per_sample


class SplitQkv(nn.Module):
    """The reference attention with q, k and v as three projections (so that ColwiseParallel splits
    each by heads, as keel's plan splits the fused c_attn block by block), its heads counted from
    the local width: the same weights and arithmetic."""

    def __init__(self, attn):
        super().__init__()
        d = attn.c_proj.in_features
        self.head_dim = d // attn.heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        with torch.no_grad():
            for lin, w, b in zip((self.q, self.k, self.v), attn.c_attn.weight.split(d, 0), attn.c_attn.bias.split(d, 0)):
                lin.weight.copy_(w)
                lin.bias.copy_(b)
        self.c_proj = attn.c_proj

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        B, T, n = q.shape
        q, k, v = (t.view(B, T, n // self.head_dim, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, n)
        return self.c_proj(y)


def tensor_parallel(model, sp, rank, world):
    """gpt over a 1-D mesh of the world with torch.distributed.tensor.parallel, torchtitan's plan
    for a GPT: each block's q, k, v and c_fc ColwiseParallel, its c_proj RowwiseParallel; the token
    embedding RowwiseParallel (vocabulary rows), the tied output projection a DTensor matmul with
    the embedding's rows (logits sharded over the vocabulary) and the loss under loss_parallel();
    with `sp` the norms SequenceParallel and the regions' inputs gathered by PrepareModuleInput.
    The position embedding stays a plain parameter: with `sp` each rank adds its positions' rows
    and its gradient is summed over the ranks after the backward (finish())."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.h:
        block.attn = SplitQkv(block.attn)
        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.c_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
                "mlp.c_fc": ColwiseParallel(),
                "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())}
        if sp:
            plan.update({"ln_1": SequenceParallel(), "ln_2": SequenceParallel(),
                         "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                         "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
        parallelize_module(block, mesh, plan)
    top = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())}
    if sp:
        top["ln_f"] = SequenceParallel()
    parallelize_module(model, mesh, top)

    def forward(idx):
        T = idx.shape[1]
        pos = model.wpe(torch.arange(T, device=idx.device))
        x = model.wte(idx) + (pos.chunk(world, 0)[rank] if sp else pos)
        for block in model.h:
            x = block(x)
        x = model.ln_f(x)
        x = x.redistribute(mesh, [Replicate()]) if sp else DTensor.from_local(x, mesh, [Replicate()])
        return x @ model.wte.weight.t()  # (B, T, vocab) sharded over the vocabulary

    def finish():
        if sp:
            dist.all_reduce(model.wpe.weight.grad)

    model.forward = forward
    model.finish = finish
    return model


def distributed(world):
    return world > 1 or "MASTER_ADDR" in os.environ


def compile_and_distribute(model, args, world, device, local_rank):
    mode = None if args.compile_mode == "default" else args.compile_mode
    blocks = model.h if hasattr(model, "h") else getattr(model, "fc", [])
    if args.compile and args.tp:
        raise SystemExit("torch_ref.py: --compile with --tp is not measured (the tp forward replaces the compiled one)")
    if args.compile and args.fsdp and distributed(world) and len(blocks) > 0:
        # torchtitan's way: each block compiled on its own (its own graph, between whose runs
        # FSDP2's all-gathers and reduce-scatters go), then fully_shard on each block and the root
        for block in blocks:
            block.compile(mode=mode)
    elif args.compile and (args.compile_order == "model" or not distributed(world) or args.fsdp):
        # compile, then distribute (as keel's pipeline; a model without blocks under FSDP2 whole)
        model = torch.compile(model, mode=mode)
    if distributed(world):
        import torch.distributed as dist
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if args.tp:
            return tensor_parallel(model, args.sp, dist.get_rank(), world)
        if args.fsdp:
            from torch.distributed.fsdp import fully_shard
            for block in blocks:
                fully_shard(block)
            fully_shard(model)
        else:
            model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[local_rank] if device.type == "cuda" else None)
            if args.compile and args.compile_order == "ddp":
                model = torch.compile(model, mode=mode)  # DDPOptimizer (torch._dynamo.config.optimize_ddp)
    return model


def make_optimizer(model, args, world):
    if args.zero and (world > 1 or "MASTER_ADDR" in os.environ):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr)
    return torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True if args.fused else None)


def run_steps(model, opt, data, labels, args, rank, device, steps=None, gen=None):
    """The step times in milliseconds, one per step, and the losses."""
    gen = gen or torch.Generator().manual_seed(0 if args.tp else rank)  # tp ranks read the same batch
    times, losses = [], []
    for step in range(args.steps if steps is None else steps):
        t0 = time.perf_counter()
        idx = torch.randint(0, SAMPLES, (args.batch,), generator=gen).to(device)
        if args.model == "gpt":
            w = data.index_select(0, idx)
            x, y = w[:, :-1], w[:, 1:]
        else:
            x, y = data.index_select(0, idx), labels.index_select(0, idx)
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        if args.tp:
            from torch.distributed.tensor.parallel import loss_parallel
            with loss_parallel():
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                loss.backward()
            model.finish()
            value = loss.full_tensor().item()
        else:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            value = loss.item()
        losses.append(value)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000.0)
    return times, losses


def step_peak_mb(model, opt, data, labels, args, rank, device):
    """One more training step (zero_grad, forward, backward, optimizer) under torch.profiler's memory
    tracking: the CPU allocator reports each allocation and free; the peak of their running sum over
    its value when the step ends, in MiB. This is keel's run.count_tensor_memory figure
    (cpu_tensor_peak_mb - cpu_tensor_end_mb: the peak bytes of live tensors over those alive at the
    end, when the model, gradients, optimizer state and data are) for one step: what the step held
    beyond what it keeps."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_steps(model, opt, data, labels, args, rank, device, steps=1)
    cpu = torch._C._autograd.DeviceType.CPU
    deltas = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == cpu]
    live = peak = 0
    for _, n in sorted(deltas):
        live += n
        peak = max(peak, live)
    return (peak - live) / 2**20


def held(t):  # a DTensor's local shard (FSDP2), else the tensor
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def bytes_held(model, opt):
    """The optimizer state, parameters and gradients this rank holds (with --fsdp, its shards)."""
    local = opt.optim if hasattr(opt, "optim") else opt  # ZeroRedundancyOptimizer's own partition
    state_bytes = sum(held(t) for st in local.state.values() for t in st.values() if torch.is_tensor(t))
    param_bytes = sum(held(p) for p in model.parameters())
    grad_bytes = sum(held(p.grad) for p in model.parameters() if p.grad is not None)
    return {"optimizer_state_bytes": state_bytes, "parameter_bytes": param_bytes, "gradient_bytes": grad_bytes}


def result(args, world, device, times, med, held_bytes, tokens_per_sample):
    """The JSON line rank 0 prints."""
    out = {"impl": "pytorch-compile" if args.compile else "pytorch", "torch": torch.__version__,
           "model": args.model, "world": world, "device": device.type, "compile_ms": times[0],
           "batch": args.batch, "threads": args.threads, "median_step_ms": med,
           "throughput": world * args.batch * 1000.0 / med, **held_bytes,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}
    if args.compile and args.compile_mode != "default":
        out["impl"] += "-" + args.compile_mode
    if args.compile and args.compile_order == "ddp" and distributed(world) and not args.fsdp:
        out["impl"] += "-of-ddp"
    if args.fused:
        out["impl"] += "-fused"
    if args.zero:
        out["impl"] += "-zero1"
    if args.fsdp:
        out["impl"] += "-fsdp2"
    if args.tp:
        out["impl"] += "-tp" + str(world) + ("-sp" if args.sp else "")
    if args.ac:
        out["impl"] += "-ac" if args.ac == "blocks" else "-sac"
    if args.context != 128:
        out["context"] = args.context
    if args.model == "gpt" and (args.width, args.depth, args.vocab) != (256, 4, 256):
        out.update({"width": args.width, "depth": args.depth, "vocab": args.vocab})
    if tokens_per_sample:
        out["tokens_per_s"] = out["throughput"] * tokens_per_sample
    return out


def checkpoint_blocks(model, policy):
    """Every block of gpt recomputed in backward (torch.utils.checkpoint, non-reentrant, as
    torchtitan's full activation checkpointing); policy "selective": the outputs of its matmuls
    (aten.mm, aten.addmm: the dense projections) saved and everything else recomputed, by
    torch.utils.checkpoint's selective checkpoint contexts (torchtitan's op policy, without its
    attention and collectives, as keel's train.activation_checkpointing = "selective")."""
    import functools
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
    kwargs = {"use_reentrant": False}
    if policy == "selective":
        saved = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}

        def keep_matmuls(ctx, op, *args, **kw):
            return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, keep_matmuls)
    for block in model.h:
        block.forward = (lambda f: lambda x: checkpoint(f, x, **kwargs))(block.forward)


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = (Gpt(vocab=args.vocab, context=args.context, layers=args.depth, d=args.width) if args.model == "gpt" else {"mlp": Mlp, "cnn": Cnn}[args.model]()).to(device)
    if args.ac:
        checkpoint_blocks(model, args.ac)
    data, labels, tokens_per_sample = synthetic_data(args.model, device, args.context, args.vocab)
    model = compile_and_distribute(model, args, world, device, local_rank)
    opt = make_optimizer(model, args, world)
    times, losses = run_steps(model, opt, data, labels, args, rank, device)
    med = statistics.median(times[5:] if len(times) > 5 else times)
    held_bytes = bytes_held(model, opt)
    step_peak = step_peak_mb(model, opt, data, labels, args, rank, device) if args.count_memory else None
    if rank == 0:
        out = result(args, world, device, times, med, held_bytes, tokens_per_sample)
        if step_peak is not None:
            out["tensor_step_peak_mb"] = step_peak
        if args.losses:
            out["losses"] = losses
        print(json.dumps(out), flush=True)
    if args.zero:
        # With ZeroRedundancyOptimizer over Gloo, PyTorch 2.11 aborts in about 1 run in 4 while
        # the interpreter tears down ("terminate called without an active exception", after
        # the result is printed). Measured work is done: leave without the teardown.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
