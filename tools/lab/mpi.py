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

A movable job runs on hosts set up as an operator sets them up
(install_mpi: `rdmavirt-install host --mpi` in each, /etc/rdmavirt/mpi.conf
with each host's service addresses), with the user's stock command
(stock_script): every setting comes from the files Open MPI, PMIx and UCX
read themselves.
"""

import os
import re
import shlex
import time

KEY_DIR = "/lab/mpi"
TOP = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    `np` ranks over `hosts` (ranks filled host by host, `slots` each, or
    slots[n] on host n if `slots` is a dict), with every setting on the
    command line."""
    per_host, env = _placement_and_env(hosts, np, shim, build, extra_env, slots)
    args = ["timeout", str(timeout), "mpirun", "--allow-run-as-root",
            "--host", ",".join(f"host{n}:{per_host[n]}" for n in hosts), "-np", str(np)]
    args += MCA
    for k, v in env.items():
        args += ["-x", f"{k}={v}"]
    return " ".join(shlex.quote(a) for a in args + list(program))


def mpich_script(hosts, np, program, shim="none", build=None, extra_env=None,
                 slots=None, timeout=600):
    """As mpirun_script, with Debian's MPICH (ch4 over UCX): Hydra's
    mpiexec starts its proxies over ssh, its own TCP on eth0 (-iface), the
    ranks' environment (UCX_ENV, the shim) as -genv."""
    per_host, env = _placement_and_env(hosts, np, shim, build, extra_env, slots)
    args = ["timeout", str(timeout), "mpiexec.mpich", "-launcher", "ssh", "-iface", "eth0",
            "-hosts", ",".join(f"host{n}:{per_host[n]}" for n in hosts), "-np", str(np)]
    for k, v in env.items():
        args += ["-genv", k, v]
    return " ".join(shlex.quote(a) for a in args + list(program))


LAUNCHERS = {"openmpi": mpirun_script, "mpich": mpich_script}


def _placement_and_env(hosts, np, shim, build, extra_env, slots):
    """{host: ranks} (filled host by host, `slots` each, or slots[n] on
    host n if a dict) and the ranks' environment."""
    if shim not in SHIM_MODES:
        raise MpiError(f"shim mode {shim!r}: one of {', '.join(SHIM_MODES)}")
    if isinstance(slots, dict):
        per_host = slots
    else:
        per_host = {n: slots or -(-np // len(hosts)) for n in hosts}
    env = dict(UCX_ENV)
    if shim != "none":
        env["LD_PRELOAD"] = f"{build}/shim/librdmavirt.so"
        env["RDMAVIRT_ID_MODE"] = shim
    env.update(extra_env or {})
    return per_host, env


def rxe_packets(lab, n):
    """hostN's rxe0 counters: (sent_pkts, rcvd_pkts)."""
    r = lab.run(n, "rdma statistic show link rxe0/1", timeout=30)
    sent = re.search(r"\bsent_pkts (\d+)", r.out)
    rcvd = re.search(r"\brcvd_pkts (\d+)", r.out)
    if r.rc != 0 or not sent or not rcvd:
        raise MpiError(f"host{n}: no rxe0 counters: {(r.out + r.err).strip()}")
    return int(sent.group(1)), int(rcvd.group(1))


def run_job(lab, hosts, np, program, shim="none", build=None, timeout=600, launcher="openmpi"):
    """Runs an MPI job from hosts[0] (sshd started first) with Open MPI's
    mpirun or MPICH's mpiexec (LAUNCHERS); returns its Result and, per
    host, the packets rxe0 sent and received meanwhile."""
    ssh_up(lab, hosts)
    before = {n: rxe_packets(lab, n) for n in hosts}
    script = LAUNCHERS[launcher](hosts, np, program, shim=shim, build=build, timeout=timeout)
    r = lab.run(hosts[0], script, timeout=timeout + 30)
    packets = {}
    for n in hosts:
        sent, rcvd = rxe_packets(lab, n)
        packets[n] = (sent - before[n][0], rcvd - before[n][1])
    return r, packets


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


def wait_progress(lab, directory, condition, timeout, job=None, progress=rank_progress):
    """Polls progress(lab, directory) (by default rank_progress) until
    condition(progress) holds; returns (True, progress), or (False, the
    last progress seen) after `timeout` seconds or once hosts[0]'s `job`
    has ended."""
    end = time.monotonic() + timeout
    while True:
        seen = progress(lab, directory)
        if condition(seen):
            return True, seen
        if time.monotonic() > end or (job is not None and lab.done(1, job)):
            return False, seen
        time.sleep(0.5)


def stop_job(lab, hosts):
    """Whatever is left of a job on `hosts`, gone."""
    for n in hosts:
        lab.run(n, "pkill -x mpirun; pkill -x orted; pkill -x mpiexec.hydra; "
                   "pkill -x hydra_pmi_proxy; pkill -x xdlu; pkill -x mpi_verify; "
                   "pkill -f '^[^ ]*/mpi_verify_mpich '; true", timeout=30)


# Hosts set up as an operator would (docs/mpi.md): `rdmavirt-install
# host --mpi` in each, and the service addresses each host's MPI daemons
# lease (/etc/rdmavirt/mpi.conf, the same on every host).
def pool(n):
    return [f"10.77.0.{100 + 10 * n + i}/24" for i in (1, 2)]


SAVED = "/run/rdmavirt-lab/mpi-saved"  # what the install changed, as it was


def install_mpi(lab, build, hosts, socket, ucx_tuning=()):
    """Runs `rdmavirt-install --build BUILD host --mpi` in each host (the
    files it changes saved first, for uninstall_mpi), writes mpi.conf with
    pool(n) for every host, starts sshd, and makes the shim's default
    directory (/run/rdmavirt: its socket, the resume files the migrator
    writes beside it) the lab's migrator's, that of `socket`. `ucx_tuning`: lines an
    operator adds to /etc/ucx/ucx.conf, after the install's block.
    Returns the install's output per host."""
    ssh_up(lab, hosts)
    conf = "".join(f"host{n} {' '.join(pool(n))}\n" for n in hosts)
    install = f"{TOP}/tools/rdmavirt-install --build {build} --mpi host"
    tuning = "".join(f"grep -qxF {shlex.quote(t)} /etc/ucx/ucx.conf || "
                     f"echo {shlex.quote(t)} >> /etc/ucx/ucx.conf\n" for t in ucx_tuning)
    out = {}
    for n in hosts:
        # Every file the install writes (its dry run names them) saved, or
        # named as absent, once.
        r = lab.run(n, f"""set -e
if [ ! -d {SAVED} ]; then
  mkdir -p {SAVED}
  {install} --dry-run | awk '$1 == "installing" || $1 == "configuring" {{print $2}}' |
    while read -r f; do
      if [ -e "$f" ]; then i=$((${{i:-0}} + 1)); cp -a "$f" {SAVED}/$i; echo "$i $f" >> {SAVED}/saved
      else echo "$f" >> {SAVED}/absent; fi
    done
fi
{install}
printf '%s' {shlex.quote(conf)} > /etc/rdmavirt/mpi.conf
{tuning}
if [ ! -L /run/rdmavirt ]; then rm -rf /run/rdmavirt; ln -s {os.path.dirname(socket)} /run/rdmavirt; fi""",
                   timeout=120)
        if r.rc != 0:
            raise MpiError(f"host{n}: rdmavirt-install --mpi failed: {(r.out + r.err).strip()}")
        out[n] = r.out
    return out


def uninstall_mpi(lab, hosts):
    """The files install_mpi changed put back, its programs and leases gone
    (other lab tests run UCX and Open MPI with their own settings)."""
    for n in hosts:
        lab.run(n, f"""[ -d {SAVED} ] || exit 0
pkill -x orted
[ -f {SAVED}/saved ] && while read -r i f; do cp -a {SAVED}/$i "$f"; done < {SAVED}/saved
[ -f {SAVED}/absent ] && xargs rm -f < {SAVED}/absent
for a in {' '.join(a for m in hosts for a in pool(m))}; do ip addr del $a dev eth0 2> /dev/null; done
ip rule show | awk '/lookup 71[0-9][0-9]/ {{sub(":", "", $1); print $1}}' |
  while read -r p; do ip rule del priority $p; done
rm -rf {SAVED} /run/rdmavirt/mpi; [ -L /run/rdmavirt ] && rm /run/rdmavirt; true""", timeout=60)


def stock_script(slots, np, program, timeout, launcher="openmpi"):
    """The user's command on a host set up by install_mpi: a stock mpirun
    with `np` ranks, slots[n] on host n; `--allow-run-as-root` is the one
    option (the lab runs as root). With MPICH, Debian's mpiexec.mpich and
    no option."""
    hosts = ",".join(f"host{n}:{k}" for n, k in slots.items())
    if launcher == "mpich":
        start = ["mpiexec.mpich", "-np", str(np), "-hosts", hosts]
    else:
        start = ["mpirun", "--allow-run-as-root", "-np", str(np), "--host", hosts]
    args = ["timeout", str(timeout)] + start + list(program)
    return " ".join(shlex.quote(a) for a in args)
