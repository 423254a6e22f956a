#!/usr/bin/env python3
"""Compares keel runs of two binaries bit for bit (scripts/compare_behaviour.sh calls it).

  compare_runs.py DIR_A DIR_B                       # two run directories
  compare_runs.py --roots ROOT_A ROOT_B RUN [RUN ...]   # ROOT_A/RUN against ROOT_B/RUN, each RUN

A run directory holds summary.json and metrics.jsonl (directly or in a subdirectory such as
run/) and a checkpoint directory with committed step_N directories (ckpt/, or any subdirectory
holding step_N/meta.json). What is compared, every value exactly (floats to the last bit):

- summary.json: the losses (final_loss, test_loss, test_accuracy, loss_scale) and the outcome
  (steps, completed, skipped_steps, resumed_from_step, checkpoint_step, parameter counts and
  bytes, ...); never timings, throughput, dates, paths, host names, versions.
- metrics.jsonl: every step's loss, lr, grad_norm, loss_scale, test_loss, test_accuracy, ...
- the newest committed checkpoint step: the same files; in every safetensors file of every
  component and rank (model, optimizer, rank state) the same tensors in the same order, each
  with the same dtype, shape and raw bytes, and the same header metadata; meta.json except its
  creation date, versions and config hash.

A run directory holding a file FAILED (written by compare_behaviour.sh when a run exits
nonzero) is reported as failed with that file's text. One line per run:
  same  NAME  (N losses, M tensors)
  DIFF  NAME: the first difference, with names and values
  FAIL  NAME: which side failed, and the tail of its log
then a tally. Exit status 0 when every run is the same, 1 otherwise, 2 on bad usage.
Only Python's standard library is used.
"""

import argparse
import json
import math
import os
import re
import struct
import sys

# summary.json: loss-like values (counted as losses) and the deterministic outcome of a run.
SUMMARY_LOSSES = ["final_loss", "test_loss", "test_accuracy", "loss_scale"]
SUMMARY_OUTCOME = [
    "run_name", "model", "data", "device", "world_size", "launcher", "backend", "restart_count",
    "metrics_lines_lost", "threads_per_rank", "batch_size", "grad_accum", "global_batch", "steps",
    "planned_steps", "completed", "stop_signal", "compile_mode", "recompiles", "amp_dtype",
    "consensus", "skipped_steps", "resumed_from_step", "checkpoint_step", "zero",
    "num_parameters", "parameter_bytes", "gradient_bytes", "optimizer_state_bytes",
]
# metrics.jsonl: per step; the first three kinds are losses, the rest compared but not counted.
METRIC_LOSSES = ["loss", "test_loss", "test_accuracy"]
METRIC_OTHER = ["step", "epoch", "lr", "grad_norm", "loss_scale", "skipped"]
# meta.json keys left out: they change with the date, the build or the config's text.
META_IGNORED = {"created_utc", "keel_version", "torch_version", "config_sha256"}

# safetensors dtype -> (struct format of one element, bytes per element).
DTYPES = {
    "F64": ("d", 8), "F32": ("f", 4), "F16": ("e", 2), "BF16": ("H", 2),
    "I64": ("q", 8), "I32": ("i", 4), "I16": ("h", 2), "I8": ("b", 1),
    "U64": ("Q", 8), "U32": ("I", 4), "U16": ("H", 2), "U8": ("B", 1), "BOOL": ("?", 1),
}


class Difference(Exception):
    """The first difference found between the two runs."""


def same_value(a, b):
    """Exact equality of two JSON values; NaN equals NaN, 1 does not equal 1.0 or True."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


def first_json_difference(a, b, path=""):
    """The path and both values of the first place where two JSON values differ, or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            where = f"{path}.{k}" if path else k
            if k not in a or k not in b:
                return where, a.get(k, "<absent>"), b.get(k, "<absent>")
            d = first_json_difference(a[k], b[k], where)
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_json_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if same_value(a, b) else (path, a, b)


def short(value, limit=120):
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def find_file(run_dir, name):
    """run_dir/name, or run_dir/<subdirectory>/name (the first in sorted order), or None."""
    if os.path.isfile(os.path.join(run_dir, name)):
        return os.path.join(run_dir, name)
    for sub in sorted(os.listdir(run_dir)):
        p = os.path.join(run_dir, sub, name)
        if os.path.isfile(p):
            return p
    return None


def committed_steps(run_dir):
    """{N: path} of the committed step_N directories (with meta.json) under run_dir, depth <= 2."""
    found = {}
    for parent in [run_dir] + [os.path.join(run_dir, s) for s in sorted(os.listdir(run_dir))]:
        if not os.path.isdir(parent):
            continue
        for s in os.listdir(parent):
            m = re.fullmatch(r"step_(\d+)", s)
            if m and os.path.isfile(os.path.join(parent, s, "meta.json")):
                found[int(m.group(1))] = os.path.join(parent, s)
    return found


