#!/usr/bin/env python3
"""keel's control traffic against the world size (issue 13, item 8; docs/scaling.md).

Runs a tiny model (mlp width 16, depth 1: the gradient all-reduce is negligible) on W ranks of
this machine under torchrun, Gloo over loopback, oversubscribed, for W in --worlds, three runs
each:
  plain   no checkpoints, no evaluation: the per-step control traffic (the step consensus)
  ckpt    a checkpoint committed every step: minus `plain`, what one commit adds
  noval   plain with dist.validate = off: what the validation probes add
and reads rank 0's summary.json: control_per_step (collectives, probes, bytes sent/received,
wait_ms), rendezvous_ms and median_step_ms. It then fits bytes and wait time per step against W
(linear and logarithmic least squares) and prints the table and the fits as JSON too.

  bench/scaling.py                         # W = 2 4 8 16 32, 40 steps
  bench/scaling.py --worlds 2 4 --steps 20 --out bench/results/scaling.json

Timings on an oversubscribed 2-core machine are upper bounds: 32 ranks share 2 cores, so a
collective waits for descheduled peers. The byte counts are exact.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(keel, torchrun, world, steps, kind, work):
    d = os.path.join(work, f"w{world}-{kind}")
    args = [keel, "train", "--config", os.path.join(ROOT, "configs/synthetic_smoke.toml"),
            "--model.width=16", "--model.depth=1", "--train.batch_size=8", f"--train.steps={steps}",
            "--train.eval_interval=0", "--run.threads=1", "--dist.timeout_s=600", f"--run.dir={d}/run",
            "--run.log_level=warn"]
    if kind == "ckpt":
        args += [f"--checkpoint.dir={d}/ckpt", "--checkpoint.interval=1", "--checkpoint.keep=2"]
    if kind == "noval":
        args += ["--dist.validate=off"]
    argv = [torchrun, "--standalone", f"--nproc_per_node={world}", "--no_python", *args]
    t0 = time.monotonic()
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    if r.returncode != 0:
        sys.exit(f"W={world} {kind}: exit {r.returncode}\n{r.stdout[-3000:]}")
    with open(f"{d}/run/summary.json") as f:
        s = json.load(f)
    s["launch_s"] = time.monotonic() - t0
    shutil.rmtree(d, ignore_errors=True)
    return s


def fit(xs, ys, transform):
    """Least squares y = a + b * transform(x); returns a, b, R^2."""
    t = [transform(x) for x in xs]
    n = len(xs)
    mt, my = sum(t) / n, sum(ys) / n
    stt = sum((v - mt) ** 2 for v in t)
    b = sum((v - mt) * (y - my) for v, y in zip(t, ys)) / stt if stt else 0.0
    a = my - b * mt
    ss_res = sum((y - (a + b * v)) ** 2 for v, y in zip(t, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return a, b, 1 - ss_res / ss_tot if ss_tot else 1.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--keel", default=os.path.join(ROOT, "build/keel"))
    ap.add_argument("--torchrun", default=os.path.expanduser("~/.cache/keel/venv/bin/torchrun"))
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="keel-scaling-")
    rows = []
    for w in a.worlds:
        plain = run(a.keel, a.torchrun, w, a.steps, "plain", work)
        ckpt = run(a.keel, a.torchrun, w, a.steps, "ckpt", work)
        noval = run(a.keel, a.torchrun, w, a.steps, "noval", work)
        p, c, n = plain["control_per_step"], ckpt["control_per_step"], noval["control_per_step"]
        row = {
            "world": w,
            "step_collectives": p["collectives"], "step_probes": p["validation_probes"],
            "step_bytes_sent": p["bytes_sent"], "step_bytes_received": p["bytes_received"],
            "step_wait_ms": p["wait_ms"], "step_wait_ms_noval": n["wait_ms"],
            "median_step_ms": plain["median_step_ms"], "median_step_ms_noval": noval["median_step_ms"],
            "commit_collectives": c["collectives"] - p["collectives"], "commit_probes": c["validation_probes"] - p["validation_probes"],
            "commit_bytes_sent": c["bytes_sent"] - p["bytes_sent"],
            "commit_bytes_received": c["bytes_received"] - p["bytes_received"],
            "commit_wait_ms": c["wait_ms"] - p["wait_ms"],
            "rendezvous_ms": plain["rendezvous_ms"],
        }
        rows.append(row)
        print(f"W={w:3d}: step {row['step_collectives']:.1f} coll ({row['step_probes']:.1f} probes), "
              f"{row['step_bytes_sent']:.0f} B sent / {row['step_bytes_received']:.0f} B received, "
              f"wait {row['step_wait_ms']:.2f} ms (validate off: {row['step_wait_ms_noval']:.2f}); "
              f"commit +{row['commit_collectives']:.1f} coll, +{row['commit_bytes_received']:.0f} B received, "
              f"+{row['commit_wait_ms']:.2f} ms; rendezvous {row['rendezvous_ms']:.0f} ms; "
              f"step {row['median_step_ms']:.2f} ms", flush=True)
    ws = [r["world"] for r in rows]
    fits = {}
    for key in ("step_bytes_received", "commit_bytes_received", "step_wait_ms", "commit_wait_ms", "rendezvous_ms"):
        ys = [r[key] for r in rows]
        lin, log = fit(ws, ys, float), fit(ws, ys, lambda x: math.log2(x))
        fits[key] = {"linear": {"a": lin[0], "b": lin[1], "r2": lin[2]}, "log2": {"a": log[0], "b": log[1], "r2": log[2]}}
        print(f"fit {key}: linear {lin[0]:.4g} + {lin[1]:.4g}*W (R^2 {lin[2]:.3f}); "
              f"log {log[0]:.4g} + {log[1]:.4g}*log2(W) (R^2 {log[2]:.3f})")
    out = {"command": " ".join(sys.argv), "host_cores": os.cpu_count(), "steps": a.steps, "rows": rows, "fits": fits}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
