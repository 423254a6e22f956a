#!/usr/bin/env python3
"""A safetensors reader written from the format's specification (huggingface/safetensors
README), with numpy only: no safetensors package, no keel code. It checks what the spec
requires and prints what it read, for tests/test_checkpoint.cpp to compare.

  safetensors_reader.py file F.safetensors   -> {"tensors": {name: {"dtype", "shape", "values"|"sum"}}, "metadata": {...}}
  safetensors_reader.py index STEP_DIR       -> reads model.safetensors.index.json and every shard it names
"""
import json
import os
import struct
import sys

import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_, "BF16": None}


def read(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n <= 100 * 1024 * 1024 and 8 + n <= len(raw), "bad header length"
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = raw[8 + n:]
    meta = header.pop("__metadata__", {})
    spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items())
    at = 0
    for b, e, k in spans:  # contiguous, no holes, no overlap, covering the buffer
        assert b == at, f"{k}: hole or overlap at {at}"
        at = e
    assert at == len(data), "trailing bytes"
    out = {}
    for name, v in header.items():
        b, e = v["data_offsets"]
        buf = data[b:e]
        if v["dtype"] == "BF16":  # the upper half of a float32
            arr = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(buf, dtype=np.dtype(DTYPES[v["dtype"]]).newbyteorder("<"))
        arr = arr.reshape(v["shape"])
        assert arr.nbytes == e - b or v["dtype"] == "BF16"
        out[name] = (v["dtype"], list(v["shape"]), arr)
    return out, meta


def main():
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "file":
        tensors, meta = read(path)
        res = {n: {"dtype": d, "shape": s, "values": a.astype(np.float64).ravel().tolist()} for n, (d, s, a) in tensors.items()}
        print(json.dumps({"tensors": res, "metadata": meta}))
        return
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    total = 0
    res = {}
    cache = {}
    for name, fname in index["weight_map"].items():
        assert "/" not in fname
        if fname not in cache:
            cache[fname] = read(os.path.join(path, fname))[0]
        d, s, a = cache[fname][name]
        total += a.nbytes
        res[name] = {"dtype": d, "shape": s, "sum": float(a.astype(np.float64).sum()), "file": fname}
    assert total == index["metadata"]["total_size"], (total, index["metadata"]["total_size"])
    print(json.dumps({"tensors": res, "total_size": total}))


if __name__ == "__main__":
    main()
