"""The rdmavirt lab: real Soft-RoCE hosts in TCG VMs on one L2 fabric.

A lab is a directory (default /tmp/rdmavirt-lab) holding one supervisor
process, a VDE switch and 1..8 QEMU guests. Each guest boots Debian 12's own
kernel (it has rdma_rxe; the build machine's kernel has no RDMA) with the
build machine's / shared read-only under a tmpfs overlay, so every installed
program and the project's build tree run in the guest unchanged. hostN has
10.77.0.N on eth0 and rxe0 on top of it; the lab share is /lab in every host.

Commands reach a guest through a spool directory on the lab share (see
guest/stage2). Every call has a timeout; a host whose heartbeat stops, or
whose QEMU exits, is reported as down instead of being waited on.

The supervisor owns everything: the switch and the VMs die with it (parent
death signal), it tears the lab down on SIGTERM/SIGINT, and, when given an
owner pid, as soon as that process is gone (so a killed test run leaves
nothing behind).

Only the standard library is used: the lab must run before anything else
is built.
"""

import ctypes
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid

GUEST_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "guest")
# The project tree is mounted into every host on its own, without the
# overlay: the overlay caches lookups (also of files not there yet) and
# pages of the read-only root, so a binary built while a lab runs would be
# missing or torn in the hosts.
PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(GUEST_DIR)))
DEFAULT_DIR = os.environ.get("RDMAVIRT_LAB_DIR", "/tmp/rdmavirt-lab")
CACHE_DIR = os.environ.get("RDMAVIRT_LAB_CACHE", "/var/cache/rdmavirt-lab")
MAX_HOSTS = 8

# Load order matters; LAB.md says why each is there. The *_diag modules let
# CRIU dump sockets; they are taken when the kernel has them as modules.
MODULES = [
    "crc32c_generic", "nf_tables", "crc32_generic", "virtio_pci",
    "9pnet_virtio", "9p", "virtio_net", "rdma_rxe", "ib_uverbs", "rdma_ucm",
    "overlay", "veth",
]
OPTIONAL_MODULES = [
    "unix_diag", "netlink_diag", "inet_diag", "tcp_diag", "udp_diag",
    "packet_diag", "af_packet_diag", "nft_compat", "nf_conntrack", "tun",
    # VM guests (vmlab.py): the guest agent's virtio-serial port.
    "virtio_console",
]


class LabError(Exception):
    """Anything the caller should report and stop on."""


class HostDown(LabError):
    """A host stopped answering (its heartbeat or its QEMU stopped)."""


class Result:
    def __init__(self, rc, out, err):
        self.rc, self.out, self.err = rc, out, err

    def __repr__(self):
        return f"Result(rc={self.rc}, out={self.out[-400:]!r}, err={self.err[-400:]!r})"


def log(msg):
    print(f"rdmavirt-lab: {msg}", file=sys.stderr, flush=True)


def _run(cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)


# ---------------------------------------------------------------- the kernel

