"""MPI jobs across lab hosts: Debian's Open MPI 4.1 with UCX over rxe0.

The recipe (docs/mpi.md says why each setting is there):
  - ranks launched over ssh: an sshd on each host's fabric address, root's
    key shared through /lab/mpi;
  - `--mca pml ucx --mca osc ucx --mca btl self`: Debian's
    /etc/openmpi/openmpi-mca-params.conf turns UCX off, and without it a
    job silently runs over TCP;
  - `UCX_TLS=rc_v,sm,self UCX_NET_DEVICES=rxe0:1`: RC over verbs between
    hosts, shared memory within one;
  - `UCX_UD_VERBS_ETH_DGID_CHECK=n`: UCX 1.13's UD transport (its wire-up
    for rc_v) drops every packet rxe delivers otherwise;
  - `--mca oob_tcp_if_include eth0`: the launch's own TCP on the fabric NIC.
"""

import re
import shlex

KEY_DIR = "/lab/mpi"
UCX_ENV = {
    "UCX_TLS": "rc_v,sm,self",
    "UCX_NET_DEVICES": "rxe0:1",
    "UCX_UD_VERBS_ETH_DGID_CHECK": "n",
}
MCA = ["--mca", "pml", "ucx", "--mca", "osc", "ucx", "--mca", "btl", "self",
       "--mca", "oob_tcp_if_include", "eth0"]
SHIM_MODES = ("none", "default", "offset")


class MpiError(Exception):
    pass


def ssh_up(lab, hosts):
    """Starts sshd on each host's fabric address (once) with root's key."""
    first = lab.run(hosts[0], f"mkdir -p {KEY_DIR} && {{ test -f {KEY_DIR}/id || "
                    f"ssh-keygen -q -t ed25519 -N '' -f {KEY_DIR}/id; }}", timeout=60)
    if first.rc != 0:
        raise MpiError(f"cannot create the launch key: {first.err.strip()}")
    for n in hosts:
        r = lab.run(n, f"""set -e
pgrep -f 'sshd -o ListenAddress=10.77.0.{n}' >/dev/null && exit 0
mkdir -p /root/.ssh /run/sshd && chmod 700 /root/.ssh
cp {KEY_DIR}/id /root/.ssh/id_ed25519 && cp {KEY_DIR}/id.pub /root/.ssh/authorized_keys
printf 'Host *\\n StrictHostKeyChecking no\\n UserKnownHostsFile /dev/null\\n LogLevel ERROR\\n' \
  > /root/.ssh/config
chmod 600 /root/.ssh/*
/usr/sbin/sshd -o ListenAddress=10.77.0.{n}""", timeout=60)
        if r.rc != 0:
            raise MpiError(f"host{n}: cannot start sshd: {(r.out + r.err).strip()}")


def mpirun_script(hosts, np, program, shim="none", build=None, extra_env=None,
                  slots=None, timeout=600):
    """The shell command, for hosts[0], that runs `program` (a list) as
    `np` ranks over `hosts` (ranks filled host by host, `slots` each)."""
    if shim not in SHIM_MODES:
        raise MpiError(f"shim mode {shim!r}: one of {', '.join(SHIM_MODES)}")
    per_host = slots or -(-np // len(hosts))
    env = dict(UCX_ENV)
    if shim != "none":
        env["LD_PRELOAD"] = f"{build}/shim/librdmavirt.so"
        env["RDMAVIRT_ID_MODE"] = shim
    env.update(extra_env or {})
    args = ["timeout", str(timeout), "mpirun", "--allow-run-as-root",
            "--host", ",".join(f"host{n}:{per_host}" for n in hosts), "-np", str(np)]
    args += MCA
    for k, v in env.items():
        args += ["-x", f"{k}={v}"]
    return " ".join(shlex.quote(a) for a in args + list(program))


def rxe_packets(lab, n):
    """hostN's rxe0 counters: (sent_pkts, rcvd_pkts)."""
    r = lab.run(n, "rdma statistic show link rxe0/1", timeout=30)
    sent = re.search(r"\bsent_pkts (\d+)", r.out)
    rcvd = re.search(r"\brcvd_pkts (\d+)", r.out)
    if r.rc != 0 or not sent or not rcvd:
        raise MpiError(f"host{n}: no rxe0 counters: {(r.out + r.err).strip()}")
    return int(sent.group(1)), int(rcvd.group(1))


def run_job(lab, hosts, np, program, shim="none", build=None, timeout=600):
    """Runs an MPI job from hosts[0] (sshd started first); returns its
    Result and, per host, the packets rxe0 sent and received meanwhile."""
    ssh_up(lab, hosts)
    before = {n: rxe_packets(lab, n) for n in hosts}
    script = mpirun_script(hosts, np, program, shim=shim, build=build, timeout=timeout)
    r = lab.run(hosts[0], script, timeout=timeout + 30)
    packets = {}
    for n in hosts:
        sent, rcvd = rxe_packets(lab, n)
        packets[n] = (sent - before[n][0], rcvd - before[n][1])
    return r, packets