def compare_summaries(a_dir, b_dir, labels):
    """Compares summary.json; returns how many loss values were compared."""
    pa, pb = find_file(a_dir, "summary.json"), find_file(b_dir, "summary.json")
    if not pa or not pb:
        if pa or pb:
            missing = labels[0] if not pa else labels[1]
            raise Difference(f"summary.json: absent on {missing}")
        return 0
    with open(pa) as fa, open(pb) as fb:
        a, b = json.load(fa), json.load(fb)
    losses = 0
    for key in SUMMARY_LOSSES + SUMMARY_OUTCOME:
        va, vb = a.get(key, "<absent>"), b.get(key, "<absent>")
        if not same_value(va, vb):
            raise Difference(f"summary.json {key}: {labels[0]} {short(va)}, {labels[1]} {short(vb)}")
        if key in SUMMARY_LOSSES and isinstance(va, float):
            losses += 1
    return losses


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def compare_metrics(a_dir, b_dir, labels):
    """Compares metrics.jsonl line by line; returns how many loss values were compared."""
    pa, pb = find_file(a_dir, "metrics.jsonl"), find_file(b_dir, "metrics.jsonl")
    if not pa or not pb:
        if pa or pb:
            raise Difference(f"metrics.jsonl: absent on {labels[0] if not pa else labels[1]}")
        return 0
    a, b = read_metrics(pa), read_metrics(pb)
    losses = 0
    for i, (ra, rb) in enumerate(zip(a, b)):
        step = ra.get("step", i + 1)
        for key in METRIC_LOSSES + METRIC_OTHER:
            va, vb = ra.get(key, "<absent>"), rb.get(key, "<absent>")
            if not same_value(va, vb):
                raise Difference(
                    f"metrics.jsonl line {i + 1} (step {step}) {key}: "
                    f"{labels[0]} {short(va)}, {labels[1]} {short(vb)}")
            if key in METRIC_LOSSES and isinstance(va, float):
                losses += 1
    if len(a) != len(b):
        raise Difference(f"metrics.jsonl: {labels[0]} has {len(a)} lines, {labels[1]} {len(b)}")
    return losses


def read_safetensors(path):
    """(metadata, [(name, dtype, shape, raw bytes)] in file order) of a safetensors file."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise Difference(f"{path}: not a safetensors file ({len(blob)} bytes)")
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    data = blob[8 + n:]
    meta = header.pop("__metadata__", {})
    entries = sorted(header.items(), key=lambda kv: (kv[1]["data_offsets"][0], kv[0]))
    tensors = [(name, h["dtype"], list(h["shape"]), data[h["data_offsets"][0]:h["data_offsets"][1]])
               for name, h in entries]
    return meta, tensors


def element(raw, dtype, index):
    """The index-th element of a tensor's raw bytes as a Python number (bf16 widened exactly)."""
    fmt, size = DTYPES[dtype]
    (v,) = struct.unpack("<" + fmt, raw[index * size:(index + 1) * size])
    if dtype == "BF16":
        (v,) = struct.unpack("<f", struct.pack("<I", v << 16))
    return v


