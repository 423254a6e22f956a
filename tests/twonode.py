#!/usr/bin/env python3
"""Two hosts over a real network boundary, on one machine (issue 13, item 5).

Each test makes two hosts of its own: two network namespaces joined by a veth pair (interface
`keel0` on both sides, 10.77.0.1 = host A, 10.77.0.2 = host B; the addresses exist only inside
the namespaces, which the test creates and deletes), starts one rank per host inside its
namespace, and checks what a multi-node user relies on:

  torchrun     torchrun --nnodes=2 (c10d rendezvous at host A's address): the final model is
               bit-identical to a one-host 2-rank run of the same config
  mpirun       mpirun across the two hosts (an rsh agent that runs the command with
               `ip netns exec`): the same result
  interface    dist.interface = "keel0" is used (and named in the log); a wrong dist.interface
               or GLOO_SOCKET_IFNAME fails at once on both hosts, exit 2, naming it
  partition    the link goes down after a committed step: every rank exits non-zero within
               dist.timeout_s + 30 s naming the unreachable rank; the last committed step
               verifies; a rerun with the link back resumes from it and ends bit-identical to
               a clean run
  node_loss    host B's rank is SIGKILLed halfway through writing a checkpoint and host B
               leaves the network: host A exits non-zero within the timeout; the restarted job
               resumes from the last committed step and ends bit-identical to a clean run
  flight       host B's rank stops taking part in collectives (collective_hang) in a step's
               backward; each rank's flight record copied into a folder of its host's own under
               one folder, `keel doctor --json` names rank 1, the gradient bucket rank 0 waited
               in, and the phase
  elastic      torchrun --nnodes=1:2: host B is lost for good; the job goes on with host A
               alone (world 2 -> 1) from the last committed step, and its result equals a run
               resumed at world 1 from that checkpoint by hand

  twonode.py SCENARIO     (env: KEEL_BINARY, KEEL_TORCHRUN, KEEL_SOURCE_DIR; run as root)

Exit 0 = passed, 1 = failed, 77 = skipped (no root, or namespaces cannot be made here), with
the reason printed. Detection times are printed as `measured: ...` lines (docs/faults.md).
"""
import glob
import re
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SKIP = 77
KEEL = os.environ.get("KEEL_BINARY", "")
TORCHRUN = os.environ.get("KEEL_TORCHRUN", "")
SRC = os.environ.get("KEEL_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEV = "keel0"
ADDR = ["10.77.0.1", "10.77.0.2"]
TIMEOUT_S = 15  # dist.timeout_s of the runs that wait on a lost peer


class Skip(Exception):
    pass


def sh(*argv, check=True):
    r = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: {r.stdout.strip()}")
    return r


def clean_env():
    """The caller's environment less anything a launcher sets: each rank gets only what its
    launcher (or the test, for a launch by hand) gives it."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME",
            "NCCL_SOCKET_IFNAME")
    return {k: v for k, v in os.environ.items()
            if k not in drop and not k.startswith(("TORCHELASTIC_", "OMPI_", "PMIX_", "SLURM_"))}


class Hosts:
    """Two namespaces joined by a veth pair; removed (with every process in them) on exit."""

    def __init__(self, tag, work):
        self.ns = [f"keel-{tag}-{os.getpid()}-{h}" for h in "ab"]
        self.work = work
        self.procs = []

    def __enter__(self):
        if os.geteuid() != 0:
            raise Skip("network namespaces need root (this is uid %d)" % os.geteuid())
        if not shutil.which("ip"):
            raise Skip("iproute2's `ip` is not installed")
        self._reap_stale()
        try:
            for n in self.ns:
                sh("ip", "netns", "add", n)
        except RuntimeError as e:
            self.__exit__()
            raise Skip(f"cannot make network namespaces here: {e}")
        try:
            sh("ip", "link", "add", DEV, "netns", self.ns[0], "type", "veth", "peer", "name", DEV, "netns", self.ns[1])
            for n, a in zip(self.ns, ADDR):
                sh("ip", "-n", n, "addr", "add", a + "/24", "dev", DEV)
                sh("ip", "-n", n, "link", "set", "lo", "up")
                sh("ip", "-n", n, "link", "set", DEV, "up")
        except RuntimeError:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for n in self.ns:
            self.kill_all(n)
            sh("ip", "netns", "del", n, check=False)

    @staticmethod
    def _reap_stale():
        # Namespaces of an earlier run of this harness whose process is gone (killed by a timeout).
        for n in sh("ip", "netns", "list", check=False).stdout.split():
            parts = n.split("-")
            if len(parts) == 4 and parts[0] == "keel" and parts[2].isdigit() and not os.path.exists(f"/proc/{parts[2]}"):
                Hosts.kill_all(n)
                sh("ip", "netns", "del", n, check=False)

    @staticmethod
    def kill_all(ns):
        for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def start(self, host, argv, log, env=None):
        f = open(os.path.join(self.work, log), "w")
        p = subprocess.Popen(["ip", "netns", "exec", self.ns[host], *argv], stdout=f, stderr=subprocess.STDOUT,
                             env=env if env is not None else clean_env(), start_new_session=True, cwd=self.work)
        p.log = os.path.join(self.work, log)
        self.procs.append(p)
        return p

    def link(self, up):
        for n in self.ns:
            sh("ip", "-n", n, "link", "set", DEV, "up" if up else "down")

    def lose(self, host):
        """The host is gone: its processes die at once and it leaves the network."""
        self.kill_all(self.ns[host])
        sh("ip", "-n", self.ns[host], "link", "set", DEV, "down")


def train_args(ckpt, run, steps=60, timeout_s=TIMEOUT_S, extra=()):
    return ["train", "--config", os.path.join(SRC, "configs/synthetic_smoke.toml"), f"--train.steps={steps}",
            "--train.eval_interval=0", "--run.threads=1", f"--dist.timeout_s={timeout_s}", "--checkpoint.interval=10",
            "--checkpoint.keep=100", f"--checkpoint.dir={ckpt}", f"--run.dir={run}", *extra]


def by_hand_env(rank, world=2, port=29500, extra=None):
    env = clean_env()
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR=ADDR[0],
               MASTER_PORT=str(port))
    env.update(extra or {})
    return env


def wait_all(procs, timeout):
    t_end = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, t_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{' '.join(p.args[4:7])} still running after {timeout} s; log {p.log}:\n" + tail(p.log))
    return [p.returncode for p in procs]


def stacks(procs):
    """Where still-running ranks are stuck (gdb), for a failure message."""
    out = ""
    for p in procs:
        if p.poll() is not None or not shutil.which("gdb"):
            continue
        for pid in subprocess.run(["pgrep", "-s", str(p.pid)], stdout=subprocess.PIPE, text=True).stdout.split():
            bt = subprocess.run(["gdb", "-p", pid, "-batch", "-ex", "thread apply all bt 15"], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, timeout=120).stdout
            out += f"--- stacks of pid {pid} ({p.log}):\n" + "\n".join(l for l in bt.splitlines() if l.startswith(("#", "Thread")))[-8000:]
    return out


def tail(path, n=40):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def wait_for(cond, timeout, what, procs=()):
    t_end = time.monotonic() + timeout
    while not cond():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: a process ended first (exit {p.returncode}); log {p.log}:\n" + tail(p.log))
        if time.monotonic() > t_end:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.01)


def names_rank(log_text, rank):
    """Whether the rank's error line (`keel: error: ...`) names `rank`."""
    errors = [l for l in log_text.splitlines() if l.startswith("keel: error:")]
    return any(re.search(rf"\brank(\(s\))? {rank}\b", l) for l in errors)


def committed(ckpt, step):
    return os.path.exists(os.path.join(ckpt, f"step_{step}", "meta.json"))


def last_committed(ckpt):
    steps = [int(os.path.basename(os.path.dirname(m))[5:]) for m in glob.glob(os.path.join(ckpt, "step_*", "meta.json"))]
    return max(steps) if steps else -1


def state_files(step_dir):
    """The model and optimizer shards of a step: what must be bit-identical between runs."""
    return sorted(os.path.basename(f) for f in glob.glob(os.path.join(step_dir, "*.safetensors"))
                  if os.path.basename(f).startswith(("model-", "optimizer-")))


def assert_same_state(a_dir, b_dir, what):
    fa, fb = state_files(a_dir), state_files(b_dir)
    assert fa and fa == fb, f"{what}: different shard files: {fa} vs {fb}"
    for f in fa:
        with open(os.path.join(a_dir, f), "rb") as x, open(os.path.join(b_dir, f), "rb") as y:
            assert x.read() == y.read(), f"{what}: {f} differs between {a_dir} and {b_dir}"
    print(f"ok: {what}: {len(fa)} model/optimizer shards bit-identical")


def summary(run_dir):
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def reference(work, steps=60, world=2):
    """The same config on one host: `world` ranks under torchrun --standalone (one process
    without a launcher for world 1)."""
    ckpt, run = os.path.join(work, f"ref{world}-ckpt"), os.path.join(work, f"ref{world}-run")
    argv = [KEEL, *train_args(ckpt, run, steps)]
    if world > 1:
        argv = [TORCHRUN, "--standalone", f"--nproc_per_node={world}", "--no_python", *argv]
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env(), timeout=300)
    assert r.returncode == 0, f"reference run failed: exit {r.returncode}\n{r.stdout[-4000:]}"
    return os.path.join(ckpt, f"step_{steps}")


