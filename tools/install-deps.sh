#!/usr/bin/env bash
# Installs the Debian 12 packages rdmavirt builds, tests and runs its lab with.
# Idempotent: runs `apt-get update` at most once per call and only when
# something is missing; installs only what is missing.
set -euo pipefail

packages=(
  # build
  build-essential cmake pkg-config git
  # verbs
  libibverbs-dev librdmacm-dev rdma-core ibverbs-utils rdmacm-utils
  ibverbs-providers perftest python3-pyverbs qperf libfabric-bin
  # protos and RPC
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libssl-dev openssl
  # page digests (header-only XXH3), migrator and shim
  libxxhash-dev
  # checkpoint/restore and VMs
  criu libprotobuf-c-dev libvirt-dev libvirt-daemon-system libvirt-clients
  # the VM lab's guests: their agent, copied into their initramfs
  qemu-guest-agent
  # tests and benchmarks
  libgtest-dev libgmock-dev libbenchmark-dev valgrind strace python3-matplotlib
  # bench-migration: the raw TCP rate between two lab hosts
  iperf3
  # fuzzing (tools/fuzz): clang with libFuzzer and the sanitizers' runtimes
  clang libclang-rt-14-dev
  # MPI over rxe0 in the lab (docs/mpi.md): Open MPI with UCX, NetPIPE,
  # and sshd for the launch (started only inside lab hosts); arping for
  # the service addresses of MPI daemons (tools/mpi/rdmavirt-mpi-orted)
  openmpi-bin libopenmpi-dev netpipe-openmpi openssh-server iputils-arping
  # an MPI program nobody here wrote, moved in the lab: ScaLAPACK's own
  # test of its LU solver (xdlu: each solution checked by its residual)
  scalapack-mpi-test scalapack-test-common
  # MPICH (Hydra, ch4 over UCX) beside Open MPI, which keeps the higher
  # priority of Debian's mpirun and mpicc alternatives
  mpich libmpich-dev
  # UCX's own benchmark (ucx_perftest), moved in the lab with UCP's default
  # configuration
  ucx-utils
  # the lab: TCG VMs on a VDE switch, booted from an initramfs
  qemu-system-x86 qemu-utils vde2 busybox-static cpio kmod iproute2 coreutils procps
  # the lab's fault tests cut the fabric between hosts with packet filters
  iptables
  # the inventory (docs/migrator.md): etcd for the tests and the lab
  etcd-server etcd-client
  # RDMA programs in containers: Podman with runc (Debian's crun is built
  # without CRIU, runc checkpoints through it), conmon, and the CNI plugins
  # Podman 4.3 networks with
  podman runc conmon golang-github-containers-common containernetworking-plugins
  python3
)

if [[ $(id -u) -ne 0 ]]; then
  echo "install-deps: must run as root (apt-get install)" >&2
  exit 1
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${#missing[@]} missing packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# libvirt-daemon-system's postinst tries to start services; without systemd
# that only warns, the lab starts the daemons itself.
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/tmp/rdmavirt-apt.log 2>&1 || {
  tail -n 30 /tmp/rdmavirt-apt.log >&2
  echo "install-deps: apt-get install failed (full log: /tmp/rdmavirt-apt.log)" >&2
  exit 1
}
echo "install-deps: done"
