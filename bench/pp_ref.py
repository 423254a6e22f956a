"""PyTorch 2.11's pipeline parallelism (torch.distributed.pipelining) as bench.py --pp-rounds's
peer: gpt (tests/golden's reference Gpt, keel's gpt arithmetic) split into pp x V stages of
equal blocks, the embedding on the first, the final norm and the output projection on the last,
trained with the named schedule over --microbatches micro-batches of --batch samples per step,
AdamW (lr 1e-3), one thread per rank, over Gloo under a launcher (bench.py's, torchrun's
environment). The output projection is its own copy of the token embedding on the last stage (a
PipelineStage cannot share a parameter with another rank's stage; keel keeps both copies equal by
summing their gradients between the two ends, one message more per step than this peer).

  ~/.cache/keel/venv/bin/python bench/pp_ref.py --schedule 1f1b --batch 2 --microbatches 8 --steps 30

Prints one JSON line on rank 0: median_step_ms (after 5 warm-up steps), peak_rss_mb, and the
schedule's PyTorch class.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden"))
from reference_models import Gpt  # noqa: E402

SAMPLES = 4096

SCHEDULES = {  # keel's name -> (PyTorch's class name, stages per rank, V style)
    "gpipe": ("ScheduleGPipe", 1, False),
    "1f1b": ("Schedule1F1B", 1, False),
    "interleaved": ("ScheduleInterleaved1F1B", 2, False),
    "looped-bfs": ("ScheduleLoopedBFS", 2, False),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", 2, False),
    "zbv": ("ScheduleZBVZeroBubble", 2, True),
    "dualpipev": ("ScheduleDualPipeV", 2, True),
}


class Stage(nn.Module):
    def __init__(self, gpt, first_block, end_block, first, last):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        self.h = nn.ModuleList(gpt.h[first_block:end_block])
        if last:
            self.ln_f = gpt.ln_f
            self.head = nn.Linear(gpt.wte.weight.shape[1], gpt.wte.weight.shape[0], bias=False)
            with torch.no_grad():
                self.head.weight.copy_(gpt.wte.weight)

    def forward(self, x):
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", required=True, choices=list(SCHEDULES))
    ap.add_argument("--batch", type=int, required=True, help="samples per micro-batch")
    ap.add_argument("--microbatches", type=int, required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    import torch.distributed.pipelining as pipelining
    cls_name, per_rank, v_style = SCHEDULES[args.schedule]
    n_stages = pp * per_rank
    gpt = Gpt(vocab=args.vocab, context=args.context, layers=args.depth, d=args.width)
    per_stage = args.depth // n_stages
    mine = [rank, 2 * pp - 1 - rank] if v_style else [rank + k * pp for k in range(per_rank)]
    stages, params = [], []
    for s in mine:
        mod = Stage(gpt, s * per_stage, (s + 1) * per_stage, s == 0, s == n_stages - 1)
        params += list(mod.parameters())
        stages.append(pipelining.PipelineStage(mod, s, n_stages, torch.device("cpu")))
    cls = getattr(pipelining, cls_name)

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    schedule = cls(stages if per_rank > 1 or v_style else stages[0], n_microbatches=args.microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(params, lr=1e-3)
    data = torch.randint(0, args.vocab, (SAMPLES, args.context + 1))
    gen = torch.Generator().manual_seed(0)
    holds_first, holds_last = 0 in mine, n_stages - 1 in mine
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        w = data.index_select(0, torch.randint(0, SAMPLES, (args.batch * args.microbatches,), generator=gen))
        x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
        opt.zero_grad(set_to_none=True)
        kwargs = {"target": y, "losses": []} if holds_last else {}
        if holds_first:
            schedule.step(x, **kwargs)
        else:
            schedule.step(**kwargs)
        opt.step()
        times.append((time.perf_counter() - t0) * 1000.0)
    if rank == 0:
        print(json.dumps({"impl": "pytorch-pipelining", "schedule": args.schedule, "class": cls_name,
                          "version": torch.__version__, "world": pp, "batch": args.batch,
                          "microbatches": args.microbatches, "median_step_ms": statistics.median(times[5:]),
                          "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
