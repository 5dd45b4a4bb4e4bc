"""The VM lab: RDMA guests under real libvirt daemons, for the VM workflows.

Two libvirt "hosts" on this machine (vmhost1, vmhost2), each a libvirtd
with its own virtlogd in a mount namespace of its own: bind mounts give it
its own /etc/libvirt (with a host_uuid of its own, so that the two can
migrate to each other), /run/libvirt, /var/lib/libvirt, /var/log/libvirt
and /var/cache/libvirt, all under the lab directory. Each host has its own
rdmavirt-migratord on 127.0.0.1:771N (mutual TLS) that gives its guests
NICs on the lab's bridge (addresses from 10.79.N.1 up) and rdmavirt's qemu
hook, whose settings live in /etc/libvirt/hooks/rdmavirt.conf.

Guests are TCG domains booting Debian's kernel and an initramfs that holds
everything they run (guest/init): busybox, the QEMU guest agent, libibverbs
with rxe, rdmavirt's migratord, CLI, shim and test programs, and
rdmavirt-guest. Their RDMA NIC is a virtio NIC on the bridge (alias
ua-rdmavirt-nic), with Soft-RoCE on top inside the guest, standing in for
a VF of the host's HCA. The bridge has no address: guests talk only to
each other. Guests are reached only through their guest agent.

Only the standard library (and lab.py) is used.
"""

import base64
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lab as labmod  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PROJECT_DIR = os.path.dirname(os.path.dirname(HERE))
DEFAULT_DIR = os.environ.get("RDMAVIRT_VMLAB_DIR", "/tmp/rdmavirt-vmlab")
BRIDGE = "rdmavirt-br0"
GUEST_NS = "urn:rdmavirt:guest:1"
NIC_ALIAS = "ua-rdmavirt-nic"
SUBNET_LEN = 16
# Guests' static fabric addresses (guestN: 10.79.0.10+N); each host hands
# out 10.79.H.1 up to moving-in guests.
MAX_GUESTS = 4
HOST_CAPACITY = 4


class VmLabError(labmod.LabError):
    pass


def log(msg):
    print(f"rdmavirt-vmlab: {msg}", file=sys.stderr, flush=True)


