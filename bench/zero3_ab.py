# Rounds of keel gpt at 2 ranks: dist.zero = 0, 3 (dist.validate = always) and 3 (first_step), the order rotating;
# each round prints the median step times and their ratios to zero=0. Usage: $PY bench/zero3_ab.py build/keel ROUNDS
import sys, json, time; import os; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench
keel = sys.argv[1]; n = int(sys.argv[2])
cfgs = {"z0": dict(extra=["--dist.zero=0"]), "z3": dict(extra=["--dist.zero=3"]),
        "z3first": dict(extra=["--dist.zero=3"], validate="first_step")}
names = list(cfgs)
for i in range(n):
    order = names[i % 3:] + names[:i % 3]
    row = {k: bench.run_keel("gpt", 8, 20, 2, keel, **cfgs[k])["median_step_ms"] for k in order}
    row.update({k + "/z0": round(row[k] / row["z0"], 3) for k in cfgs})
    row["time"] = time.strftime("%H:%M:%S")
    print(json.dumps(row), flush=True)
