"""trainer/compile/aot_common.py: what the packaging step's modules share (aot_package.py runs
them): its exit codes, the one-line refusal, the log, and where a failure comes from (the
innermost frame of the user's code in a traceback)."""
from __future__ import annotations

import contextlib
import hashlib
import linecache
import os
import sys


EXIT_ERROR, EXIT_USAGE, EXIT_GRAPH_BREAK, EXIT_NONDETERMINISTIC, EXIT_CHECK, EXIT_NO_FAKE_KERNEL = 1, 2, 3, 4, 5, 6


def log(msg: str) -> None:
    print(f"aot_package: {msg}", file=sys.stderr, flush=True)


class Refusal(Exception):
    """A reason to stop with a given exit code and a one-line message."""

    def __init__(self, code: int, line: str):
        super().__init__(line)
        self.code = code
        self.line = line


def _is_torch_file(path: str) -> bool:
    import torch

    torch_dir = os.path.dirname(os.path.realpath(torch.__file__))
    real = os.path.realpath(path)
    return real.startswith(torch_dir + os.sep) or real.startswith(os.path.dirname(contextlib.__file__) + os.sep)


# The packaging step's own files (keel's compile cache keys a package by all of them).
PACKAGING_FILES = ("aot_package.py", "aot_common.py", "keel_graph.py", "python_front.py", "aot_checks.py")


def _is_this_file(path: str) -> bool:
    """Whether `path` is one of the packaging step's own files (not the user's code)."""
    real = os.path.realpath(path)
    return (os.path.dirname(real) == os.path.dirname(os.path.realpath(__file__))
            and os.path.basename(real) in PACKAGING_FILES)


def user_frame(tb):
    """(index, frame, lineno) of the innermost frame of the user's (or keel's) code in a traceback."""
    entries = []
    while tb is not None:
        entries.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    best = None
    for i, (fr, line) in enumerate(entries):
        path = fr.f_code.co_filename
        if _is_torch_file(path) or path.startswith("<"):
            continue
        if _is_this_file(path) and best is not None and not _is_this_file(best[1].f_code.co_filename):
            continue  # prefer model code over this script's wrappers
        best = (i, fr, line)
    return best, entries


def _is_library_file(path: str) -> bool:
    parts = os.path.realpath(path).split(os.sep)
    return "site-packages" in parts or "dist-packages" in parts


def source_text(file: str, line: int) -> str:
    return linecache.getline(file, line).strip() if line else ""


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
