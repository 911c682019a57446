"""The runtime store is content-addressed (backends/linux/store_objects.py): two venvs with the same
packages share their files, and the cleanup (store_collect.py) removes parts no server holds, never a
held one. Real venvs (python -m venv, pip from its bundled wheel, compiled at their own paths), real
builds, real hard links."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentcell.backends.linux import runtime_store, store_collect
from agentcell.backends.linux.runtime_store import Layout, Part

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the runtime store is root's")

TARGET = "/opt/agentcell/venv"


@pytest.fixture
def place() -> Iterator[Path]:
    """A root-only directory on the store's filesystem (hard links need it), removed afterwards."""
    path = Path(f"/var/lib/agentcell-test-store-{os.getpid()}")
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _venv(path: Path) -> Path:
    """A fresh venv with pip (from the interpreter's bundled wheel: no network), compiled at `path`."""
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(path)], check=True, capture_output=True,
                   env={**os.environ, "PIP_NO_INDEX": "1"})
    assert list(path.glob("lib/python3*/site-packages/pip/__pycache__/*.pyc"))
    return path


def _layout(source: Path, name: str = "venv", target: str = TARGET) -> Layout:
    part = Part(name, str(source.resolve()), target)
    return Layout((part,), f"{target}/bin/python", "/opt/agentcell/lib", ((str(source.resolve()), target),), None)


def _files(part_dir: str) -> dict[str, os.stat_result]:
    out = {}
    for dirpath, _dirs, names in os.walk(part_dir):
        for n in names:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            if os.path.isfile(p) and not os.path.islink(p):
                out[os.path.relpath(p, part_dir)] = st
    return out


