#!/usr/bin/env bash
# Run a command while every `expertmesh worker --device <node>/cpuN` process it starts is held to
# a fixed share of one CPU (a cgroup per device, CPU quota FRACTION of a core): emulated devices
# of fixed compute, as `tc` emulates NICs in `bench cluster`. Used to check the planner's
# device-load model where the devices, not the host's shared cores, bind (`bench rebalance` on
# a 2-vCPU machine runs the router, the frontends and both workers on the same two cores).
#
#   sudo scripts/cap-workers.sh 0.5 ./target/release/expertmesh bench rebalance --seconds 6
#
# Needs root and a writable cgroup CPU controller (cgroup v1 `cpu`, or v2 with the `cpu`
# controller enabled for the root's children); it says so and exits 2 otherwise. The cgroups
# (`expertmesh-cap-<pid>-<device>`) are removed at the end.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 FRACTION COMMAND [ARGS...]   (FRACTION of one CPU per worker, e.g. 0.5)" >&2
    exit 2
fi
fraction=$1
shift
period=100000
quota=$(python3 -c "import sys; f=float(sys.argv[1]); assert 0.01 <= f <= 64; print(int(f*$period))" "$fraction" 2>/dev/null) || {
    echo "FRACTION must be a number in [0.01, 64]" >&2
    exit 2
}
if [ -d /sys/fs/cgroup/cpu ] && [ -w /sys/fs/cgroup/cpu ]; then
    base=/sys/fs/cgroup/cpu
    v=1
elif [ -f /sys/fs/cgroup/cgroup.controllers ] && [ -w /sys/fs/cgroup ]; then
    base=/sys/fs/cgroup
    v=2
    grep -qw cpu /sys/fs/cgroup/cgroup.subtree_control || echo +cpu > /sys/fs/cgroup/cgroup.subtree_control || {
        echo "cannot enable the cgroup v2 cpu controller (run as root on a host that allows it)" >&2
        exit 2
    }
else
    echo "no writable cgroup CPU controller here (needs root: /sys/fs/cgroup/cpu or cgroup v2)" >&2
    exit 2
fi
prefix="expertmesh-cap-$$"
group() { # device label -> cgroup dir, made on first use (in the watcher's subshell)
    local dir="$base/$prefix-${1//\//-}"
    if [ ! -d "$dir" ]; then
        mkdir "$dir"
        if [ $v = 1 ]; then
            echo $period > "$dir/cpu.cfs_period_us"
            echo "$quota" > "$dir/cpu.cfs_quota_us"
        else
            echo "$quota $period" > "$dir/cpu.max"
        fi
    fi
    echo "$dir"
}
cleanup() {
    kill "$watch" 2>/dev/null || true
    wait "$watch" 2>/dev/null || true
    for d in "$base/$prefix"-*; do
        [ -d "$d" ] || continue
        # Processes still inside go back to the root group first.
        while read -r p; do echo "$p" > "$base/cgroup.procs" 2>/dev/null || true; done < "$d/cgroup.procs" 2>/dev/null || true
        rmdir "$d" 2>/dev/null || true
    done
}
(
    while true; do
        for pid in $(pgrep -f "expertmesh worker" || true); do
            dev=$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -o -- "--device [^ ]*" | head -1 | cut -d' ' -f2) || true
            [ -n "$dev" ] || continue
            echo "$pid" > "$(group "$dev")/cgroup.procs" 2>/dev/null || true
        done
        sleep 0.05
    done
) &
watch=$!
trap cleanup EXIT
"$@"
