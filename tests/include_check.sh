#!/usr/bin/env bash
# The checkout reads without a build (issue 26): every quoted include of keel's own C++ files
# resolves against the tracked tree alone, as an editor, code search or a structure tool sees it:
#   "keel/<component>/<name>.h"  a public header, include/keel/... (what is installed)
#   "<component>/<name>.h"       a private header, from the repository root
#   "<name>.h"                   beside the including file (tests' helpers)
# A generated protobuf header ("x.pb.h") resolves when its x.proto is tracked. A public header
# includes only public ones, and there are at most 16 of them (the installed API).
#   tests/include_check.sh SOURCE_DIR
set -euo pipefail
cd "$1"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1 && [ "$(git rev-parse --show-toplevel)" = "$(pwd -P)" ]; then
  # Tracked files and new ones not ignored: the checkout, never the build's outputs.
  list=$(git ls-files --cached --others --exclude-standard | while read -r f; do [ -e "$f" ] && echo "$f"; done)
else
  list=$(find . -path ./build -prune -o -type f -print | sed 's|^\./||')
fi
printf '%s\n' "$list" | python3 -c '
import os, re, sys
files = set(l for l in sys.stdin.read().split("\n") if l)
protos = {os.path.basename(f)[:-len(".proto")] for f in files if f.endswith(".proto")}
inc = re.compile(r"^\s*#\s*include\s*([\"<])([^\">]+)[\">]")
bad, count = [], 0
public = sorted(f for f in files if f.startswith("include/keel/") and f.endswith(".h"))
for f in sorted(files):
    if not f.endswith((".h", ".cpp", ".cu", ".hpp")): continue
    for n, line in enumerate(open(f, errors="replace"), 1):
        m = inc.match(line)
        if not m: continue
        kind, name = m.groups()
        close = ">" if kind == "<" else kind
        if kind == "<" and not name.startswith("keel/"): continue  # system and dependency headers
        count += 1
        here = os.path.normpath(os.path.join(os.path.dirname(f), name))
        cands = [os.path.join("include", name)] if name.startswith("keel/") else [here, name]
        if name.endswith(".pb.h") and name[:-len(".pb.h")] in protos: continue
        if not any(c in files for c in cands):
            bad.append(f"{f}:{n}: #include {kind}{name}{close}: no such file in the checkout (looked at {cands})")
        elif f.startswith("include/keel/") and not name.startswith("keel/"):
            bad.append(f"{f}:{n}: public header includes the private {name}")
for b in bad: print("FAIL", b)
if len(public) > 16:
    print(f"FAIL {len(public)} public headers under include/keel (at most 16):", *public); bad.append("count")
if bad: sys.exit(1)
print(f"ok: {count} includes of keel headers resolve in the checkout; {len(public)} public headers")
'
