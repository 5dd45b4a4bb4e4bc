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

A movable job (`movable=True`, docs/mpi.md "Moving a host's ranks") adds
what moving one host's `orted` tree with its ranks needs: `orted` started
detached from ssh by a launch agent, no pseudo-terminals, PMIx's hash
store, no hwloc shared file, UCX's posix shared memory instead of SysV,
and `mpirun` on a fixed port that the moving host reaches from a service
address (`service_address_up`). UCX's rdmacm connection manager stays on:
the RDMA CM channel it opens is the shim's, and moves.
"""

import os
import re
import shlex
import time

KEY_DIR = "/lab/mpi"
UCX_ENV = {
    "UCX_TLS": "rc_v,sm,self",
    "UCX_NET_DEVICES": "rxe0:1",
    "UCX_UD_VERBS_ETH_DGID_CHECK": "n",
}
MCA = ["--mca", "pml", "ucx", "--mca", "osc", "ucx", "--mca", "btl", "self",
       "--mca", "oob_tcp_if_include", "eth0"]
SHIM_MODES = ("none", "default", "offset")

# A movable job: mpirun's fixed TCP port, the launch agent, the policy
# routing table that puts the connections to that port on the service
# address, and the environment the ranks and orted need.
MPIRUN_PORT = 7810
AGENT = f"{KEY_DIR}/detach-ssh"
ROUTE_TABLE = 110
MOVABLE_UCX_TLS = "rc_v,posix,cma,self"
MOVABLE_ENV = {
    "PMIX_MCA_gds": "hash",
}
MOVABLE_MCA = ["--mca", "orte_daemonize", "1", "--mca", "plm_rsh_agent", AGENT,
               "--mca", "rtc", "^hwloc"]


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
                  slots=None, timeout=600, movable=False):
    """The shell command, for hosts[0], that runs `program` (a list) as
    `np` ranks over `hosts` (ranks filled host by host, `slots` each, or
    slots[n] on host n if `slots` is a dict). `movable`: the settings that
    let a host's orted tree be moved (see the module's doc; the agent and
    the service address must be up: movable_setup)."""
    if shim not in SHIM_MODES:
        raise MpiError(f"shim mode {shim!r}: one of {', '.join(SHIM_MODES)}")
    if isinstance(slots, dict):
        per_host = slots
    else:
        per_host = {n: slots or -(-np // len(hosts)) for n in hosts}
    env = dict(UCX_ENV)
    if movable:
        env["UCX_TLS"] = MOVABLE_UCX_TLS
        env.update(MOVABLE_ENV)
    if shim != "none":
        env["LD_PRELOAD"] = f"{build}/shim/librdmavirt.so"
        env["RDMAVIRT_ID_MODE"] = shim
    env.update(extra_env or {})
    args = (["env", f"OMPI_MCA_oob_tcp_static_ipv4_ports={MPIRUN_PORT}"] if movable else [])
    args += ["timeout", str(timeout), "mpirun", "--allow-run-as-root",
             "--host", ",".join(f"host{n}:{per_host[n]}" for n in hosts), "-np", str(np)]
    args += MCA + (MOVABLE_MCA if movable else [])
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


def agent_script(build):
    """The launch agent (plm_rsh_agent) of a movable job: starts orted on
    the host named first, detached from ssh (its own session, stdio on
    /dev/null: no pipes to sshd a move would have to take along), with
    openpty failing (ORTE then gives the ranks pipes, not terminals whose
    indexes the destination's orted may already hold). mpirun's fixed port
    is stripped from orted's command line: every orted on its own port."""
    return f"""#!/bin/sh
host=$1; shift
printf '%s\\n' "$*" | sed 's/-mca oob_tcp_static_ipv4_ports "[^"]*"//' |
  exec ssh "$host" 'f=$(mktemp /tmp/orted-launch.XXXXXX); cat > "$f"; '\\
'LD_PRELOAD={build}/tests/apps/librdmavirt_no_pty.so PMIX_MCA_gds=hash '\\
'setsid sh "$f" < /dev/null > /dev/null 2>&1 &'
"""


def service_address_up(lab, n, address):
    """hostN gets `address` (/24, on eth0) and a policy route that puts
    only the TCP connections to mpirun's port on it: orted's connection to
    mpirun then comes from an address that moves with it (rdmavirtctl
    migrate --address), while everything else, the migrator's own
    connections among them, keeps the host's address."""
    r = lab.run(n, f"""set -e
ip -4 addr show dev eth0 | grep -q ' {address}/' || ip addr add {address}/24 dev eth0
ip rule show | grep -q 'dport {MPIRUN_PORT} lookup {ROUTE_TABLE}' ||
  ip rule add ipproto tcp dport {MPIRUN_PORT} lookup {ROUTE_TABLE}
ip route replace 10.77.0.0/24 dev eth0 src {address} table {ROUTE_TABLE}""", timeout=30)
    if r.rc != 0:
        raise MpiError(f"host{n}: cannot set up the service address: {(r.out + r.err).strip()}")


def service_address_down(lab, hosts, address):
    """The service address, its rule and route, gone from every host."""
    for n in hosts:
        lab.run(n, f"ip addr del {address}/24 dev eth0 2> /dev/null; "
                   f"ip rule del ipproto tcp dport {MPIRUN_PORT} lookup {ROUTE_TABLE} "
                   f"2> /dev/null; ip route flush table {ROUTE_TABLE} 2> /dev/null; true",
                timeout=30)


def movable_setup(lab, build, hosts, moving_host, address):
    """What a movable job needs before mpirun: sshd, the launch agent, and
    `address` on the host whose orted tree will move."""
    ssh_up(lab, hosts)
    path = os.path.join(lab.shared, "mpi", "detach-ssh")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(agent_script(build))
    os.chmod(path, 0o755)
    service_address_up(lab, moving_host, address)


def rank_progress(lab, directory):
    """{rank: (rounds done, host, pid)} from `mpi_verify --progress
    DIRECTORY` (the path the hosts see, under /lab)."""
    local = os.path.join(lab.shared, os.path.relpath(directory, "/lab"))
    found = {}
    for name in os.listdir(local) if os.path.isdir(local) else []:
        if not name.startswith("rank-") or name.endswith(".tmp"):
            continue
        with open(os.path.join(local, name)) as f:
            parts = f.read().split()
        if len(parts) == 3:
            found[int(name[5:])] = (int(parts[0]), parts[1], int(parts[2]))
    return found


def wait_progress(lab, directory, condition, timeout, job=None):
    """Polls rank_progress until condition(progress) holds; returns
    (True, progress), or (False, the last progress seen) after `timeout`
    seconds or once hosts[0]'s `job` has ended."""
    end = time.monotonic() + timeout
    while True:
        seen = rank_progress(lab, directory)
        if condition(seen):
            return True, seen
        if time.monotonic() > end or (job is not None and lab.done(1, job)):
            return False, seen
        time.sleep(0.5)


def stop_movable(lab, hosts, address):
    """Whatever is left of a movable job, and its service address, gone."""
    for n in hosts:
        lab.run(n, "pkill -x mpirun; pkill -x orted; pkill -x mpi_verify; true", timeout=30)
    service_address_down(lab, hosts, address)
