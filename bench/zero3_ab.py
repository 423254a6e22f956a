# Rounds of keel gpt at 2 ranks: dist.zero = 0, 3 (dist.validate = always) and 3 (first_step), the order rotating;
# each round prints the step times and their ratios to zero=0 (bench.py --ab-rounds, whose results file this writes).
# Usage: $PY bench/zero3_ab.py build/keel ROUNDS
import os, subprocess, sys

here = os.path.dirname(os.path.abspath(__file__))
sys.exit(subprocess.call([sys.executable, os.path.join(here, "bench.py"), "--keel", sys.argv[1], "--ab-rounds",
                          sys.argv[2], "--models", "gpt", "--worlds", "2", "--ab", "z0=--dist.zero=0",
                          "--ab", "z3=--dist.zero=3", "--ab", "z3first=--dist.zero=3 --dist.validate=first_step"]))
