"""The process backend's mount helper: it lives in a private mount namespace and builds
every sandbox's root filesystem there, so no sandbox mount ever appears on the host.

Started by the service as
``setpriv --pdeathsig KILL -- unshare --mount --propagation private -- python3 -I -S
mount_helper.py <mount dir> <first uid> <uid count> <launcher>``: it dies with the service,
and with it the namespace and every mount in it, so a killed service leaves no mount
behind. It reads one JSON request per line on stdin and answers one JSON line on stdout.
Standard library only.

Each sandbox root ``<mount dir>/<id>`` is a size-capped tmpfs (the disk cap: workspace and
/tmp live in it) holding read-only binds of the host's /usr, a minimal /etc (no shadow
file; a passwd entry per sandbox uid), a /dev with null, zero, full, random and urandom
only, a /dev/shm (a small tmpfs of its own, writable by all, like Docker's: POSIX shared
memory and semaphores, Python's multiprocessing locks among them, need it), and the
launcher at ``/.meridian/sandbox-exec`` (read-only, owned by root).
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
ETC_ALLOW = ("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "hosts", "nsswitch.conf", "localtime", "mime.types")
DEVICES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9)}
MERGED = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")

_libc = ctypes.CDLL(None, use_errno=True)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if _libc.mount(
        source.encode() if source else None,
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    ) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def bind_readonly(source: str, target: str) -> None:
    mount(source, target, None, MS_BIND)
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID)


LAUNCHER = "/.meridian/sandbox-exec"


class Helper:
    def __init__(self, mount_dir: str, first_uid: int, uid_count: int, launcher: str) -> None:
        self.dir = mount_dir
        self.uids = range(first_uid, first_uid + uid_count)
        self.launcher = launcher
        # The folder is a tmpfs of its own: nothing in it is visible outside this namespace.
        mount("meridian-sandboxes", self.dir, "tmpfs", MS_NOSUID, "mode=0711,size=64m")
        self.etc = os.path.join(self.dir, ".etc")
        self.dev = os.path.join(self.dir, ".dev")
        self._build_etc()
        self._build_dev()

    def _build_etc(self) -> None:
        os.mkdir(self.etc, 0o755)
        for name in ETC_ALLOW:
            src = os.path.join("/etc", name)
            dst = os.path.join(self.etc, name)
            if os.path.isdir(src) and not os.path.islink(src):
                shutil.copytree(src, dst, symlinks=True)
            elif os.path.lexists(src):
                shutil.copy2(src, dst, follow_symlinks=False)
        with open(os.path.join(self.etc, "passwd"), "w") as fh:
            fh.write("root:x:0:0:root:/root:/bin/sh\n")
            fh.writelines(f"sandbox{u - self.uids.start}:x:{u}:{u}::/workspace:/bin/sh\n" for u in self.uids)
            fh.write("nobody:x:65534:65534::/:/bin/false\n")
        with open(os.path.join(self.etc, "group"), "w") as fh:
            fh.write("root:x:0:\n")
            fh.writelines(f"sandbox{u - self.uids.start}:x:{u}:\n" for u in self.uids)
            fh.write("nogroup:x:65534:\n")
        with open(os.path.join(self.etc, "hostname"), "w") as fh:
            fh.write("sandbox\n")

    def _build_dev(self) -> None:
        os.mkdir(self.dev, 0o755)
        os.mkdir(os.path.join(self.dev, "shm"), 0o755)  # each sandbox mounts its own tmpfs on it
        for name, (major, minor) in DEVICES.items():
            path = os.path.join(self.dev, name)
            os.mknod(path, 0o666 | 0o020000, os.makedev(major, minor))
            os.chmod(path, 0o666)
        os.symlink("/proc/self/fd", os.path.join(self.dev, "fd"))
        for i, name in enumerate(("stdin", "stdout", "stderr")):
            os.symlink(f"/proc/self/fd/{i}", os.path.join(self.dev, name))

    def create(self, sandbox_id: str, disk_bytes: int, inodes: int, uid: int, shm_bytes: int, shm_inodes: int) -> dict:
        if uid not in self.uids:
            raise ValueError(f"uid {uid} is outside the sandbox uid range")
        root = os.path.join(self.dir, sandbox_id)
        os.mkdir(root, 0o755)
        mount("sandbox", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_bytes},nr_inodes={inodes},mode=0755")
        try:
            for name in ("usr", "etc", "dev", "proc", "tmp", "workspace", ".meridian"):
                os.mkdir(os.path.join(root, name), 0o755)
            launcher = root + LAUNCHER
            open(launcher, "w").close()
            bind_readonly(self.launcher, launcher)
            for name in MERGED:
                host = os.path.join("/", name)
                if os.path.islink(host):
                    os.symlink(os.readlink(host), os.path.join(root, name))
                elif os.path.isdir(host):
                    os.mkdir(os.path.join(root, name), 0o755)
                    bind_readonly(host, os.path.join(root, name))
            bind_readonly("/usr", os.path.join(root, "usr"))
            bind_readonly(self.etc, os.path.join(root, "etc"))
            mount(self.dev, os.path.join(root, "dev"), None, MS_BIND)
            mount(None, os.path.join(root, "dev"), None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
            mount("shm", os.path.join(root, "dev", "shm"), "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={shm_bytes},nr_inodes={shm_inodes},mode=1777")
            os.chmod(os.path.join(root, "tmp"), 0o1777)
            os.chown(os.path.join(root, "workspace"), uid, uid)
        except BaseException:
            self.destroy(sandbox_id)
            raise
        return {"root": root}

    def destroy(self, sandbox_id: str) -> dict:
        root = os.path.join(self.dir, sandbox_id)
        if os.path.ismount(root):
            # MNT_DETACH takes the binds below the root with it.
            if _libc.umount2(root.encode(), MNT_DETACH) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"umount {root}: {os.strerror(err)}")
        if os.path.isdir(root):
            os.rmdir(root)
        return {}

    def list(self) -> dict:
        return {"sandboxes": sorted(n for n in os.listdir(self.dir) if not n.startswith("."))}


def main() -> int:
    mount_dir, first_uid, uid_count, launcher = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    try:
        helper = Helper(mount_dir, first_uid, uid_count, launcher)
    except BaseException as exc:
        sys.stdout.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        sys.stdout.flush()
        return 1
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        seq = None
        try:
            request = json.loads(line)
            seq = request.pop("seq", None)
            op = request.pop("op")
            if op not in ("create", "destroy", "list"):
                raise ValueError(f"unknown op {op!r}")
            reply = getattr(helper, op)(**request)
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        # The request's number comes back with its reply: the service drops replies to
        # requests whose callers went away before reading them.
        sys.stdout.write(json.dumps({**reply, "seq": seq}) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