def _run(cmd, check=True, timeout=120, **kw):
    p = subprocess.run(cmd, text=True, capture_output=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise VmLabError(f"`{' '.join(map(str, cmd))}` exited {p.returncode}: "
                         f"{(p.stderr or p.stdout).strip()[-800:]}")
    return p


def guest_address(n):
    return f"10.79.0.{10 + n}"


def guest_mac(n):
    return f"52:54:00:79:00:{n:02x}"


# ------------------------------------------------------------ the initramfs

def _libs(paths):
    """The shared libraries `paths` need (ldd), the loader included."""
    out = set()
    for p in paths:
        r = subprocess.run(["ldd", p], text=True, capture_output=True)
        for line in r.stdout.splitlines():
            parts = line.split()
            for tok in parts:
                if tok.startswith("/"):
                    out.add(tok)
                    break
    return out


def build_guest_initramfs(kdir, build_dir, tls_dir, out):
    """Everything a guest runs, as an uncompressed newc cpio at `out`."""
    progs = {
        # path in the guest: path here
        "/usr/local/bin/rdmavirt-migratord": f"{build_dir}/migrator/rdmavirt-migratord",
        "/usr/local/bin/rdmavirtctl": f"{build_dir}/tools/rdmavirtctl/rdmavirtctl",
        "/usr/local/lib/rdmavirt/librdmavirt.so": f"{build_dir}/shim/librdmavirt.so",
        "/usr/local/bin/integrity": f"{build_dir}/tests/apps/integrity",
        "/usr/sbin/rdmavirt-guest": f"{PROJECT_DIR}/libvirt-hooks/guest/rdmavirt-guest",
        "/usr/bin/busybox": "/bin/busybox",
        "/usr/bin/bash": "/bin/bash",
        "/usr/sbin/qemu-ga": "/usr/sbin/qemu-ga",
        "/usr/bin/ip": shutil.which("ip") or "/usr/bin/ip",
        "/usr/bin/rdma": shutil.which("rdma") or "/usr/bin/rdma",
        "/usr/bin/ibv_devices": "/usr/bin/ibv_devices",
        "/etc/qemu/fsfreeze-hook": "/etc/qemu/fsfreeze-hook",
        "/etc/qemu/fsfreeze-hook.d/rdmavirt":
            f"{PROJECT_DIR}/libvirt-hooks/guest/fsfreeze-hook.d/rdmavirt",
        "/init": f"{HERE}/vmguest/init",
    }
    provider_dir = "/usr/lib/x86_64-linux-gnu/libibverbs"
    for f in os.listdir(provider_dir):
        if f.startswith("librxe"):
            progs[f"{provider_dir}/{f}"] = f"{provider_dir}/{f}"
    progs["/etc/libibverbs.d/rxe.driver"] = "/etc/libibverbs.d/rxe.driver"
    for f in ("ca.pem", "host.pem", "host.key", "cli.pem", "cli.key"):
        progs[f"/etc/rdmavirt/tls/{f}"] = os.path.join(tls_dir, f)
    for dst, src in progs.items():
        if not os.path.exists(src):
            raise VmLabError(f"{src} missing (build the project; tools/install-deps.sh)")

    stage = out + ".d"
    shutil.rmtree(stage, ignore_errors=True)
    # Debian's merged /usr.
    for d in ("usr/bin", "usr/sbin", "usr/lib", "usr/lib64", "etc", "proc", "sys", "dev",
              "run", "tmp", "var/log", "var/lib/rdmavirt", "root"):
        os.makedirs(os.path.join(stage, d), exist_ok=True)
    for link, target in (("bin", "usr/bin"), ("sbin", "usr/sbin"), ("lib", "usr/lib"),
                         ("lib64", "usr/lib64")):
        os.symlink(target, os.path.join(stage, link))

    def put(dst, src):
        # Under the real directory, with the name asked for (a soname).
        real_dir = os.path.realpath(os.path.dirname(dst))
        path = os.path.join(stage, real_dir.lstrip("/"), os.path.basename(dst))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        shutil.copy(src, path)

    for dst, src in progs.items():
        put(dst, src)
    elf = [src for src in progs.values()
           if open(src, "rb").read(4) == b"\x7fELF"]
    for lib in _libs(elf):
        put(lib, lib)
    labmod.stage_modules(kdir, stage)
    with open(os.path.join(stage, "etc/passwd"), "w") as f:
        f.write("root:x:0:0:root:/root:/bin/bash\n")
    with open(os.path.join(stage, "etc/group"), "w") as f:
        f.write("root:x:0:\n")
    shutil.copy("/etc/ld.so.conf", os.path.join(stage, "etc/ld.so.conf"))
    if os.path.isdir("/etc/ld.so.conf.d"):
        shutil.copytree("/etc/ld.so.conf.d", os.path.join(stage, "etc/ld.so.conf.d"))
    _run(["ldconfig", "-r", stage])
    labmod.pack_initramfs(stage, out)


# ------------------------------------------------------------ the lab

class VmLab:
    def __init__(self, directory=DEFAULT_DIR, build_dir=None):
        self.dir = os.path.abspath(directory)
        self.build = build_dir or os.environ.get("RDMAVIRT_BUILD_DIR",
                                                 os.path.join(PROJECT_DIR, "build"))
        self.ctl = os.path.join(self.build, "tools/rdmavirtctl/rdmavirtctl")

    # -- paths and names

    def hdir(self, h):
        return os.path.join(self.dir, f"vmhost{h}")

    def uri(self, h):
        return f"qemu+unix:///system?socket={self.hdir(h)}/run/libvirt-sock"

    def migrator(self, h):
        return f"127.0.0.1:{7710 + h}"

    def tls(self, h):
        return os.path.join(self.hdir(h), "tls")

    def console(self, name):
        return os.path.join(self.dir, f"{name}.console")

    # -- lifecycle

    def up(self, hosts=2):
        for tool in ("libvirtd", "virtlogd", "virsh", "qemu-system-x86_64", "unshare",
                     "cpio", "ldconfig"):
            if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
                raise VmLabError(f"{tool} not found: run tools/install-deps.sh")
        if os.path.exists(os.path.join(self.dir, "state.json")):
            self.down()
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        kdir = labmod.kernel_dir()
        self._certs()
        initrd = os.path.join(self.dir, "guest-initrd.img")
        t = time.monotonic()
        build_guest_initramfs(kdir, self.build, self._guest_tls, initrd)
        log(f"guest initramfs: {os.path.getsize(initrd) >> 20} MiB "
            f"in {time.monotonic() - t:.1f}s")
        state = {"hosts": hosts, "kernel": os.path.join(kdir, "vmlinuz"), "initrd": initrd,
                 "pids": []}
        self._save(state)
        _run(["ip", "link", "del", BRIDGE], check=False)
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "link", "set", BRIDGE, "up"])
        for h in range(1, hosts + 1):
            self._start_host(h, state)
            self._save(state)
        for h in range(1, hosts + 1):
            self._wait_libvirt(h)
            self.start_migrator(h)
        return state

    def _certs(self):
        certs = os.path.join(self.dir, "certs")
        tool = os.path.join(PROJECT_DIR, "tools/rdmavirt-certs")
        _run([tool, "--dir", certs, "ca"])
        ips = ["127.0.0.1"] + [guest_address(n) for n in range(1, MAX_GUESTS + 1)]
        for h in (1, 2, 3):
            ips += [f"10.79.{h}.{i}" for i in range(1, HOST_CAPACITY + 1)]
        _run([tool, "--dir", certs, "host", "guest"] + sum([["--ip", i] for i in ips], []))
        _run([tool, "--dir", certs, "client", "cli"])
        for h in (1, 2, 3):
            _run([tool, "--dir", certs, "host", f"vmhost{h}", "--ip", "127.0.0.1"])
        for h in (1, 2, 3):
            d = self.tls(h)
            os.makedirs(d)
            shutil.copy(f"{certs}/ca.pem", d)
            shutil.copy(f"{certs}/vmhost{h}.pem", f"{d}/host.pem")
            shutil.copy(f"{certs}/vmhost{h}.key", f"{d}/host.key")
            shutil.copy(f"{certs}/cli.pem", d)
            shutil.copy(f"{certs}/cli.key", d)
        # What the guests hold (build_guest_initramfs takes host.* from here).
        g = self.tls(1) + "-guest"
        os.makedirs(g)
        for f in ("ca.pem", "cli.pem", "cli.key"):
            shutil.copy(f"{certs}/{f}", g)
        shutil.copy(f"{certs}/guest.pem", f"{g}/host.pem")
        shutil.copy(f"{certs}/guest.key", f"{g}/host.key")
        self._guest_tls = g

    def _start_host(self, h, state):
        d = self.hdir(h)
        for sub in ("etc/libvirt/hooks/qemu.d", "run", "lib", "log", "cache", "state"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        with open(f"{d}/etc/libvirt/libvirtd.conf", "w") as f:
            f.write(f'host_uuid = "{uuid.uuid4()}"\n'
                    'unix_sock_group = "root"\nunix_sock_rw_perms = "0770"\n'
                    'log_outputs = "3:stderr"\n')
        with open(f"{d}/etc/libvirt/qemu.conf", "w") as f:
            f.write('user = "root"\ngroup = "root"\nsecurity_driver = "none"\n'
                    'dynamic_ownership = 0\nremember_owner = 0\n'
                    f'migration_port_min = {49152 + 100 * h}\n'
                    f'migration_port_max = {49152 + 100 * h + 63}\n')
        hook = f"{d}/etc/libvirt/hooks/qemu.d/rdmavirt"
        shutil.copy(os.path.join(PROJECT_DIR, "libvirt-hooks/qemu.d/rdmavirt"), hook)
        os.chmod(hook, 0o755)
        with open(f"{d}/etc/libvirt/hooks/rdmavirt.conf", "w") as f:
            f.write(f"RDMAVIRTCTL={self.ctl}\nMIGRATOR={self.migrator(h)}\n"
                    f"TLS_DIR={self.tls(h)}\nLOG={d}/hook.log\n")
        mounts = " && ".join(
            f"mount --bind {shlex.quote(os.path.join(d, src))} {dst}"
            for src, dst in (("etc/libvirt", "/etc/libvirt"), ("run", "/run/libvirt"),
                             ("lib", "/var/lib/libvirt"), ("log", "/var/log/libvirt"),
                             ("cache", "/var/cache/libvirt")))
        script = (f"mkdir -p /run/libvirt /var/lib/libvirt /var/log/libvirt /var/cache/libvirt"
                  f" && {mounts}"
                  f" && virtlogd -d -p {d}/virtlogd.pid"
                  f" && libvirtd -d -p {d}/libvirtd.pid"
                  f" && echo $$ > {d}/ns.pid && exec sleep infinity")
        p = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                              script], stdin=subprocess.DEVNULL,
                             stdout=open(f"{d}/daemons.log", "a"), stderr=subprocess.STDOUT,
                             start_new_session=True)
        state["pids"].append(p.pid)
        state.setdefault("ns", {})[str(h)] = p.pid

    def _wait_libvirt(self, h, timeout=60):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            r = subprocess.run(["virsh", "-c", self.uri(h), "version"], capture_output=True,
                               text=True, timeout=30)
            if r.returncode == 0:
                return
            time.sleep(0.5)
        raise VmLabError(f"vmhost{h}'s libvirtd does not answer at {self.uri(h)}: "
                         f"{open(self.hdir(h) + '/daemons.log').read()[-800:]}")

    def _ns_pid(self, h):
        return self._state()["ns"][str(h)]

    def in_host(self, h, cmd):
        """Runs `cmd` in vmhost`h`'s mount namespace."""
        return ["nsenter", "-t", str(self._ns_pid(h)), "-m", "--"] + cmd

    def start_migrator(self, h, guest_nics=True):
        """(Re)starts vmhost`h`'s migrator, with NICs for guests or without."""
        self.stop_migrator(h)
        d = self.hdir(h)
        cmd = [os.path.join(self.build, "migrator/rdmavirt-migratord"),
               "--listen", self.migrator(h), "--socket", f"{d}/migratord.sock",
               "--state-dir", f"{d}/state", "--tls-dir", self.tls(h),
               "--host-name", f"vmhost{h}"]
        if guest_nics:
            cmd += ["--guest-nic-bridge", BRIDGE, "--guest-nic-first",
                    f"10.79.{h}.1/{SUBNET_LEN}", "--guest-nic-capacity", str(HOST_CAPACITY)]
        p = subprocess.Popen(self.in_host(h, cmd), stdin=subprocess.DEVNULL,
                             stdout=open(f"{d}/migratord.log", "a"), stderr=subprocess.STDOUT,
                             start_new_session=True)
        st = self._state()
        st.setdefault("migrators", {})[str(h)] = p.pid
        st["pids"].append(p.pid)
        self._save(st)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            if self.rdmavirtctl(h, "host").returncode == 0:
                return
            if p.poll() is not None:
                break
            time.sleep(0.3)
        raise VmLabError(f"vmhost{h}'s migrator did not start: "
                         f"{open(d + '/migratord.log').read()[-800:]}")

    def stop_migrator(self, h):
        st = self._state()
        pid = st.get("migrators", {}).pop(str(h), None)
        if pid:
            _kill(pid, signal.SIGTERM)
            _wait_gone(pid, 10)
            self._save(st)

    def rdmavirtctl(self, h, *args, timeout=300):
        return subprocess.run([self.ctl, "--host", self.migrator(h), "--tls-dir", self.tls(h)]
                              + list(args), text=True, capture_output=True, timeout=timeout)

    def down(self):
        st = self._state()
        if st is None:
            return False
        for h in range(1, st.get("hosts", 0) + 1):
            r = subprocess.run(["virsh", "-c", self.uri(h), "list", "--name"],
                               capture_output=True, text=True, timeout=30)
            for name in r.stdout.split():
                subprocess.run(["virsh", "-c", self.uri(h), "destroy", name],
                               capture_output=True, timeout=30)
        for h in range(1, st.get("hosts", 0) + 1):
            for f in ("libvirtd.pid", "virtlogd.pid"):
                try:
                    _kill(int(open(os.path.join(self.hdir(h), f)).read()), signal.SIGTERM)
                except (OSError, ValueError):
                    pass
        for pid in st.get("pids", []):
            _kill(pid, signal.SIGTERM)
        # QEMUs of this lab whose daemon went first.
        subprocess.run(["pkill", "-KILL", "-f", f"qemu-system-x86_64.*{self.dir}/"],
                       capture_output=True)
        for pid in st.get("pids", []):
            _wait_gone(pid, 5)
            _kill(pid, signal.SIGKILL)
        _run(["ip", "link", "del", BRIDGE], check=False)
        os.remove(os.path.join(self.dir, "state.json"))
        return True

    # -- guests

    def domain_xml(self, name, n, memory_mb=768, disk=None):
        st = self._state()
        # A qcow2 disk holds internal snapshots (memory too). Both hosts
        # see the same file, shared storage in effect, but libvirt cannot
        # tell (a local filesystem) and calls a live migration unsafe: the
        # lab's migrations pass --unsafe.
        disk_xml = "" if disk is None else f"""
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2'/>
      <source file='{disk}'/>
      <target dev='vda' bus='virtio'/>
    </disk>"""
        return f"""<domain type='qemu'>
  <name>{name}</name>
  <memory unit='MiB'>{memory_mb}</memory>
  <vcpu>1</vcpu>
  <metadata><rdmavirt:guest xmlns:rdmavirt='{GUEST_NS}'/></metadata>
  <os>
    <type arch='x86_64' machine='pc'>hvm</type>
    <kernel>{st['kernel']}</kernel>
    <initrd>{st['initrd']}</initrd>
    <cmdline>console=ttyS0 panic=-1 loglevel=4 net.ifnames=0 rdmavirt.name={name} rdmavirt.nic={guest_mac(n)}={guest_address(n)}/{SUBNET_LEN}</cmdline>
  </os>
  <features><acpi/><apic/></features>
  <on_reboot>destroy</on_reboot>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>{disk_xml}
    <serial type='file'><source path='{self.console(name)}' append='on'/></serial>
    <channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/></channel>
    <interface type='bridge'>
      <source bridge='{BRIDGE}'/>
      <mac address='{guest_mac(n)}'/>
      <model type='virtio'/>
      <alias name='{NIC_ALIAS}'/>
    </interface>
    <memballoon model='none'/>
  </devices>
</domain>
"""

    def start_guest(self, h, name, n, timeout=180, disk=True):
        """Starts guest `name` (number n) on vmhost`h`, with a fresh qcow2
        disk if `disk`; returns once its agent and its migrator answer."""
        image = None
        if disk:
            image = os.path.join(self.dir, f"{name}.qcow2")
            _run(["qemu-img", "create", "-q", "-f", "qcow2", image, "64M"])
        path = os.path.join(self.dir, f"{name}.xml")
        with open(path, "w") as f:
            f.write(self.domain_xml(name, n, disk=image))
        self.virsh(h, "create", path)
        end = time.monotonic() + timeout
        last = None
        while time.monotonic() < end:
            try:
                r = self.guest_exec(h, name, ["/usr/local/bin/rdmavirtctl", "--tls-dir",
                                              "/etc/rdmavirt/tls", "host"], timeout=30)
                if r["exitcode"] == 0 and "rxe" in r["out"]:
                    return
                last = r
            except VmLabError as e:
                last = str(e)
            time.sleep(1)
        raise VmLabError(f"guest {name} not ready after {timeout}s: {last}\n--- console ---\n"
                         f"{_tail(self.console(name))}")

    def virsh(self, h, *args, check=True, timeout=120):
        return _run(["virsh", "-c", self.uri(h)] + list(args), check=check, timeout=timeout)

    def agent(self, h, name, command, timeout=30):
        r = self.virsh(h, "qemu-agent-command", name, json.dumps(command), timeout=timeout)
        return json.loads(r.stdout)["return"]

    def guest_spawn(self, h, name, argv, env=None):
        """Starts argv in the guest; returns the agent's pid for it."""
        args = {"path": argv[0], "arg": argv[1:], "capture-output": True}
        if env:
            args["env"] = env
        return self.agent(h, name, {"execute": "guest-exec", "arguments": args})["pid"]

    def guest_status(self, h, name, pid):
        """None while it runs, else {exitcode, out, err}."""
        r = self.agent(h, name, {"execute": "guest-exec-status", "arguments": {"pid": pid}})
        if not r.get("exited"):
            return None
        return {"exitcode": r.get("exitcode", 128 + r.get("signal", 0)),
                "out": base64.b64decode(r.get("out-data", "")).decode(errors="replace"),
                "err": base64.b64decode(r.get("err-data", "")).decode(errors="replace")}

    def guest_ip(self, h, name):
        """The guest's IPv4 address on its RDMA NIC (it changes when the
        guest moves)."""
        for iface in self.agent(h, name, {"execute": "guest-network-get-interfaces"}):
            if iface.get("name") == "lo":
                continue
            for a in iface.get("ip-addresses", []):
                if a.get("ip-address-type") == "ipv4":
                    return a["ip-address"]
        raise VmLabError(f"{name} has no IPv4 address")

    def guest_wait(self, h, name, pid, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            r = self.guest_status(h, name, pid)
            if r is not None:
                return r
            time.sleep(0.5)
        raise VmLabError(f"{name}: guest process {pid} still running after {timeout}s")

    def guest_exec(self, h, name, argv, env=None, timeout=60):
        return self.guest_wait(h, name, self.guest_spawn(h, name, argv, env), timeout)

    # -- state

    def _state(self):
        try:
            with open(os.path.join(self.dir, "state.json")) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def _save(self, st):
        tmp = os.path.join(self.dir, "state.json.tmp")
        with open(tmp, "w") as f:
            json.dump(st, f)
        os.replace(tmp, os.path.join(self.dir, "state.json"))


def _kill(pid, sig):
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_gone(pid, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
            # Reap it if it is our child.
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _tail(path, n=2000):
    try:
        return open(path, errors="replace").read()[-n:]
    except FileNotFoundError:
        return "(none)"


def main(argv):
    import argparse
    ap = argparse.ArgumentParser(prog="rdmavirt-vmlab", description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=DEFAULT_DIR)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up", help="two libvirt hosts with their migrators, no guests")
    sub.add_parser("down", help="destroy the guests, stop the daemons, remove the bridge")
    g = sub.add_parser("guest", help="start guestN on vmhostH")
    g.add_argument("host", type=int)
    g.add_argument("n", type=int)
    g.add_argument("--no-disk", action="store_true",
                   help="without the qcow2 disk that holds its snapshots")
    a = ap.parse_args(argv[1:])
    lab = VmLab(a.dir)
    try:
        if a.cmd == "up":
            lab.up()
            print(f"vmhost1: {lab.uri(1)}\nvmhost2: {lab.uri(2)}")
        elif a.cmd == "down":
            print("stopped" if lab.down() else "no VM lab running")
        elif a.cmd == "guest":
            lab.start_guest(a.host, f"guest{a.n}", a.n, disk=not a.no_disk)
            print(f"guest{a.n} runs on vmhost{a.host}")
    except labmod.LabError as e:
        print(f"rdmavirt-vmlab: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