def verify_step(step_dir):
    r = subprocess.run([KEEL, "inspect", "--json", os.path.dirname(step_dir)], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    assert r.returncode == 0, f"keel inspect failed: {r.stdout}"
    steps = {s["step"]: s for s in json.loads(r.stdout)["steps"]}
    s = steps.get(int(os.path.basename(step_dir)[5:]))
    assert s and s.get("committed") and s.get("verified"), f"{step_dir} does not verify: {s}"
    print(f"ok: {step_dir} is committed and its checksums verify (keel inspect)")


def torchrun_node(host, nnodes, rdzv_id, extra=(), rdzv_conf=""):
    # The rendezvous host is told, not guessed: torchrun matches the endpoint against the
    # machine's hostname, which in a namespace (or a container) is not this address.
    conf = f"is_host={1 if host == 0 else 0}" + ("," + rdzv_conf if rdzv_conf else "")
    return [TORCHRUN, f"--nnodes={nnodes}", "--nproc_per_node=1", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={ADDR[0]}:29400", f"--rdzv_id={rdzv_id}", f"--local_addr={ADDR[host]}",
            f"--rdzv_conf={conf}", *extra, "--no_python", KEEL]


# ---------------------------------------------------------------------------------------------

def scenario_torchrun(h, work):
    ckpt, run = os.path.join(work, "ckpt"), os.path.join(work, "run")
    procs = [h.start(i, torchrun_node(i, 2, "two-node-a") + train_args(ckpt, run), f"host{i}.log") for i in (0, 1)]
    codes = wait_all(procs, 240)
    assert codes == [0, 0], f"exit codes {codes}:\n" + tail(procs[0].log) + tail(procs[1].log)
    s = summary(run)
    assert s["world_size"] == 2 and s["launcher"] == "torchrun", s
    assert "interface by route" in open(procs[0].log).read(), "the log does not say how the interface was chosen"
    assert_same_state(reference(work), os.path.join(ckpt, "step_60"), "torchrun --nnodes=2 vs one host")


def scenario_mpirun(h, work):
    ckpt, run = os.path.join(work, "ckpt"), os.path.join(work, "run")
    agent = os.path.join(work, "netns-rsh")
    calls = os.path.join(work, "rsh-calls")
    with open(agent, "w") as f:
        f.write("#!/bin/sh\n# mpirun's rsh agent: `agent HOST COMMAND...` runs COMMAND on that test host\n"
                f"echo \"$1\" >> {calls}\n"
                f"case \"$1\" in {ADDR[0]}) ns={h.ns[0]};; {ADDR[1]}) ns={h.ns[1]};; "
                "*) echo \"netns-rsh: unknown host $1\" >&2; exit 255;; esac\n"
                "shift\nexec ip netns exec \"$ns\" sh -c \"$*\"\n")
    os.chmod(agent, 0o755)
    env = clean_env()
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    argv = ["mpirun", "-np", "2", "--host", f"{ADDR[0]}:1,{ADDR[1]}:1", "--mca", "plm_rsh_agent", agent,
            "--mca", "oob_tcp_if_include", DEV, "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", DEV,
            "-x", f"GLOO_SOCKET_IFNAME={DEV}", KEEL, *train_args(ckpt, run)]
    p = h.start(0, argv, "mpirun.log", env=env)
    codes = wait_all([p], 240)
    assert codes == [0], f"mpirun exit {codes}:\n" + tail(p.log)
    assert open(calls).read().split() == [ADDR[1]], "mpirun did not start host B's rank through the agent"
    s = summary(run)
    assert s["world_size"] == 2 and s["launcher"] == "mpirun", s
    assert f"interface {DEV} (GLOO_SOCKET_IFNAME)" in open(p.log).read(), "the log does not name the interface"
    assert_same_state(reference(work), os.path.join(ckpt, "step_60"), "mpirun across two hosts vs one host")


def scenario_interface(h, work):
    # dist.interface, from the command line (it may differ between hosts), is what Gloo uses.
    ckpt, run = os.path.join(work, "ckpt"), os.path.join(work, "run")
    args = train_args(ckpt, run, steps=20, extra=[f"--dist.interface={DEV}"])
    procs = [h.start(i, [KEEL, *args], f"ok{i}.log", env=by_hand_env(i)) for i in (0, 1)]
    assert wait_all(procs, 120) == [0, 0], tail(procs[0].log) + tail(procs[1].log)
    assert f"interface {DEV} (dist.interface)" in open(procs[0].log).read(), tail(procs[0].log)
    print(f"ok: dist.interface = \"{DEV}\" used on both hosts")
    # A wrong name fails at once on every host, before any rendezvous, naming it.
    for how, extra_args, extra_env in (("dist.interface", ["--dist.interface=eth9"], {}),
                                       ("GLOO_SOCKET_IFNAME", [], {"GLOO_SOCKET_IFNAME": "eth9"})):
        args = train_args(os.path.join(work, "bad"), os.path.join(work, "badrun"), steps=20, timeout_s=60,
                          extra=extra_args)
        t0 = time.monotonic()
        procs = [h.start(i, [KEEL, *args], f"bad-{how}{i}.log", env=by_hand_env(i, extra=extra_env)) for i in (0, 1)]
        codes = wait_all(procs, 60)
        took = time.monotonic() - t0
        assert codes == [2, 2], f"{how} = eth9: exit codes {codes} (want 2, bad input)"
        for p in procs:
            text = open(p.log).read()
            assert f'{how} = "eth9"' in text and "no such network interface" in text and DEV in text, text
        assert took < 30, f"{how} = eth9: took {took:.1f} s (should fail before the rendezvous)"
        print(f"ok: {how} = \"eth9\": both hosts exit 2 in {took:.1f} s naming it and the interfaces they have")


def scenario_partition(h, work):
    ckpt, run = os.path.join(work, "ckpt"), os.path.join(work, "run")
    # Rank 1 sleeps 50 ms a step (a straggler fault: timing only, not results), so that the link
    # goes down between two checkpoints, not across one.
    slow = ["--fault.inject=straggler@step=1,rank=1,ms=50"]
    procs = [h.start(i, [KEEL, *train_args(ckpt, run, extra=slow)], f"cut{i}.log", env=by_hand_env(i)) for i in (0, 1)]
    wait_for(lambda: committed(ckpt, 20), 120, "step 20 committed", procs)
    h.link(up=False)
    t_cut = time.monotonic()
    ends = [None, None]
    while any(e is None for e in ends):
        for i, p in enumerate(procs):
            if ends[i] is None and p.poll() is not None:
                ends[i] = time.monotonic() - t_cut
        if time.monotonic() - t_cut > TIMEOUT_S + 60:
            raise AssertionError(f"a rank still runs 60 s past dist.timeout_s (ended: {ends})\n" + stacks(procs) +
                                 tail(procs[0].log) + tail(procs[1].log))
        time.sleep(0.05)
    codes = [p.returncode for p in procs]
    print(f"measured: partition: rank 0 exited {codes[0]} after {ends[0]:.1f} s, rank 1 exited {codes[1]} after "
          f"{ends[1]:.1f} s (dist.timeout_s = {TIMEOUT_S})")
    for i, p in enumerate(procs):
        text = open(p.log).read()
        assert codes[i] not in (0, 2), f"rank {i} exited {codes[i]} (want non-zero, not the bad-input 2)\n" + tail(p.log)
        assert ends[i] <= TIMEOUT_S + 30, f"rank {i} took {ends[i]:.1f} s (bound: dist.timeout_s + 30)"
        assert names_rank(text, 1 - i), f"rank {i} does not name rank {1 - i} in its error:\n" + tail(p.log)
    last = last_committed(ckpt)
    assert last >= 20, f"last committed step {last}"
    verify_step(os.path.join(ckpt, f"step_{last}"))
    h.link(up=True)
    procs = [h.start(i, [KEEL, *train_args(ckpt, run)], f"rerun{i}.log", env=by_hand_env(i)) for i in (0, 1)]
    assert wait_all(procs, 240) == [0, 0], tail(procs[0].log) + tail(procs[1].log)
    assert summary(run)["resumed_from_step"] == last, summary(run)
    print(f"ok: the rerun resumed from step {last}")
    assert_same_state(reference(work), os.path.join(ckpt, "step_60"), "after a partition and a rerun vs a clean run")


def scenario_node_loss(h, work):
    ckpt, run = os.path.join(work, "ckpt"), os.path.join(work, "run")
    # Rank 1 is SIGKILLed halfway through writing its shard of step 40; its host then leaves
    # the network, as a machine that dies does.
    fault = ["--fault.inject=checkpoint_write_failure@step=40,rank=1,crash"]
    procs = [h.start(i, [KEEL, *train_args(ckpt, run, extra=fault)], f"loss{i}.log", env=by_hand_env(i)) for i in (0, 1)]
    t0 = None
    while procs[1].poll() is None:
        assert procs[0].poll() is None or procs[1].poll() is not None, "host A ended before host B was lost"
        time.sleep(0.01)
    t0 = time.monotonic()
    h.lose(1)
    try:
        procs[0].wait(timeout=TIMEOUT_S + 30)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"host A still runs {TIMEOUT_S + 30} s after host B was lost:\n" + tail(procs[0].log))
    took = time.monotonic() - t0
    code = procs[0].returncode
    print(f"measured: node loss mid-save: host A's rank exited {code} after {took:.1f} s (dist.timeout_s = {TIMEOUT_S})")
    assert procs[1].returncode == -signal.SIGKILL, f"rank 1 ended with {procs[1].returncode}, not SIGKILL"
    assert code not in (0, 2), f"host A exited {code}:\n" + tail(procs[0].log)
    assert names_rank(open(procs[0].log).read(), 1), "host A does not name rank 1 in its error:\n" + tail(procs[0].log)
    assert not committed(ckpt, 40), "step 40 was committed although rank 1 died writing it"
    last = last_committed(ckpt)
    assert last == 30, f"last committed step {last}, want 30"
    sh("ip", "-n", h.ns[1], "link", "set", DEV, "up")  # a replacement machine with host B's address
    procs = [h.start(i, [KEEL, *train_args(ckpt, run)], f"restart{i}.log", env=by_hand_env(i)) for i in (0, 1)]
    assert wait_all(procs, 240) == [0, 0], tail(procs[0].log) + tail(procs[1].log)
    assert summary(run)["resumed_from_step"] == 30, summary(run)
    print("ok: the restarted job resumed from step 30")
    assert_same_state(reference(work), os.path.join(ckpt, "step_60"), "after a node loss and a restart vs a clean run")


