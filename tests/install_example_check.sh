#!/usr/bin/env bash
# Installs keel from BUILD_DIR into a temporary prefix, checks the installed headers (each
# compiles alone against the prefix: the allowlist is closed under #include; nothing is
# reachable without the keel/ prefix), builds examples/custom_model against that prefix alone
# (find_package(keel)), and trains it on 2 ranks.
#   tests/install_example_check.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src="$1"; build="$2"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
# The documented command (docs/getting-started.md): the prefix alone. The installed package
# finds the LibTorch keel was built with itself (no Torch_DIR, none in the environment).
unset Torch_DIR
cmake -S "$src/examples/custom_model" -B "$work/ex" "${gen[@]}" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_EXPORT_COMPILE_COMMANDS=ON > "$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
torch_dir=$(sed -n 's/^Torch_DIR:[A-Z]*=//p' "$build/CMakeCache.txt")
found=$(sed -n 's/^Torch_DIR:[A-Z]*=//p' "$work/ex/CMakeCache.txt")
[ "$(readlink -f "$found")" = "$(readlink -f "$torch_dir")" ] || {
  echo "the example found LibTorch at $found, keel was built with $torch_dir"; exit 1; }
cmake --build "$work/ex" > "$work/build.log" 2>&1 || { tail -50 "$work/build.log"; exit 1; }

# The installed headers, each alone, with the example's own compile flags (the prefix and
# LibTorch, nothing from keel's source tree).
flags=$(python3 - "$work/ex/compile_commands.json" <<'PY'
import json, shlex, sys
e = json.load(open(sys.argv[1]))[0]
args = shlex.split(e["command"])[1:]
out, skip = [], False
for a in args:
    if skip: skip = False; continue
    if a in ("-o", "-c", "-MF", "-MT", "-MQ"): skip = True; continue
    if a in ("-MD", "-MMD") or a == e["file"] or a.endswith("ccache") or a.endswith("++"): continue
    out.append(a)
print(shlex.join(out))
PY
)
headers=$(cd "$work/prefix/include" && find keel -name '*.h' | sort)
[ -n "$headers" ] || { echo "FAIL: no headers installed"; exit 1; }
for h in $headers; do
  echo "#include <$h>" | eval g++ $flags -fsyntax-only -x c++ - > "$work/header.log" 2>&1 ||
    { echo "FAIL: installed header $h does not compile alone:"; head -20 "$work/header.log"; exit 1; }
done
n=$(echo "$headers" | wc -l)
echo "ok: $n installed headers compile alone"
[ "$n" -le 16 ] || { echo "FAIL: $n installed headers (the public API is at most 16)"; exit 1; }
# keel's private dependencies stay inside libkeel.so: the package finds none of them and the
# example's compile and link lines name none.
if grep -E 'find_dependency\((spdlog|CLI11|Protobuf|MPI|OpenSSL|ZLIB)|(spdlog|CLI11|protobuf|MPI|OpenSSL|ZLIB)::' \
     "$work"/prefix/lib*/cmake/keel/*.cmake; then
  echo "FAIL: the installed package names a private dependency of keel (files above)"; exit 1
fi
if cat "$work/ex/compile_commands.json" "$work"/ex/CMakeFiles/custom_model.dir/link.txt "$work/ex/build.ninja" 2>/dev/null |
   grep -Eo 'spdlog|CLI11|protobuf|libmpi|openmpi|tomlplusplus|libssl|libcrypto' | sort -u | grep .; then
  echo "FAIL: the example's build names a private dependency of keel"; exit 1
fi
readelf -d "$work/ex/custom_model" | grep -q 'NEEDED.*libkeel\.so' || { echo "FAIL: the example does not link libkeel.so"; exit 1; }
echo "ok: the package and the example's build name no private dependency; the example links libkeel.so"
[ ! -e "$work/prefix/include/keel/trainer/trainer.cpp" ] || { echo "FAIL: sources installed"; exit 1; }
if echo "#include <trainer/trainer.h>" | eval g++ $flags -fsyntax-only -x c++ - > /dev/null 2>&1; then
  echo "FAIL: <trainer/trainer.h> (no keel/ prefix) resolves against the installed prefix"; exit 1
fi
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cd "$work"
pids=()
for r in 0 1; do
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OMP_NUM_THREADS=1 \
    timeout 120 "$work/ex/custom_model" > "$work/rank$r.log" 2>&1 & pids+=($!)
done
status=0
for r in 0 1; do wait "${pids[$r]}" || { echo "rank $r failed:"; cat "$work/rank$r.log"; status=1; }; done
grep -h "world 2" "$work/rank0.log" || { echo "rank 0 did not report world 2"; status=1; }
exit $status
