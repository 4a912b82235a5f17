"""Builds the Docker backend's base image locally (no registry): busybox-static for the
shell tools, the host's python3 with its standard library and shared libraries, and bash.

The root filesystem is written as a tar, cached by a hash of its inputs (re-runs reuse
it), and loaded with ``docker import`` into whichever daemon needs it.
"""
from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

from services.envsandbox.sandbox import SANDBOX_UID

BUILD_VERSION = "1"
REPOSITORY = "meridian-sandbox-base"
STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data", "site-packages", "dist-packages", "distutils"}
DYNLOAD_SKIP = ("_test", "_xx", "xxlimited", "_curses", "_dbm", "nis", "_ssl", "_hashlib", "readline", "_sqlite3", "_crypt", "ossaudiodev", "audioop", "_ctypes_test")


def _shared_libs(binary: str) -> list[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=False).stdout
    libs = []
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
            libs.append(parts[2])
        elif parts and parts[0].startswith("/"):
            libs.append(parts[0])
    return libs


def _inputs() -> dict[str, str]:
    """Image path → host path for every file the image holds."""
    busybox = shutil.which("busybox")
    if busybox is None:
        raise RuntimeError("the docker sandbox image needs busybox (apt package busybox-static)")
    # The system interpreter, the one sandboxed commands find on PATH in the process backend.
    python = os.path.realpath(shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "/usr/bin/python3")
    host_version = Path(python).name
    stdlib = Path(python).parent.parent / "lib" / host_version
    if not (stdlib / "os.py").is_file():
        raise RuntimeError(f"no standard library for {python} at {stdlib}")
    files = {"bin/busybox": busybox, f"usr/bin/{host_version}": python}
    bash = shutil.which("bash")
    binaries = [python]
    if bash:
        files["bin/bash"] = os.path.realpath(bash)
        binaries.append(files["bin/bash"])
    for root, dirs, names in os.walk(stdlib):
        rel_root = Path(root).relative_to(stdlib)
        dirs[:] = [d for d in dirs if d not in STDLIB_SKIP and not d.startswith("config-")]
        for name in names:
            if rel_root.name == "lib-dynload" and name.startswith(DYNLOAD_SKIP):
                continue
            host = Path(root) / name
            if host.is_file():
                files[f"{stdlib.relative_to('/')}/{rel_root / name}".replace("/./", "/")] = str(host)
                if rel_root.name == "lib-dynload":
                    binaries.append(str(host))
    for binary in binaries:
        for lib in _shared_libs(binary):
            files[lib.lstrip("/")] = os.path.realpath(lib)
    return files


def _applets(busybox: str) -> list[str]:
    out = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout
    return [a for a in out.split() if a and "/" not in a and a not in ("busybox", "bash")]


def image_tag(files: dict[str, str]) -> str:
    digest = hashlib.sha256(BUILD_VERSION.encode())
    for dst in sorted(files):
        st = os.stat(files[dst])
        digest.update(f"{dst}\0{st.st_size}\0{int(st.st_mtime)}\n".encode())
    return f"{REPOSITORY}:{digest.hexdigest()[:16]}"


def build_rootfs_tar(files: dict[str, str], out: Path) -> None:
    """Writes the image's root filesystem as a tar at ``out``."""
    tmp = out.with_suffix(".partial")
    with tarfile.open(tmp, "w") as tar:

        def add_dir(path: str, mode: int = 0o755, uid: int = 0) -> None:
            info = tarfile.TarInfo(path)
            info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, mode, uid, uid
            tar.addfile(info)

        def add_link(path: str, target: str) -> None:
            info = tarfile.TarInfo(path)
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
            tar.addfile(info)

        def add_text(path: str, text: str) -> None:
            data = text.encode()
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))

        made: set[str] = set()

        def ensure_parents(path: str) -> None:
            parts = path.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d not in made:
                    made.add(d)
                    add_dir(d)

        for d in ("bin", "usr", "usr/bin", "usr/local", "usr/local/bin", "etc", "dev", "proc", "sys", "root"):
            made.add(d)
            add_dir(d)
        made.update({"tmp", "workspace"})
        add_dir("tmp", 0o1777)
        add_dir("workspace", 0o755, SANDBOX_UID)
        for dst in sorted(files):
            ensure_parents(dst)
            info = tar.gettarinfo(files[dst], arcname=dst)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(files[dst], "rb") as fh:
                tar.addfile(info, fh)
        python = next(d for d in files if d.startswith("usr/bin/python"))
        add_link("usr/bin/python3", Path(python).name)
        add_link("usr/bin/python", Path(python).name)
        for applet in _applets(files["bin/busybox"]):
            if f"bin/{applet}" not in files:
                add_link(f"bin/{applet}", "busybox")
        add_link("usr/bin/env", "../../bin/busybox")
        add_text("etc/passwd", f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{SANDBOX_UID}:{SANDBOX_UID}::/workspace:/bin/sh\n")
        add_text("etc/group", f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\n")
        add_text("etc/hosts", "127.0.0.1 localhost\n")
    tmp.rename(out)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "meridian" / "sandbox-images"


def ensure_image(client, cache: Path | None = None) -> str:  # type: ignore[no-untyped-def]
    """The base image's tag in ``client``'s daemon, importing (and building) it when missing."""
    import docker

    files = _inputs()
    tag = image_tag(files)
    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    folder = cache or cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    tar_path = folder / (tag.replace(":", "-") + ".tar")
    if not tar_path.exists():
        build_rootfs_tar(files, tar_path)
    repository, _, version = tag.partition(":")
    with open(tar_path, "rb") as fh:
        client.api.import_image_from_data(fh.read(), repository=repository, tag=version)
    client.images.get(tag)
    return tag