def scenario_flight(h, work):
    ckpt, run = os.path.join(work, "ckpt"), os.path.join(work, "run")
    hang = ["--fault.inject=collective_hang@step=5,rank=1,at=backward"]
    procs = [h.start(i, [KEEL, *train_args(ckpt, run, steps=20, extra=hang)], f"flight{i}.log", env=by_hand_env(i))
             for i in (0, 1)]
    codes = wait_all(procs, TIMEOUT_S * 3 + 60)
    assert codes[0] == 1 and codes[1] == 1, f"exit codes {codes}\n" + tail(procs[0].log) + tail(procs[1].log)
    # The two hosts share this machine's disk: each rank's record is copied into a folder of its
    # host's own, as a person copies them off two machines.
    gathered = os.path.join(work, "gathered")
    for i in (0, 1):
        os.makedirs(os.path.join(gathered, f"host{i}"))
        shutil.copy(os.path.join(run, "flight", f"rank{i}.json"), os.path.join(gathered, f"host{i}"))
    r = sh(KEEL, "doctor", gathered, "--json")
    diag = json.loads(r.stdout[r.stdout.index("{"):])
    assert diag["records"] == [0, 1], diag
    assert diag["cause"]["kind"] == "hang" and diag["cause"]["ranks"] == [1], json.dumps(diag, indent=1)
    waiting = [row for row in diag["divergence"]["ranks"] if row["rank"] == 0][0]
    assert "DDP gradient bucket" in waiting["op"] and waiting["where"].startswith("backward"), waiting
    print("ok: keel doctor on both hosts' records names rank 1; rank 0 waited in " + waiting["op"] + " (" +
          waiting["where"] + ")")