def kernel_dir():
    """Fetches (once, cached) Debian's kernel and the initramfs modules.

    Returns the cache directory holding vmlinuz, modules/ (the .ko files in
    load order) and modules.order.
    """
    os.makedirs(CACHE_DIR, exist_ok=True)
    try:
        deps = _run(["apt-cache", "depends", "linux-image-amd64"]).stdout
    except subprocess.CalledProcessError:
        deps = ""
    pkg = next((l.split()[-1] for l in deps.splitlines()
                if "Depends:" in l and "linux-image-" in l), None)
    if pkg is None:
        _run(["apt-get", "update", "-qq"])
        deps = _run(["apt-cache", "depends", "linux-image-amd64"]).stdout
        pkg = next((l.split()[-1] for l in deps.splitlines()
                    if "Depends:" in l and "linux-image-" in l), None)
    if pkg is None:
        raise LabError("cannot find the kernel package linux-image-amd64 depends on")
    # The cache is per kernel and per module list.
    mods_key = hashlib.sha256(" ".join(MODULES + OPTIONAL_MODULES).encode()).hexdigest()[:8]
    kdir = os.path.join(CACHE_DIR, f"{pkg}-{mods_key}")
    if os.path.exists(os.path.join(kdir, "modules.order")):
        return kdir

    log(f"fetching kernel {pkg} (once; cached in {kdir})")
    # Two labs booting at once each fetch into a directory of their own;
    # the first to finish puts its copy in place.
    tmp = f"{kdir}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _run(["apt-get", "download", "-q", pkg], cwd=tmp)
    except subprocess.CalledProcessError:
        _run(["apt-get", "update", "-qq"])
        _run(["apt-get", "download", "-q", pkg], cwd=tmp)
    deb = next(f for f in os.listdir(tmp) if f.endswith(".deb"))
    root = os.path.join(tmp, "root")
    _run(["dpkg", "-x", os.path.join(tmp, deb), root])
    version = os.listdir(os.path.join(root, "lib/modules"))[0]
    _run(["depmod", "-b", root, version])
    ordered = []
    for mod in MODULES + OPTIONAL_MODULES:
        p = subprocess.run(["modprobe", "-d", root, "-S", version,
                            "--show-depends", mod],
                           text=True, capture_output=True)
        if p.returncode != 0:
            if mod in MODULES:
                raise LabError(f"kernel {version} lacks module {mod}: {p.stderr.strip()}")
            continue
        for line in p.stdout.splitlines():
            parts = line.split()
            if parts and parts[0] == "insmod" and parts[1] not in ordered:
                ordered.append(parts[1])
    mods = os.path.join(tmp, "modules")
    os.makedirs(mods)
    names = []
    for path in ordered:
        name = os.path.basename(path)
        if name.endswith(".xz"):
            _run(["xz", "-dk", path])
            path, name = path[:-3], name[:-3]
        shutil.copy(path, os.path.join(mods, name))
        names.append("modules/" + name)
    with open(os.path.join(tmp, "modules.order"), "w") as f:
        f.write("\n".join(names) + "\n")
    shutil.copy(os.path.join(root, "boot", f"vmlinuz-{version}"),
                os.path.join(tmp, "vmlinuz"))
    with open(os.path.join(tmp, "version"), "w") as f:
        f.write(version + "\n")
    shutil.rmtree(root)
    os.remove(os.path.join(tmp, deb))
    if os.path.exists(os.path.join(kdir, "modules.order")):
        shutil.rmtree(tmp)  # another lab's copy came first
        return kdir
    shutil.rmtree(kdir, ignore_errors=True)
    try:
        os.rename(tmp, kdir)
    except OSError:
        if not os.path.exists(os.path.join(kdir, "modules.order")):
            raise
        shutil.rmtree(tmp)
    return kdir


def stage_modules(kdir, stage):
    """The kernel modules of kernel_dir() `kdir`, in load order, into `stage`."""
    shutil.copytree(os.path.join(kdir, "modules"), os.path.join(stage, "modules"))
    shutil.copy(os.path.join(kdir, "modules.order"), stage)


def pack_initramfs(stage, out):
    """Directory `stage` as an uncompressed newc cpio at `out`; removes `stage`.

    The lab's hosts (build_initramfs) and vmlab.py's guests boot from it.
    """
    files = _run(["find", "."], cwd=stage).stdout
    with open(out, "wb") as f:
        subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=stage,
                       input=files.encode(), stdout=f, check=True)
    shutil.rmtree(stage)


def build_initramfs(kdir, out):
    """A busybox initramfs with the lab's modules and both init stages."""
    busybox = "/bin/busybox"
    if not os.path.exists(busybox):
        raise LabError("/bin/busybox missing: run tools/install-deps.sh")
    stage = out + ".d"
    shutil.rmtree(stage, ignore_errors=True)
    for d in ("bin", "proc", "sys", "dev", "tmp"):
        os.makedirs(os.path.join(stage, d))
    shutil.copy(busybox, os.path.join(stage, "bin/busybox"))
    stage_modules(kdir, stage)
    shutil.copy(os.path.join(GUEST_DIR, "init"), os.path.join(stage, "init"))
    shutil.copy(os.path.join(GUEST_DIR, "stage2"), os.path.join(stage, "stage2"))
    os.chmod(os.path.join(stage, "init"), 0o755)
    pack_initramfs(stage, out)