def test_two_venvs_of_the_same_packages_share_their_files(place: Path) -> None:
    root = str(place / "store")
    one, two = _venv(place / "one"), _venv(place / "two")
    first = runtime_store.ensure(_layout(one), root=root, collect="never")
    size_one, _ = store_collect.usage(root)
    second = runtime_store.ensure(_layout(two), root=root, collect="never")
    size_two, parts = store_collect.usage(root)
    try:
        (dir_one, _), (dir_two, _) = first.mounts[0], second.mounts[0]
        assert dir_one != dir_two and parts == 2  # two venvs at two paths: two parts ...
        a, b = _files(dir_one), _files(dir_two)
        assert a.keys() == b.keys() and len(a) > 500
        shared = [rel for rel in a if a[rel].st_ino == b[rel].st_ino]
        # ... of the same files: every one whose content is equal once the venv's path is the neutral
        # one, the rewritten .pyc files (their code names the venv's path) and scripts (their shebang)
        # included; not the few that differ even so (activate's prompt names the venv's directory)
        for rel in set(a) - set(shared):
            assert Path(dir_one, rel).read_bytes() != Path(dir_two, rel).read_bytes(), rel
        assert len(shared) > 0.99 * len(a), sorted(set(a) - set(shared))
        assert any(rel.endswith(".pyc") for rel in shared) and "bin/pip" in shared
        # the second venv added its directories, links and those few files, nothing else
        assert size_one > 5 << 20 and size_two - size_one < size_one // 100, (size_one, size_two)  # pip's RECORD, activate
        # and nothing of either names a host path
        for rel in a:
            if rel.endswith((".pyc", ".py", ".cfg")) or rel.startswith("bin/"):
                data = Path(dir_two, rel).read_bytes()
                assert str(one).encode() not in data and str(two).encode() not in data, rel
        # a .pyc of the second is valid for its source as placed (else every import would compile)
        pyc = next(rel for rel in b if rel.endswith(".pyc") and "/pip/__pycache__/__init__" in rel)
        src = os.path.join(dir_two, os.path.dirname(os.path.dirname(pyc)), "__init__.py")
        header = Path(dir_two, pyc).read_bytes()[:16]
        st = os.stat(src)
        assert int.from_bytes(header[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
        assert int.from_bytes(header[12:16], "little") == st.st_size
    finally:
        first.close()
        second.close()


def test_an_unchanged_start_reads_nothing_and_an_edit_is_seen(place: Path) -> None:
    root = str(place / "store")
    tree = place / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "a.py").write_text("A = 1\n")
    (tree / "pkg" / "b.txt").write_text(f"lives in {tree}/pkg\n")  # names its host path: rewritten
    layout = _layout(tree, target="/opt/agentcell/lib/tree")
    s1 = runtime_store.ensure(layout, root=root, collect="never")
    s1.close()
    hashes = runtime_store.HashCache(os.path.join(root, "hashes"))
    assert len(hashes.entries) >= 2
    s2 = runtime_store.ensure(layout, root=root, collect="never")
    s2.close()
    assert s2.mounts == s1.mounts  # same key: nothing rebuilt
    assert Path(s2.mounts[0][0], "pkg/b.txt").read_text() == "lives in /opt/agentcell/lib/tree/pkg\n"
    time.sleep(0.01)
    (tree / "pkg" / "a.py").write_text("A = 2\n")  # an edit: a new part, with the new content
    s3 = runtime_store.ensure(layout, root=root, collect="never")
    s3.close()
    assert s3.mounts != s1.mounts
    assert Path(s3.mounts[0][0], "pkg/a.py").read_text() == "A = 2\n"
    # (the old part links the edited file's inode: an edit in place shows there too, as it did in the
    # host's tree; pip replaces files instead, and docs/host-changes.md says so)


def test_cleanup_removes_unheld_parts_beyond_the_budget_and_never_a_held_one(place: Path) -> None:
    root = str(place / "store")
    trees = []
    for name in ("held", "old", "unheld"):
        tree = place / name
        tree.mkdir()
        (tree / "data.bin").write_bytes(os.urandom(200_000))  # its own content: only its part names it
        (tree / "common.txt").write_text("the same in every tree\n")
        trees.append(tree)
    held = runtime_store.ensure(_layout(trees[0], "held"), root=root, collect="never")
    try:
        for tree, name in zip(trees[1:], ("old", "unheld"), strict=True):
            runtime_store.ensure(_layout(tree, name), root=root, collect="never").close()
        names = store_collect.part_names(root)
        assert len(names) == 3
        old = next(n for n in names if n.startswith("old-"))
        long_ago = time.time() - store_collect.KEEP_UNUSED_S - 60
        os.utime(os.path.join(root, old + ".lock"), (long_ago, long_ago))

        # a large budget: only the part unused for a day goes (age)
        out = store_collect.collect(root, keep=set(), max_bytes=1 << 40)
        assert out.removed_parts == [old] and out.removed_objects == 1, out
        assert {n.split("-")[0] for n in store_collect.part_names(root)} == {"held", "unheld"}

        # no budget at all: every part no server holds goes, the held one stays, whole
        out = store_collect.collect(root, keep=set(), max_bytes=0)
        assert [n.split("-")[0] for n in out.removed_parts] == ["unheld"], out
        assert out.over_budget  # what is left is held
        (held_dir, _), = held.mounts
        assert [n for n in store_collect.part_names(root)] == [os.path.basename(held_dir)]
        assert Path(held_dir, "data.bin").read_bytes() == (trees[0] / "data.bin").read_bytes()
        assert Path(held_dir, "common.txt").read_text() == "the same in every tree\n"
        objects = sum(len(files) for _, _, files in os.walk(os.path.join(root, "objects")))
        assert objects == 2  # the held part's two; the others' own data went with them
    finally:
        held.close()
    out = store_collect.collect(root, keep=set(), max_bytes=0)  # no longer held: now it goes too
    assert len(out.removed_parts) == 1 and store_collect.part_names(root) == []


def test_a_users_files_are_never_shared_with_another_venvs_part(place: Path) -> None:
    """A file its owner (not root) can change in place must not reach the part of a server running from
    another venv: only rewritten copies (the store's own, root's) are shared between such trees."""
    root = str(place / "store")
    trees = []
    for name in ("mine", "theirs"):
        tree = place / name
        tree.mkdir()
        (tree / "same.py").write_text("X = 1\n")
        (tree / "names.txt").write_text(f"{tree}/x\n")  # rewritten: equal once neutral
        for f in tree.iterdir():
            os.chown(f, 12345, 12345)
        trees.append(tree)
    a = runtime_store.ensure(_layout(trees[0], target="/opt/agentcell/lib/t"), root=root, collect="never")
    b = runtime_store.ensure(_layout(trees[1], target="/opt/agentcell/lib/t"), root=root, collect="never")
    try:
        (dir_a, _), (dir_b, _) = a.mounts[0], b.mounts[0]
        assert os.stat(Path(dir_a, "same.py")).st_ino == os.stat(trees[0] / "same.py").st_ino  # its own file
        assert os.stat(Path(dir_b, "same.py")).st_ino == os.stat(trees[1] / "same.py").st_ino  # not mine
        assert os.stat(Path(dir_a, "names.txt")).st_ino == os.stat(Path(dir_b, "names.txt")).st_ino  # the store's
        assert os.stat(Path(dir_b, "names.txt")).st_uid == 0
    finally:
        a.close()
        b.close()


def test_two_worker_processes_build_what_one_builds(place: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """store_workers.py: a part placed by two processes has the same content as one placed by one, and
    every .pyc stays valid for its source as placed (the worker that places a .pyc placed its source)."""
    from agentcell.backends.linux import store_workers

    venv = _venv(place / "venv")
    parts = []
    for workers, min_files in ((1, 10**9), (2, 1)):
        monkeypatch.setattr(store_workers, "MIN_FILES", min_files)
        store = runtime_store.ensure(_layout(venv), root=str(place / f"store{workers}"), collect="never")
        store.close()
        parts.append(store.mounts[0][0])
    one, two = (_files(p) for p in parts)
    assert one.keys() == two.keys() and len(one) > 500
    for rel in one:
        a, b = Path(parts[0], rel).read_bytes(), Path(parts[1], rel).read_bytes()
        if rel.endswith(".pyc"):
            src = os.path.join(parts[1], os.path.dirname(os.path.dirname(rel)), rel.rsplit("/", 1)[1].split(".")[0] + ".py")
            st = os.stat(src)
            assert int.from_bytes(b[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF, rel
            a, b = a[16:], b[16:]
        assert a == b, rel


def test_an_unchanged_start_waits_for_no_build_or_collection_and_notes_its_parts(place: Path) -> None:
    """Another server's build or collection holds the store's build lock for seconds: a start whose
    parts are all there does not wait for it (it takes only its parts' shared locks); one with a part
    to build does. Either way the start notes its parts for the next one's early zygote (last_store)."""
    import fcntl
    import threading

    root = str(place / "store")
    tree = place / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "a.py").write_text("A = 1\n")
    layout = _layout(tree, target="/opt/agentcell/lib/tree")
    assert runtime_store.last_store(layout, root=root) is None  # no start yet
    first = runtime_store.ensure(layout, root=root, collect="never")
    first.close()
    noted = runtime_store.last_store(layout, root=root)
    assert noted is not None and noted.mounts == first.mounts
    noted.close()

    lock = os.open(os.path.join(root, ".build.lock"), os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)  # a build or collection under way
    try:
        done: list[runtime_store.Store] = []
        t = threading.Thread(target=lambda: done.append(runtime_store.ensure(layout, root=root, collect="never")))
        t.start()
        t.join(30)
        assert done and done[0].mounts == first.mounts, "an unchanged start waited for the build lock"
        done[0].close()

        (tree / "pkg" / "a.py").write_text("A = 2\n")  # now a part must be built: that waits
        t = threading.Thread(target=lambda: done.append(runtime_store.ensure(layout, root=root, collect="never")))
        t.start()
        t.join(1.0)
        assert t.is_alive() and len(done) == 1
    finally:
        os.close(lock)
    t.join(60)
    assert len(done) == 2 and done[1].mounts != first.mounts
    done[1].close()
    changed = runtime_store.last_store(layout, root=root)
    assert changed is not None and changed.mounts == done[1].mounts
    changed.close()


PEAK_KIB = r"""
def peak_kib():  # this process's own peak (ru_maxrss would start at the parent's: it survives exec)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
"""

SCAN_CHILD = PEAK_KIB + r"""
import os, sys, threading
from pathlib import Path
from agentcell.backends.linux import runtime_store
from agentcell.backends.linux.runtime_store import Layout, Part
root, tree = sys.argv[1], sys.argv[2]
part = Part("small", tree, "/opt/agentcell/lib/small")
layout = Layout((part,), "/opt/agentcell/lib/small/python", "/opt/agentcell/lib", ((tree, part.target),), None)
before = peak_kib()
store = runtime_store.ensure(layout, root=root, collect="background", log=lambda m: print(m, file=sys.stderr))
for t in threading.enumerate():
    if t.name == "agentcell-store-collect":
        t.join()
print((peak_kib() - before) // 1024)
store.close()
"""


def test_a_servers_background_collection_scans_in_a_process_of_its_own(place: Path) -> None:
    """A server collects the store in the background after a start. The scan reads every part's list of
    objects: on a store many venvs used, hundreds of thousands of names. Done in the server's own heap, it stayed there as the allocators' high-water mark for the server's life (the soak,
    docs/reliability.md); done in a process of its own, the server's peak does not move."""
    root = place / "store"
    root.mkdir(mode=0o700)
    tree = place / "small"
    tree.mkdir()
    (tree / "python").write_text("a file\n")
    # 8 parts no server holds, used just now (kept: the scan must still read their lists), 50,000 names each
    for i in range(8):
        name = f"listed{i}-{i:016x}"
        (root / name).mkdir()
        (root / f"{name}.lock").touch()
        names = (f"{i:02x}{n:062x}" for n in range(50_000))
        (root / f"{name}{store_collect.MANIFEST}").write_text("\n".join(names) + "\n")
    old = root / "old-0000000000000000"  # one unused for over a day: the collection must remove it
    old.mkdir()
    (root / f"{old.name}{store_collect.MANIFEST}").write_text("")
    (root / f"{old.name}.lock").touch()
    long_ago = time.time() - store_collect.KEEP_UNUSED_S - 60
    os.utime(root / f"{old.name}.lock", (long_ago, long_ago))

    done = subprocess.run([sys.executable, "-c", SCAN_CHILD, str(root), str(tree)], capture_output=True, text=True,
                          timeout=300, check=True)
    assert not old.exists(), done.stderr  # the collection ran, and did its work
    assert (root / ".collected").exists()
    assert all((root / f"listed{i}-{i:016x}").is_dir() for i in range(8))
    grew_mib = int(done.stdout)
    # in the calling process the scan raised the peak by 76 MiB here (400,000 names as a set, each list read)
    assert grew_mib < 20, f"the server's peak RSS grew {grew_mib} MiB during the background collection"


BUILD_CHILD = PEAK_KIB + r"""
import sys
from agentcell.backends.linux import runtime_store
from agentcell.backends.linux.runtime_store import Layout, Part
root, tree = sys.argv[1], sys.argv[2]
part = Part("small", tree, "/opt/agentcell/lib/small")
layout = Layout((part,), "/opt/agentcell/lib/small/python", "/opt/agentcell/lib", ((tree, part.target),), None)
before = peak_kib()
store = runtime_store.ensure(layout, root=root, collect="never")
print((peak_kib() - before) // 1024)
print(store.mounts[0][0])
store.close()
"""


def test_a_start_that_builds_reads_the_hash_cache_in_a_process_of_its_own(place: Path) -> None:
    """A start whose parts changed reads the store's hash cache (one entry per file any venv on the host
    had: 904,963 on this host after two days of test runs, a 68 MB file). In the server's process it
    raised the peak by hundreds of MB and left ~17 MiB in its RSS for good (the soak,
    docs/reliability.md); built in a process of its own, the server's peak does not move."""
    import marshal

    root = place / "store"
    root.mkdir(mode=0o700)
    today = int(time.time()) // 86400
    cache = {(1, ino, 4096, 1_700_000_000_000_000_000 + ino): (ino.to_bytes(32, "big"), today)
             for ino in range(300_000)}
    (root / "hashes").write_bytes(marshal.dumps(cache))
    del cache
    tree = place / "small"
    tree.mkdir()
    (tree / "python").write_text("a file\n")
    (tree / "data.txt").write_text("some data\n")

    done = subprocess.run([sys.executable, "-c", BUILD_CHILD, str(root), str(tree)], capture_output=True, text=True,
                          timeout=300, check=True)
    grew, part_dir = done.stdout.split()
    assert Path(part_dir, "data.txt").read_text() == "some data\n"  # built, and whole
    entries = marshal.loads((root / "hashes").read_bytes())
    assert len(entries) == 300_002  # the cache kept, with the new part's two files added
    # in the calling process the cache raised the peak by 127 MiB here (300,000 entries as Python objects)
    assert int(grew) < 20, f"the server's peak RSS grew {grew} MiB while a part was built"