def scenario_elastic(h, work):
    ckpt, run = os.path.join(work, "ckpt"), os.path.join(work, "run")
    # Rank 0 is the straggler here: the only rank left at world 1 (a fault naming rank 1 is an
    # error in a world of one).
    slow = ["--fault.inject=straggler@step=1,rank=0,ms=50"]
    node = lambda i: torchrun_node(i, "1:2", "two-node-f", ["--max_restarts=3"], rdzv_conf="last_call_timeout=2") + \
        train_args(ckpt, run, extra=slow)
    procs = [h.start(i, node(i), f"host{i}.log") for i in (0, 1)]
    wait_for(lambda: committed(ckpt, 20), 180, "step 20 committed at world 2", procs)
    t0 = time.monotonic()
    h.lose(1)
    codes = wait_all(procs[:1], 300)
    print(f"measured: elastic shrink: host A finished alone {time.monotonic() - t0:.1f} s after host B was lost")
    assert codes == [0], f"host A exit {codes}:\n" + tail(procs[0].log, 80)
    s = summary(run)
    k = s.get("resumed_from_step", -1)
    assert s["world_size"] == 1 and s["restart_count"] >= 1 and k >= 20, f"unexpected summary: {s}"
    print(f"ok: world 2 -> 1: host A resumed alone from step {k} after {s['restart_count']} restart(s)")
    # By hand: the same step, resumed at world 1 into a directory of its own.
    hand_ckpt, hand_run = os.path.join(work, "hand-ckpt"), os.path.join(work, "hand-run")
    r = subprocess.run([KEEL, *train_args(hand_ckpt, hand_run, extra=[f"--checkpoint.resume_from={ckpt}/step_{k}"])],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env(), timeout=300)
    assert r.returncode == 0, r.stdout[-4000:]
    assert summary(hand_run)["resumed_from_step"] == k
    assert_same_state(os.path.join(hand_ckpt, "step_60"), os.path.join(ckpt, "step_60"),
                      "elastic shrink vs resumed at world 1 by hand")