# ---------------------------------------------------------------- the lab

class Lab:
    """Client of a lab directory: boot it, run commands in its hosts, stop it."""

    def __init__(self, directory=DEFAULT_DIR):
        self.dir = os.path.abspath(directory)
        self.shared = os.path.join(self.dir, "shared")
        self.state_path = os.path.join(self.dir, "state.json")
        self._submitted = {}  # job -> (monotonic time submitted, script)

    # -- state

    def state(self):
        try:
            with open(self.state_path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def running(self):
        st = self.state()
        return st is not None and _alive(st.get("supervisor", 0))

    def hosts(self):
        st = self.state()
        return st["hosts"] if st else 0

    def ctl(self, n):
        return os.path.join(self.shared, "ctl", f"host{n}")

    # -- lifecycle

    def up(self, hosts=2, memory_mb=2048, cpus=2, owner=None, boot_timeout=120):
        """Boots `hosts` hosts in parallel; returns when all are ready."""
        if not 1 <= hosts <= MAX_HOSTS:
            raise LabError(f"hosts must be 1..{MAX_HOSTS}, got {hosts}")
        if self.running():
            raise LabError(f"a lab is already running in {self.dir} "
                           f"(rdmavirt-lab down, or --dir elsewhere)")
        for tool in ("qemu-system-x86_64", "vde_switch", "cpio", "depmod"):
            if shutil.which(tool) is None:
                raise LabError(f"{tool} not found: run tools/install-deps.sh")
        kdir = kernel_dir()
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.shared)
        os.makedirs(os.path.join(self.shared, "ctl"))
        initrd = os.path.join(self.dir, "initrd.img")
        build_initramfs(kdir, initrd)
        config = {"hosts": hosts, "memory_mb": memory_mb, "cpus": cpus,
                  "kernel": os.path.join(kdir, "vmlinuz"), "initrd": initrd,
                  "owner": owner, "dir": self.dir}
        with open(os.path.join(self.dir, "config.json"), "w") as f:
            json.dump(config, f)
        started = time.monotonic()
        # The supervisor is a daemon of its own: it outlives this call.
        logf = open(os.path.join(self.dir, "supervisor.log"), "ab")
        subprocess.Popen([sys.executable, os.path.abspath(__file__),
                          "_supervise", self.dir],
                         stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                         start_new_session=True, close_fds=True)
        logf.close()
        deadline = started + boot_timeout
        pending = set(range(1, hosts + 1))
        while pending:
            if time.monotonic() > deadline:
                self.down()
                raise LabError(f"host(s) {sorted(pending)} not ready after "
                               f"{boot_timeout}s" + self._console_tails(pending))
            st = self.state()
            if st and st.get("failed"):
                self.down()
                raise LabError(f"lab failed: {st['failed']}"
                               + self._console_tails(pending))
            for n in list(pending):
                err = os.path.join(self.ctl(n), "boot-error")
                if os.path.exists(err):
                    msg = open(err).read().strip()
                    self.down()
                    raise LabError(f"host{n}: {msg}" + self._console_tails([n]))
                if os.path.exists(os.path.join(self.ctl(n), "ready")):
                    pending.discard(n)
            time.sleep(0.2)
        return time.monotonic() - started

    def resize(self, hosts, boot_timeout=120):
        """Grows the running lab to `hosts` hosts (the new ones boot and this
        returns when they are ready) or shrinks it (the last ones are
        stopped); the others run on untouched. A test that needs more hosts
        than the rest of its run resizes the lab it shares with them, rather
        than booting a second one beside it on the same cores."""
        if not 1 <= hosts <= MAX_HOSTS:
            raise LabError(f"hosts must be 1..{MAX_HOSTS}, got {hosts}")
        if not self.running():
            raise LabError(f"no lab running in {self.dir}")
        had = self.hosts()
        if hosts == had:
            return 0.0
        started = time.monotonic()
        for n in range(hosts + 1, had + 1):
            shutil.rmtree(self.ctl(n), ignore_errors=True)
        tmp = os.path.join(self.dir, "resize.tmp")
        with open(tmp, "w") as f:
            f.write(f"{hosts}\n")
        os.rename(tmp, os.path.join(self.dir, "resize"))
        deadline = started + boot_timeout
        while True:
            st = self.state() or {}
            if st.get("hosts") == hosts and not os.path.exists(
                    os.path.join(self.dir, "resize")):
                break
            if not self.running() or time.monotonic() > deadline:
                raise LabError(f"the lab's supervisor did not resize it to {hosts} hosts")
            time.sleep(0.2)
        for n in range(hosts + 1, had + 1):
            shutil.rmtree(self.ctl(n), ignore_errors=True)
        pending = set(range(had + 1, hosts + 1))
        while pending:
            if time.monotonic() > deadline:
                raise LabError(f"host(s) {sorted(pending)} not ready after "
                               f"{boot_timeout}s" + self._console_tails(pending))
            for n in list(pending):
                err = os.path.join(self.ctl(n), "boot-error")
                if os.path.exists(err):
                    raise LabError(f"host{n}: {open(err).read().strip()}"
                                   + self._console_tails([n]))
                if os.path.exists(os.path.join(self.ctl(n), "ready")):
                    pending.discard(n)
            time.sleep(0.2)
        return time.monotonic() - started

    def down(self, timeout=15):
        """Stops the supervisor, which kills the VMs and the switch."""
        st = self.state()
        if st is None:
            return False
        pid = st.get("supervisor", 0)
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
            end = time.monotonic() + timeout
            while _alive(pid) and time.monotonic() < end:
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        # Whatever is left (a supervisor killed with SIGKILL takes its
        # children with it through the parent death signal; this is the belt).
        for p in st.get("pids", []):
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        return True

    def _console_tails(self, hosts):
        out = ""
        for n in hosts:
            path = os.path.join(self.dir, f"host{n}.console")
            try:
                tail = open(path, errors="replace").read()[-1500:]
            except FileNotFoundError:
                tail = "(no console output)"
            out += f"\n--- host{n} console (tail) ---\n{tail}"
        return out

    # -- commands

    def _check_host(self, n):
        st = self.state()
        if st is None or not _alive(st.get("supervisor", 0)):
            raise LabError(f"no lab running in {self.dir}")
        if not 1 <= n <= st["hosts"]:
            raise LabError(f"host{n} does not exist (the lab has {st['hosts']})")

    def submit(self, n, script, timeout):
        """Queues `script` (bash) on hostN; returns the job id."""
        self._check_host(n)
        job = uuid.uuid4().hex[:12]
        ctl = self.ctl(n)
        with open(os.path.join(ctl, job + ".sh"), "w") as f:
            f.write(script + "\n")
        tmp = os.path.join(ctl, job + ".cmd.tmp")
        with open(tmp, "w") as f:
            f.write(f"{int(timeout)}\n")
        os.rename(tmp, os.path.join(ctl, job + ".cmd"))
        self._submitted[job] = (time.monotonic(), script)
        self._ring(n)
        return job

    def wait(self, n, job, timeout, stale_after=20):
        """Waits for a job; returns its Result.

        Raises HostDown when the host stops answering, LabError on timeout
        (after killing the job).
        """
        ctl = self.ctl(n)
        rc_path = os.path.join(ctl, job + ".rc")
        end = time.monotonic() + timeout
        beat = self._beat(n)
        beat_seen = time.monotonic()
        delay = 0.02
        while (rc := _status(rc_path)) is None:
            now = time.monotonic()
            if now > end:
                self.kill(n, job)
                raise LabError(f"host{n}: command timed out after {timeout}s")
            b = self._beat(n)
            if b != beat:
                beat, beat_seen = b, now
            elif now - beat_seen > stale_after:
                raise HostDown(f"host{n} is not responding (no heartbeat for "
                               f"{stale_after}s)" + self._console_tails([n]))
            st = self.state()
            if st is None or not _alive(st.get("supervisor", 0)):
                raise HostDown("the lab is gone (supervisor exited)")
            if n in st.get("dead", []):
                raise HostDown(f"host{n}'s VM exited" + self._console_tails([n]))
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)
        out = _read(os.path.join(ctl, job + ".out"))
        err = _read(os.path.join(ctl, job + ".err"))
        for ext in (".cmd", ".sh", ".pid", ".out", ".err", ".rc"):
            _unlink(os.path.join(ctl, job + ext))
        self._trace(n, job, rc)
        return Result(rc, out, err)

    def _trace(self, n, job, rc):
        """With $RDMAVIRT_LAB_TRACE=FILE, one JSON line per job collected:
        where the lab's time goes (`rdmavirt-lab trace FILE` sums it up)."""
        started, script = self._submitted.pop(job, (None, ""))
        path = os.environ.get("RDMAVIRT_LAB_TRACE")
        if not path or started is None:
            return
        with open(path, "a") as f:
            f.write(json.dumps({"host": n, "rc": rc, "s": round(time.monotonic() - started, 3),
                                "script": script[:200]}) + "\n")

    def done(self, n, job):
        return _status(os.path.join(self.ctl(n), job + ".rc")) is not None

    def kill(self, n, job):
        with open(os.path.join(self.ctl(n), job + ".kill"), "w"):
            pass
        self._ring(n)

    def _ring(self, n):
        """Wakes hostN's agent: a newline on its second serial port (QEMU
        reads it from the fifo DIR/hostN.bell.in). Best effort: an agent
        that misses it still looks at the spool once a second."""
        try:
            fd = os.open(bell_path(self.dir, n) + ".in", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return
        try:
            os.write(fd, b"\n")
        except OSError:
            pass
        finally:
            os.close(fd)

    def run(self, n, script, timeout=60):
        """Runs `script` on hostN and returns its Result."""
        # The guest-side timeout fires first, so a slow command is reported
        # with rc 124 and its partial output rather than as a lost host.
        job = self.submit(n, script, timeout)
        return self.wait(n, job, timeout + 15)

    def _beat(self, n):
        return _read(os.path.join(self.ctl(n), "heartbeat"))


def _read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _status(rc_path):
    """A job's exit status once the agent wrote all of "STATUS\\n", else None."""
    text = _read(rc_path)
    return int(text) if text.endswith("\n") else None


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _alive(pid):
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not alive.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ---------------------------------------------------------------- supervisor

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def _die_with_parent():
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def supervise(directory):
    lab = Lab(directory)
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    state = {"supervisor": os.getpid(), "hosts": cfg["hosts"], "pids": [],
             "dead": [], "started": time.time()}

    def save():
        tmp = lab.state_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.rename(tmp, lab.state_path)

    stopping = []

    def on_signal(signum, _frame):
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    procs = {}
    # Two switches: the RDMA fabric (sw, eth0, rxe0) and the management
    # network (mgmt, eth1) that the inventory tests keep the migrators on.
    # A switch's stdin is a pipe that only we hold: it sees EOF and exits
    # when we are gone, however we went.
    switches = []
    for name in ("sw", "mgmt"):
        sock = os.path.join(directory, name)
        sw = subprocess.Popen(["vde_switch", "-s", sock, "-n", "16"],
                              stdin=subprocess.PIPE,
                              stdout=open(os.path.join(directory, f"{name}.log"), "wb"),
                              stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        state["pids"].append(sw.pid)
        switches.append(sw)
        for _ in range(100):
            if os.path.exists(os.path.join(sock, "ctl")):
                break
            time.sleep(0.05)
        else:
            state["failed"] = f"vde_switch did not create its socket {sock}"
            save()
            for x in switches:
                x.kill()
            return 1

    def start(n):
        for end in (".in", ".out"):
            if not os.path.exists(bell_path(directory, n) + end):
                os.mkfifo(bell_path(directory, n) + end)
        cmd = qemu_command(cfg, directory, n)
        with open(os.path.join(directory, f"host{n}.cmdline"), "w") as f:
            f.write(shlex.join(cmd) + "\n")
        procs[n] = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL,
            stdout=open(os.path.join(directory, f"host{n}.qemu.log"), "wb"),
            stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        state["pids"].append(procs[n].pid)

    def stop(p):
        p.terminate()
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def resize():
        """Lab.resize's request: start the hosts beyond the running ones,
        or stop the last ones."""
        path = os.path.join(directory, "resize")
        if not os.path.exists(path):
            return
        try:
            want = int(_read(path))
        except ValueError:
            want = 0
        if 1 <= want <= MAX_HOSTS:
            for n in sorted(procs):
                if n > want:
                    stop(procs.pop(n))
                    if n in state["dead"]:
                        state["dead"].remove(n)
            for n in range(state["hosts"] + 1, want + 1):
                start(n)
            print(f"resized from {state['hosts']} to {want} hosts", flush=True)
            state["hosts"] = want
            save()
        _unlink(path)

    for n in range(1, cfg["hosts"] + 1):
        start(n)
    save()

    owner = cfg.get("owner")
    while not stopping:
        resize()
        if owner and not _alive(owner):
            print(f"owner {owner} is gone: tearing down", flush=True)
            break
        for n, p in procs.items():
            if p.poll() is not None and n not in state["dead"]:
                state["dead"].append(n)
                print(f"host{n}: qemu exited with {p.returncode}", flush=True)
                save()
        if any(sw.poll() is not None for sw in switches):
            state["failed"] = "a vde_switch exited: " + ", ".join(
                str(sw.returncode) for sw in switches)
            save()
            break
        time.sleep(0.5)

    for p in list(procs.values()) + switches:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + 5
    for p in list(procs.values()) + switches:
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    state["supervisor"] = 0
    state["stopped"] = time.time()
    save()
    return 0


def bell_path(directory, n):
    """The doorbell of hostN's agent (see Lab._ring): QEMU's pipe chardev
    opens PATH.in and PATH.out, fifos made before it starts."""
    return os.path.join(directory, f"host{n}.bell")


def qemu_command(cfg, directory, n):
    mac = f"52:54:00:77:00:{n:02x}"
    append = (f"console=ttyS0 panic=-1 rdmavirt.host={n} "
              f"rdmavirt.live={PROJECT_DIR} "
              "loglevel=4 net.ifnames=0 biosdevname=0")
    return [
        "qemu-system-x86_64", "-name", f"host{n}",
        "-nodefaults", "-no-user-config", "-no-reboot",
        "-machine", "pc", "-accel", "tcg,thread=multi", "-cpu", "max",
        "-smp", str(cfg["cpus"]), "-m", str(cfg["memory_mb"]),
        "-kernel", cfg["kernel"], "-initrd", cfg["initrd"], "-append", append,
        "-display", "none", "-monitor", "none",
        "-serial", f"file:{os.path.join(directory, f'host{n}.console')}",
        "-serial", f"pipe:{bell_path(directory, n)}",
        "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,"
                   "readonly=on,multidevs=remap",
        "-virtfs", f"local,path={os.path.join(directory, 'shared')},"
                   "mount_tag=lab,security_model=none,multidevs=remap",
        "-virtfs", f"local,path={PROJECT_DIR},mount_tag=live,security_model=none,"
                   "readonly=on,multidevs=remap",
        "-netdev", f"vde,id=n0,sock={os.path.join(directory, 'sw')}",
        "-device", f"virtio-net-pci,netdev=n0,mac={mac}",
        "-netdev", f"vde,id=n1,sock={os.path.join(directory, 'mgmt')}",
        "-device", f"virtio-net-pci,netdev=n1,mac=52:54:00:78:00:{n:02x}",
    ]


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "_supervise":
    os.setsid() if os.getsid(0) != os.getpid() else None
    sys.exit(supervise(sys.argv[2]))
