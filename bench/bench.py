"""keel vs PyTorch on identical work, side by side in one run.

  /usr/bin/python3 bench/bench.py                      # mlp, cnn, gpt at world 1
  /usr/bin/python3 bench/bench.py --models cnn --steps 100 --threads 2

For each model: runs `build/keel train` on synthetic data (same shapes, AdamW, batch, threads)
and bench/torch_ref.py, prints one JSON line per run ({impl, model, world, batch,
median_step_ms, throughput}) and one line with the ratio keel / PyTorch of the median step
time (below 1 means keel is faster). Results also go to bench/results/<timestamp>.jsonl.
Never run two benchmarks at once on the same machine: the numbers would be meaningless.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = {"mlp": 32, "cnn": 64, "gpt": 8}  # per rank, as in the dist/ issue's targets
PY = "/usr/bin/python3"


def run_keel(model, batch, steps, threads, keel):
    with tempfile.TemporaryDirectory() as d:
        cmd = [keel, "train", f"--model.name={model}", "--data.name=synthetic", f"--train.steps={steps}",
               f"--train.batch_size={batch}", "--train.lr=1e-3", "--train.schedule=constant",
               f"--run.threads={threads}", f"--run.dir={d}", "--run.log_level=warn", "--data.synthetic_size=4096"]
        subprocess.run(cmd, check=True)
        s = json.load(open(os.path.join(d, "summary.json")))
    out = {"impl": "keel", "version": s["keel_version"], "model": model, "world": s["world_size"], "batch": batch,
           "threads": threads, "median_step_ms": s["median_step_ms"], "throughput": s["samples_per_s"]}
    if "tokens_per_s" in s:
        out["tokens_per_s"] = s["tokens_per_s"]
    return out


def run_torch(model, batch, steps, threads):
    cmd = [PY, os.path.join(ROOT, "bench", "torch_ref.py"), "--model", model, "--batch", str(batch),
           "--steps", str(steps), "--threads", str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp,cnn,gpt")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keel", default=os.path.join(ROOT, "build", "keel"))
    args = ap.parse_args()
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    log_path = os.path.join(ROOT, "bench", "results", time.strftime("%Y%m%d-%H%M%S") + ".jsonl")
    with open(log_path, "w") as log:
        for model in args.models.split(","):
            steps = max(args.steps // 4, 12) if model == "gpt" else args.steps
            k = run_keel(model, BATCH[model], steps, args.threads, args.keel)
            t = run_torch(model, BATCH[model], steps, args.threads)
            ratio = {"model": model, "world": 1, "steps": steps,
                     "step_time_ratio_keel_over_pytorch": k["median_step_ms"] / t["median_step_ms"]}
            for line in (k, t, ratio):
                print(json.dumps(line), flush=True)
                log.write(json.dumps(line) + "\n")
    print(f"# results: {log_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