def run_case(name, body):
    """Runs body(work) in a fresh directory: exit 0 (passed; the directory removed), 1 (failed;
    kept, with its logs) or 77 (skipped), each with a line saying so."""
    work = tempfile.mkdtemp(prefix=f"keel-{name}-")
    t0 = time.monotonic()
    try:
        body(work)
    except Skip as e:
        print(f"SKIPPED: {e}")
        return SKIP
    except AssertionError as e:
        print(f"FAILED ({name}, {time.monotonic() - t0:.0f} s; logs kept in {work}): {e}")
        return 1
    print(f"PASSED ({name}, {time.monotonic() - t0:.0f} s)")
    shutil.rmtree(work, ignore_errors=True)
    return 0


SCENARIOS = {"torchrun": scenario_torchrun, "mpirun": scenario_mpirun, "interface": scenario_interface,
             "partition": scenario_partition, "node_loss": scenario_node_loss, "elastic": scenario_elastic,
             "flight": scenario_flight}


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in SCENARIOS:
        print(__doc__)
        return 2
    name = sys.argv[1]
    for what, v in (("KEEL_BINARY", KEEL), ("KEEL_TORCHRUN", TORCHRUN)):
        if not v or not os.access(v, os.X_OK):
            print(f"twonode: {what} is not set to an executable ({v!r})")
            return 1
    def body(work):
        with Hosts(name.replace("_", ""), work) as h:
            SCENARIOS[name](h, work)
    return run_case(f"twonode-{name}", body)

if __name__ == "__main__":
    sys.exit(main())
