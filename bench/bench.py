"""keel vs PyTorch on identical work, side by side in one run.

  PY=~/.cache/keel/venv/bin/python       # the venv scripts/setup.sh made (PyTorch 2.11)
  $PY bench/bench.py                        # mlp, cnn, gpt at worlds 1 and 2
  $PY bench/bench.py --models cnn --worlds 1 --steps 100
  $PY bench/bench.py --validate-pairs 15    # dist.validate = always vs off, paired runs
  $PY bench/bench.py --observe-rounds 5     # TensorBoard and the profiler off vs on
  $PY bench/bench.py --zero-rounds 5        # dist.zero = 0 / 1 / 2 (and PyTorch's ZeroRedundancyOptimizer) on gpt
  $PY bench/bench.py --fsdp-rounds 5 --worlds 2,3   # dist.zero = 3 beside stage 0, PyTorch DDP and FSDP2 on gpt
  $PY bench/bench.py --tp-rounds 3          # tp 2 (with and without sp) beside dp 2, PyTorch DDP and DTensor TP on gpt
  $PY bench/bench.py --ac-rounds 3          # activation checkpointing at gpt context 512, keel and PyTorch
  $PY bench/bench.py --small-gpt-rounds 3   # a small GPT at one rank, where per-op overhead dominates
  $PY bench/bench.py --baseline /tmp/keel-old --worlds 2   # this build vs another keel binary
  $PY bench/bench.py --inductor             # keel compile.mode = inductor beside eager and torch.compile'd PyTorch

For each model and world size: runs `build/keel train` on synthetic data and
bench/torch_ref.py, PyTorch eager and torch.compile (Inductor) in both orders under DDP
(DDP(torch.compile(m)), and torch.compile(DDP(m)), whose DDPOptimizer splits the graph at the
buckets; the faster is named and taken for the ratio), with DistributedDataParallel over Gloo when world > 1, with the same model, per-rank
batch (mlp 32, cnn 64, gpt 8), AdamW, and one intra-op thread per rank. The PyTorch peers run
with the Python running this script (sys.executable), which must hold torch. Ranks
are started directly with torchrun's environment variables (RANK, WORLD_SIZE, MASTER_ADDR, ...)
for both, so launcher overhead is not measured. Prints one JSON line per run ({impl, model,
world, batch, median_step_ms, throughput}), then per model: keel / PyTorch step-time ratios,
scaling efficiency from 1 to 2 ranks (t1 / t2 at a fixed per-rank batch), and the cost of
dist.validate = always versus off. Each configuration runs --repeat times (interleaved) and
the median run is reported. With build/keel_comm_bench it also measures the raw Gloo
all-reduce of each model's gradients and the validation round. Results also go to
bench/results/<timestamp>.jsonl.
With --compile it compares keel's compile.mode = trace with off instead (step time at each
world size, and cold vs warm compile time with compile.cache_dir).
Never run two benchmarks at once on the same machine: the numbers would be meaningless.
"""
import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = {"mlp": 32, "cnn": 64, "gpt": 8}  # per rank, as in the dist/ issue's targets
PY = sys.executable


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(cmd, world, extra_env=None):
    """Runs `cmd` as `world` ranks with torchrun's environment; returns rank 0's stdout."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, **(extra_env or {}), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
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


def run_keel(model, batch, steps, world, keel, validate="always", compile_mode="off", cache_dir="", amp="off",
             extra=()):
    """keel train of `model` on synthetic data."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [keel, "train", f"--model.name={model}", "--data.name=synthetic", f"--train.steps={steps}",
               f"--train.batch_size={batch}", "--train.lr=1e-3", "--train.schedule=constant",
               "--run.threads=1", f"--run.dir={d}", "--run.log_level=warn", "--data.synthetic_size=4096",
               f"--dist.validate={validate}", f"--compile.mode={compile_mode}", f"--compile.cache_dir={cache_dir}",
               f"--amp.dtype={amp}", *extra]
        launch(cmd, world)
        s = json.load(open(os.path.join(d, "summary.json")))
    out = {"impl": "keel", "version": s["keel_version"], "model": model, "world": s["world_size"], "batch": batch,
           "threads": 1, "validate": validate, "compile_mode": s["compile_mode"], "compile_ms": s["compile_ms"],
           "compile_cache": s["compile_cache"], "amp_dtype": s["amp_dtype"], "median_step_ms": s["median_step_ms"],
           "throughput": s["samples_per_s"], "zero": s.get("zero", 0),
           "optimizer_state_bytes": s.get("optimizer_state_bytes"), "peak_rss_mb": s.get("peak_rss_mb"),
           "parameter_bytes": s.get("parameter_bytes"), "gradient_bytes": s.get("gradient_bytes"),
           "cpu_tensor_peak_mb": s.get("cpu_tensor_peak_mb"), "cpu_tensor_end_mb": s.get("cpu_tensor_end_mb")}
    if "tokens_per_s" in s:
        out["tokens_per_s"] = s["tokens_per_s"]
    return out


def run_torch(model, batch, steps, world, compiled=False, zero=False, compile_mode="default", fsdp=False, extra=()):
    cmd = [PY, os.path.join(ROOT, "bench", "torch_ref.py"), "--model", model, "--batch", str(batch),
           "--steps", str(steps), "--threads", "1"] + (["--compile", "--compile-mode", compile_mode] if compiled else []) + (["--zero"] if zero else []) + (["--fsdp"] if fsdp else []) + list(extra)
    return json.loads(launch(cmd, world).strip().splitlines()[-1])