def describe_tensor_difference(where, dtype, shape, ra, rb, labels):
    """Names the first differing element of two equally shaped tensors, with both values."""
    if dtype not in DTYPES:
        first = next(i for i, (x, y) in enumerate(zip(ra, rb)) if x != y)
        return f"{where} ({dtype} {shape}): byte {first} differs"
    size = DTYPES[dtype][1]
    chunks = range(0, len(ra), size)
    differing = [i // size for i in chunks if ra[i:i + size] != rb[i:i + size]]
    first = differing[0]
    index = []
    rest = first
    for dim in reversed(shape):
        index.insert(0, rest % dim if dim else 0)
        rest = rest // dim if dim else 0
    va, vb = element(ra, dtype, first), element(rb, dtype, first)
    return (f"{where} ({dtype} {shape}) element {tuple(index)}: {labels[0]} {va!r}, "
            f"{labels[1]} {vb!r} ({len(differing)} of {len(ra) // size} elements differ)")


def compare_safetensors_file(pa, pb, name, labels):
    """Compares two safetensors files tensor by tensor; returns how many tensors it compared."""
    meta_a, ta = read_safetensors(pa)
    meta_b, tb = read_safetensors(pb)
    names_a, names_b = [t[0] for t in ta], [t[0] for t in tb]
    if names_a != names_b:
        only_a = sorted(set(names_a) - set(names_b))
        only_b = sorted(set(names_b) - set(names_a))
        raise Difference(f"{name}: other tensors: only on {labels[0]} {short(only_a)}, only on "
                         f"{labels[1]} {short(only_b)}" + ("" if only_a or only_b else " (other order)"))
    for (tname, da, sa, ra), (_, db, sb, rb) in zip(ta, tb):
        where = f"{name}: {tname}"
        if da != db or sa != sb:
            raise Difference(f"{where}: {labels[0]} {da} {sa}, {labels[1]} {db} {sb}")
        if ra != rb:
            raise Difference(describe_tensor_difference(where, da, sa, ra, rb, labels))
    d = first_json_difference(meta_a, meta_b)
    if d:
        raise Difference(f"{name}: header metadata {d[0]}: {labels[0]} {short(d[1])}, {labels[1]} {short(d[2])}")
    return len(ta)


def compare_checkpoints(a_dir, b_dir, labels):
    """Compares the newest committed step of each side; returns how many tensors it compared."""
    sa, sb = committed_steps(a_dir), committed_steps(b_dir)
    if sorted(sa) != sorted(sb):
        raise Difference(f"committed steps: {labels[0]} {sorted(sa)}, {labels[1]} {sorted(sb)}")
    if not sa:
        return 0
    step = max(sa)
    da, db = sa[step], sb[step]
    files_a, files_b = sorted(os.listdir(da)), sorted(os.listdir(db))
    if files_a != files_b:
        raise Difference(f"step_{step} files: {labels[0]} {short(files_a, 300)}, {labels[1]} {short(files_b, 300)}")
    tensors = 0
    for f in files_a:
        if f.endswith(".safetensors"):
            tensors += compare_safetensors_file(os.path.join(da, f), os.path.join(db, f), f"step_{step}/{f}", labels)
    with open(os.path.join(da, "meta.json")) as fa, open(os.path.join(db, "meta.json")) as fb:
        ma, mb = json.load(fa), json.load(fb)
    for m in (ma, mb):
        for k in META_IGNORED:
            m.pop(k, None)
    d = first_json_difference(ma, mb)
    if d:
        raise Difference(f"step_{step}/meta.json {d[0]}: {labels[0]} {short(d[1])}, {labels[1]} {short(d[2])}")
    return tensors


def failure(run_dir, label):
    """The text of run_dir/FAILED, prefixed with the side, or None."""
    p = os.path.join(run_dir, "FAILED")
    if not os.path.isfile(p):
        return None
    with open(p, errors="replace") as f:
        return f"on {label}: " + f.read().rstrip()


def compare_run(name, a_dir, b_dir, labels):
    """Prints one line for one run; returns 'same', 'DIFF' or 'FAIL'."""
    for d, label in ((a_dir, labels[0]), (b_dir, labels[1])):
        if not os.path.isdir(d):
            print(f"FAIL  {name}: no run directory on {label} ({d})")
            return "FAIL"
    failed = [f for f in (failure(a_dir, labels[0]), failure(b_dir, labels[1])) if f]
    if failed:
        text = "\n".join(failed).replace("\n", "\n      ")
        print(f"FAIL  {name}: {text}")
        return "FAIL"
    try:
        # metrics.jsonl first: its first differing step says where two runs part.
        losses = compare_metrics(a_dir, b_dir, labels) + compare_summaries(a_dir, b_dir, labels)
        tensors = compare_checkpoints(a_dir, b_dir, labels)
    except Difference as e:
        print(f"DIFF  {name}: {e}")
        return "DIFF"
    if losses == 0 and tensors == 0:
        print(f"DIFF  {name}: nothing to compare (no summary.json, metrics.jsonl or checkpoint)")
        return "DIFF"
    print(f"same  {name}  ({losses} losses, {tensors} tensors)")
    return "same"


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--roots", action="store_true", help="A and B are roots holding the runs named after them")
    p.add_argument("--labels", default="base,head", help="names of the two sides in messages (default base,head)")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("runs", nargs="*", help="with --roots: the runs to compare (default: every subdirectory of A)")
    args = p.parse_args(argv)
    labels = args.labels.split(",")
    if len(labels) != 2:
        p.error("--labels takes two names separated by a comma")
    if args.roots:
        runs = args.runs or sorted(d for d in os.listdir(args.a) if os.path.isdir(os.path.join(args.a, d)))
        pairs = [(r, os.path.join(args.a, r), os.path.join(args.b, r)) for r in runs]
    else:
        if args.runs:
            p.error("run names need --roots")
        pairs = [(os.path.basename(os.path.normpath(args.b)), args.a, args.b)]
    verdicts = [compare_run(name, a, b, labels) for name, a, b in pairs]
    n_same, n_diff, n_fail = (verdicts.count(v) for v in ("same", "DIFF", "FAIL"))
    print(f"{len(verdicts)} runs: {n_same} same, {n_diff} differ, {n_fail} failed")
    return 0 if n_same == len(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
