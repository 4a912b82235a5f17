"""An exec's cgroup removed by its sandbox's teardown while the exec's own cleanup kills it.

Close tears a sandbox down (killing and removing every cgroup below it) while the exec
that ran in it may be ending in another thread, killing its own cgroup. A full suite
saw that cleanup fail: it had opened ``cgroup.kill`` before the teardown removed the
cgroup and wrote after, and the kernel answers such a write with ENODEV. The race is
made certain here: the kill file is opened, the cgroup removed, then the write made.
"""
from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.envsandbox.cgroups import Cgroups


@pytest.fixture
def cgroups() -> Iterator[Cgroups]:
    try:
        groups = Cgroups()
    except OSError as exc:
        pytest.skip(f"no writable cgroups here: {exc}")
    if groups.kill_base is None:
        groups.remove_instance()
        pytest.skip("no cgroup2 hierarchy: execs have no cgroup of their own")
    yield groups
    groups.remove_instance()


def test_an_exec_cgroup_removed_between_open_and_write_of_its_kill_file_is_no_error(cgroups: Cgroups, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = cgroups.exec_group("sbx-race")
    assert folder is not None
    if not (folder / "cgroup.kill").exists():
        pytest.skip("a kernel without cgroup.kill (before 5.14): its execs are killed member by member")
    written = []
    real_write_text = Path.write_text

    def removed_after_open(path: Path, data: str, *args: object, **kwargs: object) -> int:
        if path.name != "cgroup.kill" or path.parent != folder:
            return real_write_text(path, data, *args, **kwargs)  # type: ignore[arg-type]
        with open(path, "w") as fh:
            folder.rmdir()  # what the teardown does between this open and the write
            try:
                fh.write(data)
                fh.flush()
            except OSError as exc:
                written.append(exc.errno)
                raise
        return len(data)

    monkeypatch.setattr(Path, "write_text", removed_after_open)
    cgroups.kill_exec(folder)
    assert written == [errno.ENODEV], "the kernel's answer to the race was not the one this test is about"
    assert not folder.exists()
