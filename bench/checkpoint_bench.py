#!/usr/bin/env python3
"""Checkpoint save/load speed: keel vs the disk itself (dd) vs PyTorch (torch.save/torch.load),
on the same bytes, in one run; prints one JSON line per measurement and a ratio table.

  /usr/bin/python3 bench/checkpoint_bench.py [--mb 384] [--repeat 3] [--dir DIR]

- dd: sequential write of the same size with conv=fdatasync (the disk's own durable write
  speed), and a read of that file (from the page cache, as the loads below also are).
- keel (build/keel_checkpoint_bench): a synchronous save (write + SHA-256 + fsync + commit),
  a load (read + SHA-256 + parse + copy), and an async save's blocking time (the snapshot the
  training loop waits for) against the synchronous save; at 1 and 2 ranks (2 ranks: each
  writes half).
- PyTorch: torch.save of a state dict with the same tensors followed by fsync, and torch.load.
Caches are not dropped (that needs root on the host): reads are page-cache reads for all three.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import ROOT, launch  # noqa: E402


def dd(path, mb, repeat):
    w, r = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={max(1, mb // 16)}", "conv=fdatasync"],
                       check=True, capture_output=True)
        w.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
        r.append(time.perf_counter() - t0)
    os.remove(path)
    size = max(1, mb // 16) * 16 * (1 << 20)
    return {"bench": "dd", "bytes": size, "write_MBps": size / 1e6 / statistics.median(w),
            "read_MBps": size / 1e6 / statistics.median(r)}


def torch_ref(path, mb, repeat):
    import torch
    n_tensors = 24
    per = max(1, mb * (1 << 20) // 3 // n_tensors // 4)
    torch.manual_seed(0)
    sd = {}
    for i in range(n_tensors):
        sd[f"layer.{i}.weight"] = torch.randn(per)
        sd[f"layer.{i}.weight.exp_avg"] = torch.randn(per)
        sd[f"layer.{i}.weight.exp_avg_sq"] = torch.rand(per)
    size = 3 * n_tensors * per * 4
    s, l = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.load(path)
        l.append(time.perf_counter() - t0)
    os.remove(path)
    return {"bench": "torch", "bytes": size, "save_ms": 1e3 * statistics.median(s), "load_ms": 1e3 * statistics.median(l),
            "save_MBps": size / 1e6 / statistics.median(s), "load_MBps": size / 1e6 / statistics.median(l)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=384)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(ROOT, "bench", "results", "ckpt_bench_tmp"))
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    results = [dd(os.path.join(a.dir, "dd.bin"), a.mb, a.repeat)]
    print(json.dumps(results[-1]), flush=True)
    for world in (1, 2):
        d = os.path.join(a.dir, f"keel_w{world}")
        shutil.rmtree(d, ignore_errors=True)
        out = launch([os.path.join(a.build, "keel_checkpoint_bench"), "--dir", d, "--mb", str(a.mb),
                      "--repeat", str(a.repeat)], world)
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
        shutil.rmtree(d, ignore_errors=True)
    results.append(torch_ref(os.path.join(a.dir, "torch.pt"), a.mb, a.repeat))
    print(json.dumps(results[-1]), flush=True)
    ddr, k1, k2, t = results
    print(f"\n{a.mb} MB of state, median of {a.repeat}:")
    print(f"  disk (dd, fdatasync)      write {ddr['write_MBps']:7.0f} MB/s   read {ddr['read_MBps']:7.0f} MB/s (cached)")
    print(f"  torch.save/load           save  {t['save_MBps']:7.0f} MB/s   load {t['load_MBps']:7.0f} MB/s")
    for k in (k1, k2):
        print(f"  keel, {k['world_size']} rank(s)            save  {k['sync_save_MBps']:7.0f} MB/s   load {k['load_MBps']:7.0f} MB/s"
              f"   async stall {k['async_blocking_ms']:.0f} ms = {100 * k['async_stall_vs_sync']:.1f}% of a sync save")
    print(f"  ratios (1 rank): keel save / dd write = {k1['sync_save_MBps'] / ddr['write_MBps']:.2f}, "
          f"keel save vs torch.save = {t['save_ms'] / k1['sync_save_ms']:.2f}x, "
          f"keel load vs torch.load = {t['load_ms'] / k1['load_ms']:.2f}x")


if __name__ == "__main__":
    main()
