#!/usr/bin/env python3
"""Reads a keel run's TensorBoard events with TensorBoard's own reader (the `tensorboard`
package from PyPI: event_accumulator.EventAccumulator) and checks every scalar against
metrics.jsonl, step by step.

  tensorboard_check.py RUN_DIR      exit 0 = every value matches, 1 = a mismatch (printed),
                                    77 = the tensorboard package is not installed
"""
import json
import math
import os
import sys

try:
    from tensorboard.backend.event_processing import event_accumulator
except ImportError as e:
    print(f"SKIPPED: the tensorboard package is not installed ({e}); scripts/setup.sh installs it into keel's venv")
    sys.exit(77)


def f32(x):
    """x rounded to float32, as an event's simple_value holds it."""
    import struct
    return struct.unpack("<f", struct.pack("<f", x))[0]


def main():
    run = sys.argv[1]
    acc = event_accumulator.EventAccumulator(os.path.join(run, "tb"), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    lines = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl")) if l.strip()]
    expect = {  # tag -> value of a metrics line, or None where the line has none
        "train/loss": lambda m: m["loss"],
        "train/lr": lambda m: m["lr"],
        "train/step_ms": lambda m: m["step_ms"],
        "train/samples_per_s": lambda m: m["samples_per_s"],
        "train/loss_scale": lambda m: m.get("loss_scale"),
        "train/grad_norm": lambda m: m.get("grad_norm"),
        "train/mfu": lambda m: m.get("mfu"),
        "train/tokens_per_s": lambda m: m.get("tokens_per_s"),
        "dist/rank_compute_spread_ms": lambda m: (max(m["rank_compute_ms"]) - min(m["rank_compute_ms"]))
        if len(m.get("rank_compute_ms", [])) > 1 else None,
        "eval/loss": lambda m: m.get("test_loss"),
        "eval/accuracy": lambda m: m.get("test_accuracy"),
    }
    problems, checked = [], 0
    for tag, get in expect.items():
        want = {m["step"]: get(m) for m in lines if get(m) is not None}
        if not want:
            if tag in tags:
                problems.append(f"{tag}: in the events but in no metrics line")
            continue
        if tag not in tags:
            problems.append(f"{tag}: missing from the events (tags: {sorted(tags)})")
            continue
        got = {}
        for e in acc.Scalars(tag):
            if e.step in got:
                problems.append(f"{tag}: step {e.step} twice")
            got[e.step] = e.value
        if sorted(got) != sorted(want):
            problems.append(f"{tag}: steps {sorted(got)} in the events, {sorted(want)} in metrics.jsonl")
            continue
        for step, v in want.items():
            w = f32(v)
            if not (got[step] == w or (math.isnan(w) and math.isnan(got[step]))):
                problems.append(f"{tag} at step {step}: {got[step]!r} in the events, {w!r} in metrics.jsonl")
            checked += 1
    skipped = acc.Scalars("train/skipped_steps") if "train/skipped_steps" in tags else []
    if len(skipped) != len(lines):
        problems.append(f"train/skipped_steps: {len(skipped)} values for {len(lines)} steps")
    for p in problems:
        print("MISMATCH:", p)
    print(f"{checked} values of {len(tags)} tags checked against {len(lines)} metrics lines; {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
