"""keel vs PyTorch on identical work, side by side in one run.

  /usr/bin/python3 bench/bench.py                        # mlp, cnn, gpt at worlds 1 and 2
  /usr/bin/python3 bench/bench.py --models cnn --worlds 1 --steps 100

For each model and world size: runs `build/keel train` on synthetic data and
bench/torch_ref.py (PyTorch, DistributedDataParallel over Gloo when world > 1) with the same
model, per-rank batch (mlp 32, cnn 64, gpt 8), AdamW, and one intra-op thread per rank. Ranks
are started directly with torchrun's environment variables (RANK, WORLD_SIZE, MASTER_ADDR, ...)
for both, so launcher overhead is not measured. Prints one JSON line per run ({impl, model,
world, batch, median_step_ms, throughput}), then per model: keel / PyTorch step-time ratios,
scaling efficiency from 1 to 2 ranks (t1 / t2 at a fixed per-rank batch), and the cost of
dist.validate = always versus off. Results also go to bench/results/<timestamp>.jsonl.
Never run two benchmarks at once on the same machine: the numbers would be meaningless.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = {"mlp": 32, "cnn": 64, "gpt": 8}  # per rank, as in the dist/ issue's targets
PY = "/usr/bin/python3"


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(cmd, world):
    """Runs `cmd` as `world` ranks with torchrun's environment; returns rank 0's stdout."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        if world == 1:
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(k)
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate()[0] for p in procs]
    for p in procs:
        if p.returncode != 0:
            raise SystemExit(f"benchmark command failed ({p.returncode}): {' '.join(cmd)}")
    return outs[0]


def run_keel(model, batch, steps, world, keel, validate="always"):
    with tempfile.TemporaryDirectory() as d:
        cmd = [keel, "train", f"--model.name={model}", "--data.name=synthetic", f"--train.steps={steps}",
               f"--train.batch_size={batch}", "--train.lr=1e-3", "--train.schedule=constant",
               "--run.threads=1", f"--run.dir={d}", "--run.log_level=warn", "--data.synthetic_size=4096",
               f"--dist.validate={validate}"]
        launch(cmd, world)
        s = json.load(open(os.path.join(d, "summary.json")))
    out = {"impl": "keel", "version": s["keel_version"], "model": model, "world": s["world_size"], "batch": batch,
           "threads": 1, "validate": validate, "median_step_ms": s["median_step_ms"],
           "throughput": s["samples_per_s"]}
    if "tokens_per_s" in s:
        out["tokens_per_s"] = s["tokens_per_s"]
    return out


def run_torch(model, batch, steps, world):
    cmd = [PY, os.path.join(ROOT, "bench", "torch_ref.py"), "--model", model, "--batch", str(batch),
           "--steps", str(steps), "--threads", "1"]
    return json.loads(launch(cmd, world).strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp,cnn,gpt")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--keel", default=os.path.join(ROOT, "build", "keel"))
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    log_path = os.path.join(ROOT, "bench", "results", time.strftime("%Y%m%d-%H%M%S") + ".jsonl")
    with open(log_path, "w") as log:
        def emit(line):
            print(json.dumps(line), flush=True)
            log.write(json.dumps(line) + "\n")

        for model in args.models.split(","):
            steps = max(args.steps // 5, 12) if model == "gpt" else args.steps
            keel, torch_ = {}, {}
            for world in worlds:
                keel[world] = run_keel(model, BATCH[model], steps, world, args.keel)
                emit(keel[world])
                torch_[world] = run_torch(model, BATCH[model], steps, world)
                emit(torch_[world])
            summary = {"model": model, "steps": steps}
            for world in worlds:
                summary[f"keel_over_pytorch_step_time_w{world}"] = (
                    keel[world]["median_step_ms"] / torch_[world]["median_step_ms"])
            if 1 in worlds and 2 in worlds:
                summary["scaling_efficiency_keel"] = keel[1]["median_step_ms"] / keel[2]["median_step_ms"]
                summary["scaling_efficiency_pytorch"] = torch_[1]["median_step_ms"] / torch_[2]["median_step_ms"]
                off = run_keel(model, BATCH[model], steps, 2, args.keel, validate="off")
                emit(off)
                summary["validate_always_over_off"] = keel[2]["median_step_ms"] / off["median_step_ms"]
            emit(summary)
    print(f"# results: {log_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
