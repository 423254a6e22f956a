#!/usr/bin/env python3
"""Seeds for the safetensors header fuzzer: valid files and one of each kind of bad header.
Run once to (re)create tests/fuzz/corpus/seed-*; scripts/fuzz.sh adds what libFuzzer finds."""
import json, os, struct, sys

out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "corpus")
os.makedirs(out, exist_ok=True)

def st(header, data=b"", pad=True):
    h = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * ((8 - (8 + len(h)) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + data

seeds = {
    "valid-one": st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
    "valid-many": st({"__metadata__": {"format": "pt"},
                      "w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
                      "s": {"dtype": "I64", "shape": [], "data_offsets": [12, 20]},
                      "e": {"dtype": "F32", "shape": [0, 4], "data_offsets": [20, 20]},
                      "m": {"dtype": "BOOL", "shape": [3], "data_offsets": [20, 23]}}, b"\1" * 23),
    "valid-empty": st({}),
    "valid-unpadded": st({"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"\7", pad=False),
    "short": b"\x05\0\0",
    "huge-length": struct.pack("<Q", 200 << 20) + b"{}",
    "past-eof": struct.pack("<Q", 64) + b"{}",
    "not-object": st([1, 2]),
    "bad-json": struct.pack("<Q", 5) + b'{"a":',
    "bad-utf8": struct.pack("<Q", 8) + b'{"\xff\xfe":1}',
    "unknown-dtype": st({"a": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
    "negative-dim": st({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
    "reversed": st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8),
    "out-of-range": st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}, b"\0" * 8),
    "size-mismatch": st({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
    "overflow": st({"a": {"dtype": "F64", "shape": [2**62, 8], "data_offsets": [0, 8]}}, b"\0" * 8),
    "overlap": st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
    "hole": st({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
    "trailing": st({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8),
    "meta-not-string": st({"__metadata__": {"k": 1}}),
}
for name, data in seeds.items():
    with open(os.path.join(out, "seed-" + name), "wb") as f:
        f.write(data)
print(f"{len(seeds)} seeds in {out}")