def middle(values):
    """The median of `values` (the upper one of an even count)."""
    values = sorted(values)
    return values[len(values) // 2]


def median_run(runs):
    """The run with the median step time of repeated runs (noise on a shared machine)."""
    runs = sorted(runs, key=lambda r: r["median_step_ms"])
    best = dict(runs[len(runs) // 2])
    best["repeats"] = len(runs)
    best["all_median_step_ms"] = [r["median_step_ms"] for r in runs]
    return best


def comm_figures(worlds):
    """keel_comm_bench at 2 ranks: raw all-reduce of each model's gradients, validation cost."""
    exe = os.path.join(ROOT, "build", "keel_comm_bench")
    if 2 not in worlds or not os.path.exists(exe):
        return []
    return [json.loads(l) for l in launch([exe, "--iters", "40"], 2).splitlines() if l.startswith("{")]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp,cnn,gpt")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each configuration, interleaved; the median is reported")
    ap.add_argument("--keel", default=os.path.join(ROOT, "build", "keel"))
    ap.add_argument("--amp", action="store_true",
                    help="instead: keel with amp.dtype = bf16 vs fp32 (cnn and gpt, 1 rank)")
    ap.add_argument("--inductor", action="store_true",
                    help="keel compile.mode = inductor beside PyTorch eager and torch.compile (default, max-autotune-no-cudagraphs)")
    ap.add_argument("--inductor-systems", default="",
                    help="--inductor: only these systems, comma-separated (e.g. keel-off,keel-inductor); default all, "
                         "PyTorch's included")
    ap.add_argument("--inductor-cache", default="", help="keel's compile.cache_dir for --inductor (default: a temp folder kept between runs)")
    ap.add_argument("--compile", action="store_true",
                    help="instead: keel with compile.mode = trace vs off, and cold vs warm compile time")
    ap.add_argument("--baseline", default="",
                    help="instead: --keel against this other keel binary (e.g. the previous commit's build), "
                         "--repeat pairs per model and world run back to back, order alternating")
    ap.add_argument("--observe-rounds", type=int, default=0,
                    help="instead: N rounds of TensorBoard and profiler off / TensorBoard on / both on (gpt, 2 "
                         "ranks), order rotating: what watching a run costs")
    ap.add_argument("--fsdp-rounds", type=int, default=0,
                    help="instead: N rounds of keel dist.zero = 0 and 3, PyTorch DDP and FSDP2 (fully_shard) on gpt "
                         "at each of --worlds (order rotating); memory held per rank and step time over keel zero=0's")
    ap.add_argument("--tp-rounds", type=int, default=0,
                    help="instead: N rounds on gpt at 2 ranks and a global batch of 16 (order rotating): keel dp 2, "
                         "tp 2, tp 2 + sequence parallel; PyTorch DDP and DTensor tensor parallel (with and without "
                         "SequenceParallel): step time, per-rank parameters, peak RSS, and each step's tensor memory counted "
                         "exactly in a run of its own")
    ap.add_argument("--pp-rounds", type=int, default=0,
                    help="instead: N rounds on gpt at pp 2, 8 micro-batches of 2 (order rotating): keel's pipeline per "
                         "schedule beside PyTorch 2.11's torch.distributed.pipelining (bench/pp_ref.py), the bubble "
                         "measured against theory, rank 0's counted step memory at gpipe and 1f1b")
    ap.add_argument("--pp-schedules", default="gpipe,1f1b,interleaved,looped-bfs,interleaved-zb,zbv,dualpipev",
                    help="with --pp-rounds: the schedules")
    ap.add_argument("--small-gpt-rounds", type=int, default=0,
                    help="instead: N rounds of a small GPT (4 blocks, width 128, context 64, vocab 65, batch 12) at one "
                         "rank: keel off and inductor beside PyTorch eager and torch.compile (order rotating)")
    ap.add_argument("--ac-rounds", type=int, default=0,
                    help="instead: N rounds on gpt at context 512, 1 rank, batch 4 (and 1, for the activation "
                         "estimate), order rotating: keel train.activation_checkpointing none / blocks / "
                         "selective, PyTorch without and with torch.utils.checkpoint per block (full, and "
                         "selective: its matmuls' outputs saved)")
    ap.add_argument("--zero-rounds", type=int, default=0,
                    help="instead: N rounds of dist.zero = 0, 1, 2 on gpt at each of --worlds (order rotating), "
                         "with PyTorch DDP and ZeroRedundancyOptimizer: optimizer state, peak RSS and step time")
    ap.add_argument("--flight-rounds", type=int, default=0,
                    help="instead: N rounds on gpt at each of --worlds (the issue: --worlds 2) of keel with the flight "
                         "recorder off (dist.flight_recorder = 0) and on (2000, the default), PyTorch DDP beside them, "
                         "the order rotating: what the record costs a step")
    ap.add_argument("--validate-pairs", type=int, default=0,
                    help="instead: N back-to-back pairs of dist.validate = always and off (mlp, 2 ranks), order alternating")
    ap.add_argument("--ab", action="append", default=[], metavar="NAME=OVERRIDES",
                    help="with --ab-rounds: a keel configuration (space-separated overrides, e.g. "
                         "'one-bucket=--dist.bucket_cap_mb=1000 --dist.first_bucket_mb=1000'); the first is the base")
    ap.add_argument("--ab-rounds", type=int, default=0,
                    help="instead: N rounds of the --ab configurations on the first of --models at each of --worlds "
                         "(order rotating), each step time over the first configuration's")
    return ap.parse_args()


def main():
    args = parse_args()
    if args.ab_rounds:
        return ab_bench(args)
    if args.baseline:
        return baseline_bench(args)
    if args.validate_pairs:
        return validate_bench(args)
    if args.flight_rounds:
        return flight_bench(args)
    if args.observe_rounds:
        return observe_bench(args)
    if args.zero_rounds:
        return zero_bench(args)
    if args.fsdp_rounds:
        return fsdp_bench(args)
    if args.tp_rounds:
        return tp_bench(args)
    if args.pp_rounds:
        return pp_bench(args)
    if args.ac_rounds:
        return ac_bench(args)
    if args.small_gpt_rounds:
        return small_gpt_bench(args)
    if args.inductor:
        return inductor_bench(args)
    if args.compile:
        return compile_bench(args)
    if args.amp:
        return amp_bench(args)
    worlds = [int(w) for w in args.worlds.split(",")]
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    log_path = os.path.join(ROOT, "bench", "results", time.strftime("%Y%m%d-%H%M%S") + ".jsonl")
    with open(log_path, "w") as log:
        def emit(line):
            print(json.dumps(line), flush=True)
            log.write(json.dumps(line) + "\n")

        rows = []
        for line in comm_figures(worlds):
            emit(line)
        for model in args.models.split(","):
            steps = max(args.steps // 5, 12) if model == "gpt" else args.steps
            runs = {}
            for _ in range(args.repeat):
                for world in worlds:
                    runs.setdefault(("keel", world), []).append(run_keel(model, BATCH[model], steps, world, args.keel))
                    runs.setdefault(("pytorch", world), []).append(run_torch(model, BATCH[model], steps, world))
                    runs.setdefault(("pytorch-compile", world), []).append(
                        run_torch(model, BATCH[model], steps, world, compiled=True))
                    if world > 1:  # torch.compile(DDP(m)) too: PyTorch's documented order
                        runs.setdefault(("pytorch-compile-of-ddp", world), []).append(
                            run_torch(model, BATCH[model], steps, world, compiled=True, extra=["--compile-order", "ddp"]))
                if 1 in worlds and 2 in worlds:
                    runs.setdefault(("keel-off", 2), []).append(
                        run_keel(model, BATCH[model], steps, 2, args.keel, validate="off"))
            med = {k: median_run(v) for k, v in runs.items()}
            for line in med.values():
                emit(line)
            summary = {"model": model, "steps": steps, "repeats": args.repeat}
            compiled_best = {}
            for world in worlds:
                compiled_best[world] = min([k for k in med if k[1] == world and k[0].startswith("pytorch-compile")],
                                           key=lambda k: med[k]["median_step_ms"])
                summary[f"pytorch_compile_best_w{world}"] = compiled_best[world][0]
                summary[f"keel_over_pytorch_compile_best_step_time_w{world}"] = (
                    med[("keel", world)]["median_step_ms"] / med[compiled_best[world]]["median_step_ms"])
                summary[f"keel_over_pytorch_step_time_w{world}"] = (
                    med[("keel", world)]["median_step_ms"] / med[("pytorch", world)]["median_step_ms"])
                summary[f"keel_over_pytorch_compile_step_time_w{world}"] = (
                    med[("keel", world)]["median_step_ms"] / med[("pytorch-compile", world)]["median_step_ms"])
            if 1 in worlds and 2 in worlds:
                summary["scaling_efficiency_keel"] = med[("keel", 1)]["median_step_ms"] / med[("keel", 2)]["median_step_ms"]
                summary["scaling_efficiency_pytorch"] = (
                    med[("pytorch", 1)]["median_step_ms"] / med[("pytorch", 2)]["median_step_ms"])
                summary["validate_always_over_off"] = (
                    med[("keel", 2)]["median_step_ms"] / med[("keel-off", 2)]["median_step_ms"])
            emit(summary)
            rows += [(f"{model} {w} rank{'s' if w > 1 else ''}", med[("keel", w)]["median_step_ms"],
                      med[("pytorch", w)]["median_step_ms"], med[compiled_best[w]]["median_step_ms"])
                     for w in worlds]
    print(f"# results: {log_path}", file=sys.stderr)
    png = write_png(rows, log_path[:-len(".jsonl")] + ".png")
    if png:
        print(f"# plot: {png}", file=sys.stderr)


def write_png(rows, path):
    """Grouped bars of the median step time, keel next to PyTorch (log scale), via gnuplot."""
    if not rows or shutil.which("gnuplot") is None:
        return None
    dat = path[:-4] + ".dat"
    with open(dat, "w") as f:
        for label, k, t, c in rows:
            f.write(f'"{label}" {k} {t} {c}\n')
    script = f"""set terminal pngcairo size 900,500 noenhanced
set output '{path}'
set title 'median step time, keel vs PyTorch 2.11 DDP, eager and torch.compile (lower is better)'
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set logscale y
set ylabel 'ms per step (log scale)'
set grid ytics
set xtics rotate by -20
plot '{dat}' using 2:xtic(1) title 'keel', '' using 3 title 'PyTorch eager DDP', '' using 4 title 'PyTorch compiled DDP (the faster order)'
"""
    subprocess.run(["gnuplot"], input=script, text=True, check=True)
    return path


def validate_bench(args):
    """dist.validate = always vs off on mlp at 2 ranks: N pairs run back to back, the order
    alternating, so that drift in the machine's speed hits both sides alike. Reports each
    pair's ratio, their median, and how many pairs had `always` slower (a sign test)."""
    log_path = os.path.join(ROOT, "bench", "results", time.strftime("%Y%m%d-%H%M%S") + "-validate.jsonl")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    ratios = []
    with open(log_path, "w") as log:
        for i in range(args.validate_pairs):
            order = ("always", "off") if i % 2 == 0 else ("off", "always")
            got = {v: run_keel("mlp", BATCH["mlp"], args.steps, 2, args.keel, validate=v) for v in order}
            ratios.append(got["always"]["median_step_ms"] / got["off"]["median_step_ms"])
            line = {"pair": i, "always_ms": got["always"]["median_step_ms"], "off_ms": got["off"]["median_step_ms"],
                    "ratio": ratios[-1]}
            print(json.dumps(line), flush=True)
            log.write(json.dumps(line) + "\n")
        srt = sorted(ratios)
        summary = {"model": "mlp", "world": 2, "steps": args.steps, "pairs": len(ratios),
                   "median_always_over_off": srt[len(srt) // 2], "min": srt[0], "max": srt[-1],
                   "pairs_always_slower": sum(r > 1 for r in ratios)}
        print(json.dumps(summary), flush=True)
        log.write(json.dumps(summary) + "\n")
    print(f"# results: {log_path}", file=sys.stderr)


def observe_bench(args):
    """What watching a run costs: gpt at 2 ranks with run.tensorboard = false and no profiler,
    with TensorBoard (the default), and with TensorBoard and run.profile_steps over 3 steps in
    the middle. N rounds, the order rotating; reports each round's step-time ratios to `off`
    and their medians."""
    steps = args.steps
    mid = steps // 2
    configs = {"off": ["--run.tensorboard=false"], "tensorboard": ["--run.tensorboard=true"],
               "tensorboard+profile": ["--run.tensorboard=true", f"--run.profile_steps={mid}-{mid + 2}"]}
    names = list(configs)
    ratios = {n: [] for n in names if n != "off"}
    with results("-observe") as emit:
        for i in range(args.observe_rounds):
            order = names[i % 3:] + names[:i % 3]
            got = {n: run_keel("gpt", BATCH["gpt"], steps, 2, args.keel, extra=configs[n]) for n in order}
            line = {"round": i, **{f"{n}_ms": got[n]["median_step_ms"] for n in names}}
            for n in ratios:
                ratios[n].append(got[n]["median_step_ms"] / got["off"]["median_step_ms"])
                line[f"{n}_over_off"] = ratios[n][-1]
            emit(line)
        summary = {"model": "gpt", "world": 2, "steps": steps, "rounds": args.observe_rounds}
        for n, r in ratios.items():
            srt = sorted(r)
            summary[f"median_{n}_over_off"] = srt[len(srt) // 2]
            summary[f"{n}_range"] = [srt[0], srt[-1]]
        emit(summary)


def rounds_on_gpt(args, rounds, suffix, configs, finish, model="gpt", base="keel-zero0"):
    """N rounds of `configs` (name -> run(world)) on `model` at each of --worlds, the order rotating
    within each round. Emits each round's step times over `base`'s, then per world a summary
    (median step time and its ratio per configuration, peak RSS) that `finish(summary, got)`
    completes; got[name] = that configuration's runs."""
    names = list(configs)
    key = base.replace("-", "_")
    with results(suffix) as emit:
        for world in [int(w) for w in args.worlds.split(",")]:
            got = {n: [] for n in names}
            for i in range(rounds):
                order = names[i % len(names):] + names[:i % len(names)]
                this = {n: configs[n](world) for n in order}
                for n in names:
                    got[n].append(this[n])
                emit({"world": world, "round": i, "time": time.strftime("%H:%M:%S"),
                      **{f"{n}_ms": this[n]["median_step_ms"] for n in names},
                      **{f"{n}_over_{key}": this[n]["median_step_ms"] / this[base]["median_step_ms"] for n in names}})
            summary = {"model": model, "world": world, "rounds": rounds, "batch": BATCH[model]}
            for n in names:
                summary[f"{n}_median_step_ms"] = middle([r["median_step_ms"] for r in got[n]])
                summary[f"{n}_step_time_over_{key}"] = middle(
                    [got[n][k]["median_step_ms"] / got[base][k]["median_step_ms"] for k in range(rounds)])
                summary[f"{n}_peak_rss_mb"] = middle([r["peak_rss_mb"] for r in got[n]])
            finish(summary, got)
            emit(summary)


def flight_bench(args):
    """dist.flight_recorder = 0 and 2000 (the default) on gpt, with PyTorch DDP (eager, the same
    work) beside them: N rounds, the order rotating; each step time over the recorder-off run's."""
    steps = max(args.steps // 5, 12)
    b = BATCH["gpt"]
    configs = {"keel-flight-off": lambda w: run_keel("gpt", b, steps, w, args.keel, extra=["--dist.flight_recorder=0"]),
               "keel-flight-on": lambda w: run_keel("gpt", b, steps, w, args.keel,
                                                    extra=["--dist.flight_recorder=2000"]),
               "pytorch-ddp": lambda w: run_torch("gpt", b, steps, w)}

    def finish(summary, got):
        summary["steps"] = steps
        summary["flight_on_over_off"] = summary["keel-flight-on_step_time_over_keel_flight_off"]
        summary["keel_flight_on_over_pytorch_ddp"] = middle(
            [got["keel-flight-on"][k]["median_step_ms"] / got["pytorch-ddp"][k]["median_step_ms"]
             for k in range(len(got["pytorch-ddp"]))])

    rounds_on_gpt(args, args.flight_rounds, "-flight", configs, finish, base="keel-flight-off")


def ab_bench(args):
    """--ab NAME=OVERRIDES, given twice or more: N rounds (--ab-rounds) of keel with each set of
    overrides on the first of --models at each of --worlds, the order rotating; per round each
    step time over the first configuration's, and the medians. `--dist.validate=`,
    `--compile.mode=` and `--amp.dtype=` among the overrides replace bench's defaults."""
    model = args.models.split(",")[0]
    steps = max(args.steps // 5, 12) if model == "gpt" else args.steps
    kwargs_of = {"--dist.validate": "validate", "--compile.mode": "compile_mode", "--amp.dtype": "amp"}
    configs = {}
    for spec in args.ab:
        name, sep, overrides = spec.partition("=")
        if not sep or not name or name in configs:
            raise SystemExit(f"--ab {spec!r}: expected a new NAME=OVERRIDES (NAME unique)")
        kw, extra = {}, []
        for o in overrides.split():
            k, _, v = o.partition("=")
            if k in kwargs_of:
                kw[kwargs_of[k]] = v
            else:
                extra.append(o)
        configs[name] = lambda w, kw=kw, extra=extra: run_keel(model, BATCH[model], steps, w, args.keel,
                                                                 extra=extra, **kw)
    if len(configs) < 2:
        raise SystemExit("--ab: give two or more configurations")

    def finish(summary, got):
        summary["steps"] = steps
        summary["configs"] = args.ab

    rounds_on_gpt(args, args.ab_rounds, "-ab", configs, finish, model=model, base=next(iter(configs)))


def zero_bench(args):
    """dist.zero = 0 / 1 / 2 on gpt (per-rank batch 8, AdamW) at each world size, with PyTorch's
    DDP and ZeroRedundancyOptimizer (stage 1) as peers: N rounds, the order rotating within each
    round. Per round, each configuration's step time over keel zero=0's of the same round; per
    configuration, rank 0's optimizer state, gradient bytes, held bytes (parameters + gradients +
    optimizer state) and peak RSS. Reports the medians."""
    steps = max(args.steps // 5, 12)
    b = BATCH["gpt"]
    configs = {"keel-zero0": lambda w: run_keel("gpt", b, steps, w, args.keel, extra=["--dist.zero=0"]),
               "keel-zero1": lambda w: run_keel("gpt", b, steps, w, args.keel, extra=["--dist.zero=1"]),
               "keel-zero2": lambda w: run_keel("gpt", b, steps, w, args.keel, extra=["--dist.zero=2"]),
               "pytorch": lambda w: run_torch("gpt", b, steps, w),
               "pytorch-zero1": lambda w: run_torch("gpt", b, steps, w, zero=True)}

    def finish(summary, got):
        summary["steps"] = steps
        for n in got:
            summary[f"{n}_optimizer_state_bytes"] = got[n][0]["optimizer_state_bytes"]
        for n in ("keel-zero0", "keel-zero1", "keel-zero2"):
            summary[f"{n}_gradient_bytes"] = got[n][0]["gradient_bytes"]
            summary[f"{n}_held_bytes"] = held(got[n][0])
        for n in ("keel-zero1", "keel-zero2"):
            summary[f"{n}_state_over_zero0"] = (summary[f"{n}_optimizer_state_bytes"] /
                                                summary["keel-zero0_optimizer_state_bytes"])
            summary[f"{n}_held_over_zero0"] = summary[f"{n}_held_bytes"] / summary["keel-zero0_held_bytes"]
        summary["pytorch-zero1_state_over_ddp"] = (summary["pytorch-zero1_optimizer_state_bytes"] /
                                                   summary["pytorch_optimizer_state_bytes"])

    rounds_on_gpt(args, args.zero_rounds, "-zero", configs, finish)


def held(run):
    """Parameters + gradients + optimizer state a rank holds after the last step (bytes)."""
    return run["parameter_bytes"] + run["gradient_bytes"] + run["optimizer_state_bytes"]


def fsdp_bench(args):
    """dist.zero = 3 on gpt (per-rank batch 8, AdamW), eager and with each block compiled by
    AOTInductor (compile.mode = inductor: granularity "auto" is blocks at zero 3), beside keel's stage 0, PyTorch's DDP and
    PyTorch's FSDP2 (fully_shard per block, then the root), eager and with each block
    torch.compile'd first (torchtitan's way), N rounds with the order rotating. Per round each step
    time over keel zero=0's; per configuration rank 0's held bytes; keel zero 3 over the faster
    FSDP2 variant, named."""
    steps = max(args.steps // 5, 12)
    b = BATCH["gpt"]
    cache = args.inductor_cache or os.path.join(tempfile.gettempdir(), "keel-bench-inductor-cache")
    for w in [int(w) for w in args.worlds.split(",")]:  # the block package, once (compile.granularity "auto": blocks at zero 3)
        run_keel("gpt", b, 2, w, args.keel, compile_mode="inductor", cache_dir=cache, extra=["--dist.zero=3"])
    configs = {"keel-zero0": lambda w: run_keel("gpt", b, steps, w, args.keel, extra=["--dist.zero=0"]),
               "keel-zero3": lambda w: run_keel("gpt", b, steps, w, args.keel, extra=["--dist.zero=3"]),
               "keel-zero3-inductor": lambda w: run_keel("gpt", b, steps, w, args.keel, compile_mode="inductor",
                                                         cache_dir=cache, extra=["--dist.zero=3"]),
               "pytorch": lambda w: run_torch("gpt", b, steps, w),
               "pytorch-fsdp2": lambda w: run_torch("gpt", b, steps, w, fsdp=True),
               # torchtitan's way: each block torch.compile'd, then fully_shard
               "pytorch-fsdp2-compile": lambda w: run_torch("gpt", b, steps, w, compiled=True, fsdp=True)}

    def finish(summary, got):
        summary["steps"] = steps
        for n in got:
            summary[f"{n}_held_bytes"] = held(got[n][0])
            summary[f"{n}_held_over_keel_zero0"] = held(got[n][0]) / held(got["keel-zero0"][0])
        if summary["world"] > 1:  # (at one rank torch_ref runs no FSDP2: a single process)
            best = min(("pytorch-fsdp2", "pytorch-fsdp2-compile"), key=lambda n: summary[f"{n}_median_step_ms"])
            summary["pytorch_fsdp2_best"] = best
            for k in ("keel-zero3", "keel-zero3-inductor"):
                summary[f"{k}_step_time_over_pytorch_fsdp2_best"] = (summary[f"{k}_median_step_ms"] /
                                                                     summary[f"{best}_median_step_ms"])

    rounds_on_gpt(args, args.fsdp_rounds, "-fsdp", configs, finish)


def activation_mb(big, small, b_big, b_small):
    """Activation memory at batch b_big from peak RSS at two batches (what grows with the batch):
    (rss_big - rss_small) x b_big / (b_big - b_small)."""
    return (big["peak_rss_mb"] - small["peak_rss_mb"]) * b_big / (b_big - b_small)


def tp_bench(args):
    """Issue 45's item 9 on gpt at 2 ranks and a global batch of 16 (each dp rank 8; the tp ranks
    read the same 16), AdamW, one thread per rank: keel dp 2 (DDP), tp 2 and tp 2 with sequence
    parallelism beside PyTorch 2.11's DDP and DTensor tensor parallelism (parallelize_module with
    ColwiseParallel / RowwiseParallel, and SequenceParallel; bench/torch_ref.py --tp). N rounds,
    the order rotating; per configuration the median step time, its ratio to PyTorch's best tp
    step, rank 0's parameter bytes, peak RSS, and its step memory counted in a run of its own
    (`@count`): the peak bytes of live CPU tensors over those alive at the end (keel:
    run.count_tensor_memory, cpu_tensor_peak_mb - cpu_tensor_end_mb, the highest over the whole
    run, its first step and small evaluation included, on every thread; PyTorch: one warm step
    under torch.profiler's memory tracking, torch_ref.py --count-memory, the allocations of the
    threads the profiler follows). keel evaluates 4 samples only, as the peer none."""
    steps = max(args.steps // 5, 12)
    sp = ["--parallel.sequence_parallel=true"]
    small_eval = ["--data.eval_samples=4", "--data.eval_batch_size=4"]  # (PyTorch's peer does not evaluate)
    keel_runs = {"keel-dp2": (8, []), "keel-tp2": (16, ["--parallel.tp=2"]),
                 "keel-tp2-sp": (16, ["--parallel.tp=2"] + sp)}
    torch_runs = {"pytorch-ddp": (8, []), "pytorch-tp2": (16, ["--tp"]), "pytorch-tp2-sp": (16, ["--tp", "--sp"])}
    count_steps = 8
    configs = {}
    for name, (b, extra) in keel_runs.items():
        extra = extra + small_eval
        configs[name] = lambda w, b=b, extra=extra: run_keel("gpt", b, steps, w, args.keel, extra=extra)
        configs[name + "@count"] = lambda w, b=b, extra=extra: run_keel(
            "gpt", b, count_steps, w, args.keel, extra=extra + ["--run.count_tensor_memory=true"])
    for name, (b, extra) in torch_runs.items():
        configs[name] = lambda w, b=b, extra=extra: run_torch("gpt", b, steps, w, extra=extra)
        configs[name + "@count"] = lambda w, b=b, extra=extra: run_torch("gpt", b, count_steps, w,
                                                                         extra=list(extra) + ["--count-memory"])

    def step_memory(r):
        return r["tensor_step_peak_mb"] if "tensor_step_peak_mb" in r else r["cpu_tensor_peak_mb"] - r["cpu_tensor_end_mb"]

    def finish(summary, got):
        summary["steps"] = steps
        summary["global_batch"] = 16
        best_torch = min(summary["pytorch-tp2_median_step_ms"], summary["pytorch-tp2-sp_median_step_ms"])
        best = "pytorch-tp2" if best_torch == summary["pytorch-tp2_median_step_ms"] else "pytorch-tp2-sp"
        summary["pytorch_best_tp"] = best
        summary["step_memory_measure"] = ("counted: the peak bytes of live CPU tensors over those alive at a step's "
                                          "end (keel run.count_tensor_memory; PyTorch torch.profiler memory events)")
        for n in list(keel_runs) + list(torch_runs):
            summary[f"{n}_parameter_bytes"] = got[n][0]["parameter_bytes"]
            summary[f"{n}_step_memory_mb"] = middle([step_memory(r) for r in got[n + "@count"]])
            summary[f"{n}_step_time_over_pytorch_best_tp"] = summary[f"{n}_median_step_ms"] / best_torch
        for n, peer in (("keel-tp2", "pytorch-tp2"), ("keel-tp2-sp", "pytorch-tp2-sp"), ("keel-dp2", "pytorch-ddp")):
            summary[f"{n}_peak_rss_over_{best}"] = summary[f"{n}_peak_rss_mb"] / summary[f"{best}_peak_rss_mb"]
            if summary[f"{peer}_step_memory_mb"] > 0:  # (0: the profiler saw no CPU allocation)
                summary[f"{n}_step_memory_over_{peer}"] = (summary[f"{n}_step_memory_mb"] /
                                                           summary[f"{peer}_step_memory_mb"])
            summary[f"{n}_step_time_over_keel_dp2"] = summary[f"{n}_median_step_ms"] / summary["keel-dp2_median_step_ms"]

    args.worlds = "2"
    rounds_on_gpt(args, args.tp_rounds, "-tp", configs, finish, base="keel-dp2")


def pp_bench(args):
    """Issue 66's item 7 on gpt (width 256, 4 blocks, context 128) at pp 2, 8 micro-batches of 2
    samples per step (train.grad_accum), AdamW, one thread per rank: per schedule keel's step beside
    PyTorch 2.11's torch.distributed.pipelining with the same schedule class, split, micro-batches
    and optimizer (bench/pp_ref.py), N rounds, the order rotating. The bubble is measured against
    the one-rank step of the same work (each implementation's own: keel at 1 rank with 8
    micro-batches, PyTorch's torch_ref.py at a batch of 16): 1 - (one rank's step / pp) / the
    pipelined step, which also holds the messages and any imbalance; theory (p - 1) / (m + p - 1),
    divided by the stages per rank for the multi-stage schedules. Activation memory per stage:
    rank 0's counted step memory (run.count_tensor_memory) at gpipe and 1f1b."""
    steps = max(args.steps // 4, 20)
    pp, m, b = 2, 8, 2
    schedules = args.pp_schedules.split(",")
    model = ["--model.width=256", "--model.depth=4", "--model.heads=4", "--model.context=128", "--model.vocab=256",
             "--data.eval_samples=4", "--data.eval_batch_size=4", f"--train.grad_accum={m}"]
    per_rank = {"gpipe": 1, "1f1b": 1}
    configs = {"keel-1rank": lambda w: run_keel("gpt", b, steps, 1, args.keel, extra=model),
               "pytorch-1rank": lambda w: run_torch("gpt", b * m, steps, 1, extra=["--depth", "4"])}
    for sched in schedules:
        pp_keys = [f"--parallel.pp={pp}", f"--parallel.pp_schedule={sched}"]
        configs[f"keel-{sched}"] = lambda w, k=pp_keys: run_keel("gpt", b, steps, pp, args.keel, extra=model + k)
        if sched in ("zbv", "dualpipev"):  # PyTorch 2.11's V schedules send to their own rank at their first
            continue                        # step (_initialize_stages), which Gloo refuses: no peer on the CPU
        configs[f"pytorch-{sched}"] = lambda w, sc=sched: json.loads(launch(
            [PY, os.path.join(ROOT, "bench", "pp_ref.py"), "--schedule", sc, "--batch", str(b), "--microbatches",
             str(m), "--steps", str(steps)], pp).strip().splitlines()[-1])
    for sched in ("gpipe", "1f1b"):
        if sched in schedules:
            count = model + [f"--parallel.pp={pp}", f"--parallel.pp_schedule={sched}", "--run.count_tensor_memory=true"]
            configs[f"keel-{sched}@count"] = lambda w, c=count: run_keel("gpt", b, 8, pp, args.keel, extra=c)

    def finish(summary, got):
        summary.update({"pp": pp, "microbatches": m, "microbatch": b, "steps": steps})
        for impl in ("keel", "pytorch"):
            one = summary[f"{impl}-1rank_median_step_ms"]
            for sched in schedules:
                if f"{impl}-{sched}" not in got:
                    continue
                t = summary[f"{impl}-{sched}_median_step_ms"]
                v = per_rank.get(sched, 2)
                summary[f"{impl}-{sched}_bubble_measured"] = 1 - (one / pp) / t
                summary[f"{sched}_bubble_theory"] = (pp - 1) / (m + pp - 1) / v
        for sched in schedules:
            if f"pytorch-{sched}" not in got:
                summary[f"pytorch-{sched}"] = "no peer: PyTorch 2.11's V schedules fail over Gloo (a send to its own rank)"
                continue
            summary[f"keel-{sched}_step_time_over_pytorch"] = (summary[f"keel-{sched}_median_step_ms"] /
                                                               summary[f"pytorch-{sched}_median_step_ms"])
            if f"keel-{sched}@count" in got:
                summary[f"keel-{sched}_rank0_step_memory_mb"] = middle(
                    [r["cpu_tensor_peak_mb"] - r["cpu_tensor_end_mb"] for r in got[f"keel-{sched}@count"]])

    args.worlds = "2"
    rounds_on_gpt(args, args.pp_rounds, "-pp", configs, finish, base="keel-1rank")


def small_gpt_bench(args):
    """Where per-op overhead dominates (issue 46 item 3's last target): a small GPT (4 blocks,
    width 128, 4 heads, context 64, vocab 65, batch 12, AdamW, one rank, one thread), keel off and
    inductor beside PyTorch 2.11 eager and torch.compile, N rounds with the order rotating; the
    ratio of keel's best mode to PyTorch eager (target <= 0.8x) and to PyTorch's best."""
    steps = max(args.steps, 60)
    shape = ["--model.width=128", "--model.depth=4", "--model.heads=4", "--model.context=64", "--model.vocab=65",
             "--data.eval_samples=12", "--data.eval_batch_size=12"]
    ref = ["--width", "128", "--depth", "4", "--context", "64", "--vocab", "65"]
    cache = args.inductor_cache or os.path.join(tempfile.gettempdir(), "keel-bench-inductor-cache")
    run_keel("gpt", 12, 6, 1, args.keel, compile_mode="inductor", cache_dir=cache, extra=shape)  # the package, once
    configs = {"keel-off": lambda w: run_keel("gpt", 12, steps, 1, args.keel, extra=shape),
               "keel-inductor": lambda w: run_keel("gpt", 12, steps, 1, args.keel, compile_mode="inductor",
                                                   cache_dir=cache, extra=shape),
               "pytorch": lambda w: run_torch("gpt", 12, steps, 1, extra=ref),
               "pytorch-compile": lambda w: run_torch("gpt", 12, steps, 1, compiled=True, extra=ref)}

    def finish(summary, got):
        summary.update({"steps": steps, "batch": 12, "shape": "4 blocks, width 128, 4 heads, context 64, vocab 65"})
        t = {n: summary[f"{n}_median_step_ms"] for n in configs}
        keel_best = min(("keel-off", "keel-inductor"), key=lambda n: t[n])
        torch_best = min(("pytorch", "pytorch-compile"), key=lambda n: t[n])
        summary.update({"keel_best": keel_best, "pytorch_best": torch_best,
                        "keel_best_over_pytorch_eager": t[keel_best] / t["pytorch"],
                        "keel_best_over_pytorch_best": t[keel_best] / t[torch_best]})

    args.worlds = "1"
    rounds_on_gpt(args, args.small_gpt_rounds, "-small-gpt", configs, finish, base="keel-off")


def ac_bench(args):
    """Activation checkpointing (train.activation_checkpointing = "blocks" and "selective") at gpt
    context 512, one rank, batch 4, AdamW: keel without and with each, beside PyTorch without and
    with torch.utils.checkpoint on every block (non-reentrant: torchtitan's full AC, and selective
    AC saving the matmuls' outputs). N rounds, order
    rotating; per configuration the median step time and its activation memory, and the ratios
    with over without (issue 45's targets: activation memory <= 0.35x, step time <= 1.4x). keel's
    activation memory is counted exactly (run.count_tensor_memory: the peak bytes of live CPU
    tensors minus those alive at the end, when only the model, gradients, optimizer state and data
    are); PyTorch's is estimated from peak RSS (at batch 4 minus at batch 1, x 4/3), which the C
    library's retained and fragmented memory blurs: its ratios are rougher."""
    steps = max(args.steps // 12, 8)
    # (a small evaluation: PyTorch's peer does not evaluate, and a batch of data.eval_batch_size's
    # default would set the peak)
    ctx = ["--model.context=512", "--data.eval_samples=4", "--data.eval_batch_size=4", "--run.count_tensor_memory=true"]
    runs = {"keel": lambda b: run_keel("gpt", b, steps, 1, args.keel, extra=ctx),
            "keel-blocks": lambda b: run_keel("gpt", b, steps, 1, args.keel,
                                              extra=ctx + ["--train.activation_checkpointing=blocks"]),
            "keel-selective": lambda b: run_keel("gpt", b, steps, 1, args.keel,
                                                 extra=ctx + ["--train.activation_checkpointing=selective"]),
            "pytorch": lambda b: run_torch("gpt", b, steps, 1, extra=["--context", "512"]),
            "pytorch-ac": lambda b: run_torch("gpt", b, steps, 1, extra=["--context", "512", "--ac"]),
            "pytorch-sac": lambda b: run_torch("gpt", b, steps, 1, extra=["--context", "512", "--ac", "selective"])}
    configs = {}
    for name, run in runs.items():
        configs[name] = lambda w, run=run: run(4)
        if name.startswith("pytorch"):  # (keel's is counted at batch 4 alone)
            configs[name + "@1"] = lambda w, run=run: run(1)

    def finish(summary, got):
        summary.update({"steps": steps, "context": 512, "batch": 4})
        for n in runs:
            if n.startswith("pytorch"):
                summary[f"{n}_activation_mb"] = middle([activation_mb(got[n][k], got[n + "@1"][k], 4, 1)
                                                         for k in range(len(got[n]))])
                summary[f"{n}_activation_measure"] = "peak RSS at batch 4 minus at batch 1, x 4/3"
            else:
                summary[f"{n}_activation_mb"] = middle([r["cpu_tensor_peak_mb"] - r["cpu_tensor_end_mb"]
                                                         for r in got[n]])
                summary[f"{n}_cpu_tensor_end_mb"] = middle([r["cpu_tensor_end_mb"] for r in got[n]])
                summary[f"{n}_activation_measure"] = "counted: peak live CPU tensor bytes minus those at the end"
        for on, off in (("keel-blocks", "keel"), ("keel-selective", "keel"), ("pytorch-ac", "pytorch"),
                        ("pytorch-sac", "pytorch")):
            summary[f"{on}_activation_over_{off}"] = summary[f"{on}_activation_mb"] / summary[f"{off}_activation_mb"]
            summary[f"{on}_step_time_over_{off}"] = summary[f"{on}_median_step_ms"] / summary[f"{off}_median_step_ms"]

    args.worlds = "1"
    rounds_on_gpt(args, args.ac_rounds, "-ac", configs, finish, base="keel")


@contextlib.contextmanager
def results(suffix):
    """bench/results/<timestamp><suffix>.jsonl; yields emit(line), which prints one JSON line and logs it."""
    path = os.path.join(ROOT, "bench", "results", time.strftime("%Y%m%d-%H%M%S") + suffix + ".jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as log:
        def emit(line):
            print(json.dumps(line), flush=True)
            log.write(json.dumps(line) + "\n")

        yield emit
    print(f"# results: {path}", file=sys.stderr)


def baseline_bench(args):
    """--keel vs --baseline (two keel binaries, e.g. before and after a change) on the same work:
    per model and world, --repeat pairs run back to back with the order alternating, so that
    drift in the machine's speed hits both sides alike. Reports the median of the per-pair
    step-time ratios (new / baseline; 1.0 = unchanged) and how many pairs had the new one slower."""
    worlds = [int(w) for w in args.worlds.split(",")]
    with results("-baseline") as emit:
        for model in args.models.split(","):
            steps = max(args.steps // 5, 12) if model == "gpt" else args.steps
            for world in worlds:
                ratios, new_ms, base_ms = [], [], []
                for i in range(args.repeat):
                    order = (args.keel, args.baseline) if i % 2 == 0 else (args.baseline, args.keel)
                    got = {exe: run_keel(model, BATCH[model], steps, world, exe)["median_step_ms"] for exe in order}
                    new_ms.append(got[args.keel])
                    base_ms.append(got[args.baseline])
                    ratios.append(got[args.keel] / got[args.baseline])
                srt = sorted(ratios)
                emit({"model": model, "world": world, "steps": steps, "pairs": len(ratios),
                      "new": args.keel, "baseline": args.baseline, "new_ms": new_ms, "baseline_ms": base_ms,
                      "median_new_over_baseline": srt[len(srt) // 2], "min": srt[0], "max": srt[-1],
                      "pairs_new_slower": sum(r > 1 for r in ratios)})


def amp_bench(args):
    """amp.dtype = bf16 vs off (fp32) step time, one rank, one thread."""
    log_path = os.path.join(ROOT, "bench", "results", time.strftime("%Y%m%d-%H%M%S") + "-amp.jsonl")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "w") as log:
        for model in ("cnn", "gpt"):
            steps = max(args.steps // 5, 12) if model == "gpt" else args.steps
            runs = {}
            for _ in range(args.repeat):
                for amp in ("off", "bf16"):
                    runs.setdefault(amp, []).append(run_keel(model, BATCH[model], steps, 1, args.keel, amp=amp))
            med = {k: median_run(v) for k, v in runs.items()}
            lines = [med["off"], med["bf16"], {"model": model, "steps": steps, "repeats": args.repeat,
                                                "bf16_over_fp32_step_time": med["bf16"]["median_step_ms"] / med["off"]["median_step_ms"]}]
            for line in lines:
                print(json.dumps(line), flush=True)
                log.write(json.dumps(line) + "\n")
    print(f"# results: {log_path}", file=sys.stderr)


def compile_bench(args):
    """compile.mode = trace vs off (step time) at each world size, and cold vs warm compile."""
    worlds = [int(w) for w in args.worlds.split(",")]
    with results("-compile") as emit:
        for model in args.models.split(","):
            steps = max(args.steps // 5, 12) if model == "gpt" else args.steps
            runs = {}
            for _ in range(args.repeat):
                for world in worlds:
                    for mode in ("off", "trace"):
                        runs.setdefault((mode, world), []).append(
                            run_keel(model, BATCH[model], steps, world, args.keel, compile_mode=mode))
                with tempfile.TemporaryDirectory() as cache:
                    for phase in ("cold", "warm"):
                        runs.setdefault((phase, 1), []).append(
                            run_keel(model, BATCH[model], 6, 1, args.keel, compile_mode="trace", cache_dir=cache))
            summary = {"model": model, "steps": steps, "repeats": args.repeat}
            for world in worlds:
                off, tr = median_run(runs[("off", world)]), median_run(runs[("trace", world)])
                emit(off)
                emit(tr)
                summary[f"trace_over_off_step_time_w{world}"] = tr["median_step_ms"] / off["median_step_ms"]
            for phase in ("cold", "warm"):
                ms = sorted(r["compile_ms"] for r in runs[(phase, 1)])
                summary[f"compile_ms_{phase}"] = ms[len(ms) // 2]
                summary[f"compile_cache_{phase}"] = runs[(phase, 1)][0]["compile_cache"]
            emit(summary)


def inductor_bench(args):
    """keel compile.mode = inductor (and off) beside PyTorch 2.11 eager DDP and torch.compile'd DDP
    (default and max-autotune-no-cudagraphs, as DDP(torch.compile(m)); and under DDP also
    torch.compile(DDP(m)), PyTorch's documented order): same models, batches, AdamW, one thread
    per rank; each configuration --repeat times, interleaved; the median run of each is reported
    with the ratios keel inductor / torch.compile default, keel's best / PyTorch's best compiled
    variant and keel's best / PyTorch's best of all, each best named."""
    worlds = [int(w) for w in args.worlds.split(",")]
    cache = args.inductor_cache or os.path.join(tempfile.gettempdir(), "keel-bench-inductor-cache")
    systems = [("keel-off", lambda m, b, s, w: run_keel(m, b, s, w, args.keel)),
               ("keel-inductor", lambda m, b, s, w: run_keel(m, b, s, w, args.keel, compile_mode="inductor",
                                                             cache_dir=cache)),
               ("pytorch", lambda m, b, s, w: run_torch(m, b, s, w)),
               ("pytorch-compile", lambda m, b, s, w: run_torch(m, b, s, w, compiled=True)),
               ("pytorch-compile-max-autotune-no-cudagraphs",
                lambda m, b, s, w: run_torch(m, b, s, w, compiled=True, compile_mode="max-autotune-no-cudagraphs")),
               # torch.compile(DDP(m)), PyTorch's documented order (DDPOptimizer); at one rank the same
               # as pytorch-compile, so run only under DDP
               ("pytorch-compile-of-ddp",
                lambda m, b, s, w: run_torch(m, b, s, w, compiled=True, extra=["--compile-order", "ddp"]))]
    of_ddp = "pytorch-compile-of-ddp"
    if args.inductor_systems:
        wanted = args.inductor_systems.split(",")
        unknown = sorted(set(wanted) - {n for n, _ in systems})
        if unknown:
            raise SystemExit(f"--inductor-systems: unknown {', '.join(unknown)} (known: {', '.join(n for n, _ in systems)})")
        systems = [(n, f) for n, f in systems if n in wanted]
    with results("-inductor") as emit:
        for model in args.models.split(","):
            steps = max(args.steps // 3, 25) if model == "gpt" else args.steps
            # Warm keel's package cache first, so that no timed run compiles (PyTorch compiles in
            # its first step, which its median excludes).
            for world in worlds:
                run_keel(model, BATCH[model], 6, world, args.keel, compile_mode="inductor", cache_dir=cache)
            runs = {}
            for r in range(args.repeat):
                order = systems if r % 2 == 0 else list(reversed(systems))
                for world in worlds:
                    for name, fn in order:
                        if name != of_ddp or world > 1:
                            runs.setdefault((name, world), []).append(fn(model, BATCH[model], steps, world))
            for world in worlds:
                med = {name: median_run(runs[(name, world)]) for name, _ in systems if (name, world) in runs}
                for name in med:
                    med[name]["system"] = name
                    emit(med[name])
                t = {name: med[name]["median_step_ms"] for name in med}
                if "pytorch" not in t or "keel-off" not in t:  # a subset (--inductor-systems): its ratios
                    emit({"model": model, "world": world, "batch": BATCH[model], "steps": steps,
                          "repeats": args.repeat, "median_step_ms": t})
                    continue
                keel_best = min(t["keel-off"], t["keel-inductor"])
                compiled = [n for n in t if n.startswith("pytorch-compile")]
                torch_compiled_best = min(compiled, key=lambda n: t[n])
                torch_best = min([n for n in t if n.startswith("pytorch")], key=lambda n: t[n])
                emit({"model": model, "world": world, "batch": BATCH[model], "steps": steps, "repeats": args.repeat,
                      "median_step_ms": t,
                      "keel_best": min(("keel-off", "keel-inductor"), key=lambda n: t[n]),
                      "keel_inductor_over_torch_compile_default": t["keel-inductor"] / t["pytorch-compile"],
                      "keel_best_over_torch_compile_default": keel_best / t["pytorch-compile"],
                      "pytorch_compiled_best": torch_compiled_best,
                      "keel_best_over_torch_compile_best": keel_best / t[torch_compiled_best],
                      "pytorch_best": torch_best,
                      "keel_best_over_pytorch_best": keel_best / t[torch_best],
                      "keel_inductor_over_torch_eager": t["keel-inductor"] / t["pytorch"],
                      "keel_inductor_over_keel_off": t["keel-inductor"] / t["keel-off"]})


if __name__ == "__main__":
    main()
