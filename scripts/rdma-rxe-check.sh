#!/usr/bin/env bash
# rdma-rxe-check.sh — run the verbs RDMA driver's conformance suite over Soft-RoCE (rdma_rxe) on a
# machine that has the module but no RDMA NIC (the lent device machine, a Linux VM).
#
#   scripts/rdma-rxe-check.sh --prepare   (on a dev machine with libibverbs-dev: builds the
#                                          transport test binary with `--features rdma` and copies
#                                          it and Debian's libibverbs/rxe provider packages into
#                                          .rdma-out/, git-ignored; carry it to the other machine)
#   scripts/rdma-rxe-check.sh [OUT_DIR]   (as root on the machine to test: loads rdma_rxe, adds an
#                                          rxe device on loopback or, failing that, on a dummy
#                                          interface, and runs `conformance::rdma_verbs`)
#
# Prints "skipped: ..." and exits 0 when the machine has no rdma_rxe module (nothing was tested:
# the summary says so), exits 1 when the suite ran and failed. Bounded: the suite runs <= 180 s.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
say() { printf '\n==> %s\n' "$*"; }

if [ "${1:-}" = "--prepare" ]; then
  mkdir -p .rdma-out
  say "building the transport tests with --features rdma"
  bin=$(cargo test -q --release -p expertmesh-transport --features rdma --test it --no-run \
        --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "it":
        print(m["executable"])' | tail -1)
  [ -n "$bin" ] || { echo "rdma-rxe-check: FAILED: no test binary built"; exit 1; }
  cp "$bin" .rdma-out/transport-it && strip .rdma-out/transport-it
  say "fetching libibverbs, the rxe provider and ibv_devices (Debian packages)"
  (cd .rdma-out && apt-get download libibverbs1 ibverbs-providers ibverbs-utils libnl-3-200 \
     libnl-route-3-200 >/dev/null) || { echo "rdma-rxe-check: FAILED: apt-get download"; exit 1; }
  ls -la .rdma-out
  exit 0
fi

OUT_DIR=${1:-${OUT:-$ROOT/.rdma-out}}
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/rdma-rxe-check.log") 2>&1

say "RDMA devices before"
ls /sys/class/infiniband 2>/dev/null || echo "(no /sys/class/infiniband)"
command -v ibv_devices >/dev/null && ibv_devices
if ! modprobe rdma_rxe 2>/dev/null && [ ! -d /sys/module/rdma_rxe ]; then
  echo "kernel $(uname -r): $(ls /lib/modules/"$(uname -r)" 2>/dev/null | head -1 || echo 'no /lib/modules')"
  echo "skipped: no rdma_rxe module on this machine (kernel $(uname -r)): the verbs driver did not run"
  exit 0
fi
if [ ! -x .rdma-out/transport-it ]; then
  echo "rdma-rxe-check: FAILED: .rdma-out/transport-it missing: run --prepare and carry .rdma-out"
  exit 2
fi
if ! ldconfig -p | grep -q 'libibverbs.so.1 '; then
  say "installing libibverbs and the rxe provider from .rdma-out"
  for f in .rdma-out/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
command -v rdma >/dev/null || { echo "rdma-rxe-check: FAILED: no 'rdma' tool (iproute2)"; exit 2; }
BIND_IP=127.0.0.1
say "adding a Soft-RoCE device"
if ! rdma link add em_rxe0 type rxe netdev lo 2>/dev/null; then
  ip link add em_dummy0 type dummy && ip addr add 10.77.0.1/24 dev em_dummy0 &&
    ip link set em_dummy0 up && rdma link add em_rxe0 type rxe netdev em_dummy0 ||
    { echo "rdma-rxe-check: FAILED: could not add an rxe device"; exit 1; }
  BIND_IP=10.77.0.1
fi
rdma link show
command -v ibv_devices >/dev/null && ibv_devices
say "conformance suite over the verbs driver (listen address $BIND_IP)"
EM_TEST_BIND_IP=$BIND_IP timeout 180 .rdma-out/transport-it conformance::rdma_verbs --test-threads 1
rc=$?
say "summary"
if [ $rc -eq 0 ]; then
  echo "rdma-rxe-check: PASSED: conformance::rdma_verbs over Soft-RoCE"
else
  echo "rdma-rxe-check: FAILED (exit $rc)"
fi
exit $rc
