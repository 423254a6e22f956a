#!/usr/bin/env python3
"""srun under a real Slurm (issue 13, item 7).

Starts a one-node Slurm of its own (Debian's slurm-wlm: slurmctld and slurmd, with a munged
for authentication), everything private to a temporary directory (config, key, sockets,
state, free ports; nothing under /etc is read or written), launches keel with
`srun --ntasks=2`, checks that both tasks ran as ranks of one job under the srun launcher, and
that the final model is bit-identical to the same config under torchrun on this host. Then
tears the daemons down.

  slurm_srun.py     (env: KEEL_BINARY, KEEL_TORCHRUN, KEEL_SOURCE_DIR; run as root)

Exit 0 = passed, 1 = failed, 77 = skipped (not root, Slurm or munge not installed, or the
daemons cannot start here), with the reason printed.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import twonode as t  # noqa: E402  (helpers: train_args, reference, assert_same_state, summary)

Skip = t.Skip


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Slurm:
    def __init__(self, work):
        self.work = work
        self.procs = []
        self.conf = os.path.join(work, "slurm.conf")

    def _start(self, argv, log):
        p = subprocess.Popen(argv, stdout=open(os.path.join(self.work, log), "w"), stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs.append(p)
        return p

    def __enter__(self):
        if os.geteuid() != 0:
            raise Skip(f"slurmd and munged are started as root here (this is uid {os.geteuid()})")
        for b in ("munged", "slurmctld", "slurmd", "srun", "sinfo"):
            if not shutil.which(b) and not os.path.exists("/usr/sbin/" + b):
                raise Skip(f"{b} is not installed (scripts/setup.sh installs slurmd slurmctld slurm-client munge)")
        w = self.work
        for d in ("munge", "state", "spool", "log"):
            os.makedirs(os.path.join(w, d))
        os.chmod(os.path.join(w, "munge"), 0o711)
        key = os.path.join(w, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        sock = os.path.join(w, "munge", "munge.sock")
        self._start(["munged", "-F", "-f", f"--socket={sock}", f"--key-file={key}",
                     f"--log-file={w}/log/munged.log", f"--pid-file={w}/munge/munged.pid", f"--seed-file={w}/munge/seed"],
                    "munged.out")
        host = socket.gethostname()
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=keeltest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={w}/state
SlurmdSpoolDir={w}/spool
SlurmctldPidFile={w}/slurmctld.pid
SlurmdPidFile={w}/slurmd.pid
SlurmctldLogFile={w}/log/slurmctld.log
SlurmdLogFile={w}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
NodeName=keelnode NodeHostname={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=keel Nodes=keelnode Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        os.environ["SLURM_CONF"] = self.conf
        t_end = time.monotonic() + 10
        while not os.path.exists(sock):
            if time.monotonic() > t_end:
                raise Skip("munged did not start: " + open(os.path.join(w, "munged.out")).read()[-2000:])
            time.sleep(0.05)
        self._start(["slurmctld", "-D", "-f", self.conf], "slurmctld.out")
        self._start(["slurmd", "-D", "-N", "keelnode", "-f", self.conf], "slurmd.out")
        t_end = time.monotonic() + 60
        while True:
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
            if r.returncode == 0 and r.stdout.strip() == "idle":
                break
            if time.monotonic() > t_end or any(p.poll() is not None for p in self.procs):
                logs = "".join(f"--- {n}:\n" + t.tail(os.path.join(w, n), 15) for n in
                               ("munged.out", "slurmctld.out", "slurmd.out"))
                raise Skip(f"the Slurm daemons did not come up (sinfo: {r.stdout.strip()!r}):\n{logs}")
            time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        os.environ.pop("SLURM_CONF", None)


def srun_matches_torchrun(work):
    with Slurm(work):
        ckpt, run = os.path.join(work, "ckpt"), os.path.join(work, "run")
        env = t.clean_env()
        env["SLURM_CONF"] = os.path.join(work, "slurm.conf")
        argv = ["srun", "--ntasks=2", "--nodes=1", "--kill-on-bad-exit=1", "--time=5",
                f"--export=ALL,MASTER_ADDR=127.0.0.1,MASTER_PORT={free_port()}",
                t.KEEL, *t.train_args(ckpt, run, timeout_s=60)]
        r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=300)
        assert r.returncode == 0, f"srun exit {r.returncode}:\n{r.stdout[-4000:]}"
        s = t.summary(run)
        assert s["launcher"] == "srun" and s["world_size"] == 2, f"unexpected summary: {s}"
        print(f"ok: srun --ntasks=2: 2 ranks under the srun launcher, {s['steps']} steps")
        t.assert_same_state(t.reference(work), os.path.join(ckpt, "step_60"), "srun vs torchrun on one host")


if __name__ == "__main__":
    sys.exit(t.run_case("slurm", srun_matches_torchrun))
