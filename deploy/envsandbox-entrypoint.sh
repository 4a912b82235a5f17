#!/bin/sh
# The envsandbox image's entry point: prepares what the process backend needs inside a
# container, says plainly what it cannot get, then runs the service ("$@").
#
# The backend puts every sandboxed command in fresh pid, mount, network, IPC and UTS
# namespaces under a private root, in a cgroup of its own (memory, pids, CPU, and one per
# exec to kill it whole), as a uid of its own with no capabilities and a seccomp filter
# (services/envsandbox/process_backend.py, cgroups.py). In a container that is not
# privileged the runtime mounts the cgroup file systems read-only, so:
#   1. every cgroup mount this container sees is remounted read-write. That is the
#      container's own subtree (its cgroup namespace on cgroup v2; on v1 the runtime binds
#      the container's cgroup there), so nothing outside the container becomes writable.
#      Needs CAP_SYS_ADMIN and, where AppArmor runs, a profile that allows mount(2)
#      (docker-compose.yml: cap_add SYS_ADMIN, security_opt apparmor=unconfined);
#   2. on cgroup v2 a cgroup holding processes cannot hand controllers to child cgroups
#      ("no internal processes"): every process of the container (this shell, and the
#      init process compose's `init: true` puts above it) moves into a leaf,
#      /sys/fs/cgroup/service; the service this shell execs stays there, so the backend
#      can enable memory, pids and cpu for the sandboxes' cgroups beside it.
# Then it checks that a cgroup can be made and that new namespaces can be entered. If not,
# it prints why, in one block, and exits 78 (EX_CONFIG): a sandbox service that runs
# model-written code without its isolation must not report SERVING. Set
# MERIDIAN_ENVSANDBOX_SKIP_PREFLIGHT=1 to leave the decision to the service's own checks.
set -u

say() { echo "envsandbox-entrypoint: $*" >&2; }
problems=""
problem() { problems="${problems}  - $*
"; }

if [ "$(id -u)" != 0 ]; then
  problem "not running as root (uid $(id -u)): the process backend needs root in the container"
fi

# 1. cgroup mounts read-write.
cgroup_mounts=$(while read -r _dev mnt fstype _rest; do
  case "$fstype" in cgroup|cgroup2) echo "$mnt" ;; esac
done < /proc/self/mounts)
if [ -z "$cgroup_mounts" ]; then
  problem "no cgroup file system is mounted in this container"
fi
for m in $cgroup_mounts; do
  if mount -o remount,rw "$m" 2>/dev/null || mount -o remount,bind,rw "$m" 2>/dev/null; then
    :
  else
    problem "cannot remount $m read-write (needs CAP_SYS_ADMIN, and mount(2) allowed by AppArmor/seccomp: cap_add SYS_ADMIN, security_opt apparmor=unconfined)"
  fi
done

# 2. cgroup v2: the service in a leaf cgroup of its own.
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
  version=2
  moved=0
  if mkdir -p /sys/fs/cgroup/service 2>/dev/null; then
    moved=1
    for pid in $(cat /sys/fs/cgroup/cgroup.procs); do
      echo "$pid" > /sys/fs/cgroup/service/cgroup.procs 2>/dev/null || moved=0
    done
  fi
  if [ "$moved" != 1 ]; then
    problem "cgroup v2: cannot move the service into /sys/fs/cgroup/service (the sandboxes' cgroups would get no controllers)"
  fi
  probe_parents=/sys/fs/cgroup
else
  version=1
  probe_parents="/sys/fs/cgroup/memory /sys/fs/cgroup/pids /sys/fs/cgroup/cpu"
fi

# 3. Preflight: a cgroup can be made, and namespaces entered, as the backend will.
for parent in $probe_parents; do
  probe="$parent/meridian-entrypoint-probe-$$"
  if mkdir "$probe" 2>/dev/null; then
    rmdir "$probe"
  else
    problem "cgroup v$version: cannot create a cgroup under $parent (read-only, not mounted or not delegated)"
  fi
done
if ! unshare --pid --fork --mount --net --ipc --uts true 2>/dev/null; then
  problem "cannot enter new pid/mount/net/ipc/uts namespaces (unshare(2) needs CAP_SYS_ADMIN; a seccomp profile may forbid it)"
fi
if ! unshare --mount sh -c 'mount -t tmpfs -o size=1m none /mnt && umount /mnt' 2>/dev/null; then
  problem "cannot mount a tmpfs in a new mount namespace (AppArmor's default container profile forbids mount(2): security_opt apparmor=unconfined)"
fi

if [ -n "$problems" ]; then
  say "THIS CONTAINER CANNOT ISOLATE SANDBOXES (cgroup v$version):"
  printf '%s' "$problems" >&2
  if [ "${MERIDIAN_ENVSANDBOX_SKIP_PREFLIGHT:-0}" != 1 ]; then
    say "not starting the service (MERIDIAN_ENVSANDBOX_SKIP_PREFLIGHT=1 leaves it to the service)"
    exit 78
  fi
else
  say "isolation ready: cgroup v$version read-write, namespaces and mounts allowed"
fi
exec "$@"
