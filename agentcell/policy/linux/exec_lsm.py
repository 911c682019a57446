"""Which files a sandbox's processes may start as programs, decided in the kernel: BPF LSM programs
(bpf/exec_policy.bpf.c) loaded once per server, holding each sandbox's verdicts on the files
themselves (their inodes), not on their names.

A sandbox is a *slot* (0..SLOTS-1): its host uids map to it and to its default mode (allow, deny,
ask); a file's verdict for a slot is a bit of its inode's storage (allow, deny), or a one-shot entry
(once, consumed by the exec it lets through). Because the verdict is the inode's:

* every name of a marked file (a hard link, a symlink, /proc/self/fd/N, another mount of it) carries
  it, and a copy of it is a new file, which under default deny is refused;
* a marked file must stay in memory, or its inode (an overlayfs inode is per sandbox) is evicted and
  its verdicts with it: the server pins each with an O_PATH fd, per slot (at most MAX_FILES per slot),
  until the slot drops it (mark(..., None), remove_sandbox).

What the kernel refuses (EACCES, which a shell prints as "Permission denied"), for a sandbox's process:
exec (every round: a script's interpreter too) of a file denied, or not allowed under default deny or
ask; the ELF loader exec'd directly (`ld.so /bin/x`) unless the mode is allow; and a PROT_EXEC mapping
(mmap, mprotect) of a file denied (`ld.so /bin/denied` under default allow). Scripts pass ("#!": their
interpreter decides). Each refusal is written to a ring buffer (`fileno()`, `read_refusals()`).

Limits: a program the policy lets run may still run code it reads (an allowed python3 can run any
script, and can copy a file's machine code into memory of its own and jump there): exec rules decide
which programs start, not what code runs. A deny-list under default allow is a name list: a copy of
a denied file is a new, unmarked file. A file_mprotect of a mapping of an overlayfs file sees the
file's upper/lower file, not the one marked: an mprotect(PROT_EXEC) of a denied file's read-only
mapping under an overlay is not refused (its mmap(PROT_EXEC) is).

Needs: root, a kernel with BPF LSM active (CONFIG_BPF_LSM=y and "bpf" in the lsm= list), BTF, libbpf,
and the compiled programs (shipped in a wheel, else clang): ExecPolicyUnavailable otherwise.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from agentcell.backends.linux import syscalls as sc
from agentcell.errors import BackendUnavailableError, ResourceExhaustedError
from agentcell.record.linux import bpf_objects

SOURCE = Path(__file__).parent / "bpf" / "exec_policy.bpf.c"
CACHE = Path(os.environ.get("AGENTCELL_BPF_CACHE", "/var/cache/agentcell/bpf"))
SLOTS = 1024  # bpf source: SLOTS
MAX_FILES = 1024  # files one slot may mark (each pinned by an fd of the server)
MODES = {"allow": 0, "deny": 1, "ask": 2}  # bpf source: MODE_*
VERDICTS = ("allow", "deny", "once")
HOOKS = {1: "exec", 2: "mmap", 3: "mprotect"}  # bpf source: H_*
F_LOADER = 1
LSM_FILE = "/sys/kernel/security/lsm"
_WORDS = SLOTS // 64
_MARKS = struct.Struct(f"={_WORDS}Q{_WORDS}QII")  # struct marks: allow[], deny[], flags, id
_REFUSAL = struct.Struct("=QIIIIII16s256s")  # struct refusal
_CLONE_FS = 0x200
REFUSED_LOAD = ("this kernel refuses to load BPF LSM programs (EPERM to root, whose BPF LSM is listed active): "
                "its build or its hypervisor forbids BPF trampolines (fentry programs are refused alike), so "
                "exec rules cannot be enforced on this host")


class ExecPolicyUnavailable(BackendUnavailableError):
    """This host cannot enforce exec rules (no BPF LSM, not root, no BTF/libbpf/clang); the message says
    what is missing."""


class ExecPolicyFull(ResourceExhaustedError):
    """No free slot, or a slot marked MAX_FILES files already."""


class Refusal(NamedTuple):
    monotonic_ns: int
    uid: int  # host uid
    host_pid: int  # the refused process (tgid)
    slot: int
    hook: str  # exec, mmap, mprotect
    file_id: int  # the file's id in the policy's storage (0: a file without marks)
    comm: str  # the process's name before the exec
    name: str  # exec: the path as exec'd (a script's interpreter: its path); mmap/mprotect: the file's name


@dataclass
class _Slot:
    uids: tuple[int, ...]
    mode: str
    pins: dict[int, int] = field(default_factory=dict)  # file id -> the server's O_PATH fd of the file
    loaders: set[int] = field(default_factory=set)  # file ids it marked as loaders


def lsm_list() -> list[str]:
    """The kernel's active LSMs. securityfs is often not mounted (a container, no systemd): then it is
    mounted in a private mount namespace of a short-lived thread, read there, and gone with it."""
    try:
        return Path(LSM_FILE).read_text().strip().split(",")
    except FileNotFoundError:
        pass
    got: list[str | OSError] = []

    def read() -> None:
        try:
            sc.unshare(sc.CLONE_NEWNS | _CLONE_FS)  # this thread's own mounts from now on
            sc.mount(None, "/", None, sc.MS_REC | sc.MS_PRIVATE)
            sc.mount("securityfs", "/sys/kernel/security", "securityfs", sc.MS_NOSUID | sc.MS_NODEV | sc.MS_NOEXEC)
            got.append(Path(LSM_FILE).read_text())
        except OSError as e:
            got.append(e)

    t = threading.Thread(target=read, name="lsm-list")
    t.start()
    t.join()
    if isinstance(got[0], OSError):
        raise got[0]
    return got[0].strip().split(",")


def check_host() -> None:
    """ExecPolicyUnavailable, saying what is missing, unless this host can enforce exec rules."""
    if os.geteuid() != 0:
        raise ExecPolicyUnavailable("exec rules need the server to run as root (BPF LSM programs); rootless "
                                    "servers cannot enforce them")
    if not Path("/sys/kernel/btf/vmlinux").exists():
        raise ExecPolicyUnavailable("exec rules need a kernel with BTF (/sys/kernel/btf/vmlinux, "
                                    "CONFIG_DEBUG_INFO_BTF=y)")
    try:
        lsms = lsm_list()
    except OSError as e:
        raise ExecPolicyUnavailable(f"cannot read the kernel's active LSMs ({LSM_FILE}: {e})") from None
    if "bpf" not in lsms:
        raise ExecPolicyUnavailable(f"exec rules need the BPF LSM, and this kernel's active LSMs are "
                                    f"{','.join(lsms)}: boot with lsm={','.join([*lsms, 'bpf'])} (a kernel "
                                    "built with CONFIG_BPF_LSM=y)")


class ExecLsm:
    """The exec policy's programs, loaded and attached (one per server; thread-safe). The kernel enforces
    what the calls below set, at once, for every process of the slot's uids."""

    def __init__(self, source: Path = SOURCE, max_files: int = MAX_FILES) -> None:
        check_host()
        path = bpf_objects.compiled(source, CACHE, ExecPolicyUnavailable)
        self.max_files = max_files
        self._lock = threading.Lock()
        self._slots: dict[int, _Slot] = {}
        self._loader_slots: dict[int, set[int]] = {}  # file id -> the slots that marked it a loader
        self._next_id = 1
        self._got: list[Refusal] = []
        self._bpf = bpf_objects.BpfObject(path, ExecPolicyUnavailable, "the exec policy's programs", "refusals",
                                          self._on_refusal, refusals={errno.EPERM: REFUSED_LOAD})
        self._lib = self._bpf.lib
        self._sandboxes = self._bpf.map_fd("sandboxes")
        self._files = self._bpf.map_fd("files")
        self._once = self._bpf.map_fd("once")
        self._lost = self._bpf.map_fd("lost")
        self._cpus = max(self._lib.libbpf_num_possible_cpus(), 1)

    def _error(self, what: str) -> ExecPolicyUnavailable:
        err = ctypes.get_errno()
        return ExecPolicyUnavailable(f"{what}: {os.strerror(err) if err else 'failed'}")

    # -- sandboxes ---------------------------------------------------------------------------------

    def add_sandbox(self, uids: Iterable[int], mode: str = "allow") -> int:
        """A new slot for the processes of host uids `uids`, default `mode` (MODES); its number."""
        uids = tuple(uids)
        _check_mode(mode)
        with self._lock:
            slot = next((s for s in range(SLOTS) if s not in self._slots), None)
            if slot is None:
                raise ExecPolicyFull(f"exec policies of {SLOTS} sandboxes are enforced already: no slot left")
            self._slots[slot] = _Slot(uids, mode)
            try:
                self._write_uids(slot)
            except BaseException:
                self._drop_uids(slot)
                del self._slots[slot]
                raise
        return slot

    def set_mode(self, slot: int, mode: str) -> None:
        """The slot's default for files it has no verdict on: allow, deny or ask (ask: refused here, as
        deny; exec_hold.py asks before the kernel gets there)."""
        _check_mode(mode)
        with self._lock:
            self._slot(slot).mode = mode
            self._write_uids(slot)

    def remove_sandbox(self, slot: int) -> None:
        """Forget the slot: its uids, its verdicts on every file it marked, its pins."""
        with self._lock:
            s = self._slot(slot)
            self._drop_uids(slot)
            for fd in list(s.pins.values()):
                self._update(slot, fd, None, loader=False)  # (closes the pin: the slot holds the file no more)
            del self._slots[slot]

    def _slot(self, slot: int) -> _Slot:
        try:
            return self._slots[slot]
        except KeyError:
            raise KeyError(f"no exec policy slot {slot}") from None

    def _write_uids(self, slot: int) -> None:
        s = self._slots[slot]
        value = (ctypes.c_uint32 * 2)(slot, MODES[s.mode])
        for uid in s.uids:
            key = ctypes.c_uint32(uid)
            if self._lib.bpf_map_update_elem(self._sandboxes, ctypes.byref(key), value, 0) != 0:
                raise self._error(f"setting the exec policy of uid {uid}")

    def _drop_uids(self, slot: int) -> None:
        for uid in self._slots[slot].uids:
            self._lib.bpf_map_delete_elem(self._sandboxes, ctypes.byref(ctypes.c_uint32(uid)))

    # -- files -------------------------------------------------------------------------------------

    def mark(self, slot: int, fd: int, verdict: str | None) -> None:
        """The slot's verdict on the file of `fd` (any fd of it, O_PATH too): allow, deny, once (one exec,
        then none), or None (no verdict: the slot's mode decides)."""
        if verdict is not None and verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {', '.join(VERDICTS)} or None, not {verdict!r}")
        with self._lock:
            self._update(slot, fd, verdict, loader=None)

    def mark_loader(self, slot: int, fd: int) -> None:
        """The file of `fd` is an ELF loader (ld.so) of the slot's root: exec'd directly (`ld.so /bin/x`,
        which would run /bin/x without an exec of it) it is refused unless the slot's mode is allow or
        it is allowed."""
        with self._lock:
            self._update(slot, fd, "keep", loader=True)

    def verdict(self, slot: int, fd: int) -> str | None:
        """The slot's verdict on the file of `fd` (allow, deny, once: an approval not yet used; None)."""
        with self._lock:
            self._slot(slot)
            marks = self._read(fd)
            if marks is None:
                return None
            allow, deny, _flags, file_id = marks
            if _bit(deny, slot):
                return "deny"
            if _bit(allow, slot):
                return "allow"
            if file_id and self._has_once(file_id, slot):
                return "once"
            return None

    def is_loader(self, fd: int) -> bool:
        with self._lock:
            marks = self._read(fd)
            return marks is not None and bool(marks[2] & F_LOADER)

    def _update(self, slot: int, fd: int, verdict: str | None, loader: bool | None) -> None:
        """Read-modify-write of the file's marks (only the server writes them: under self._lock).
        verdict "keep": leave the slot's verdict; loader None: leave the slot's loader mark."""
        s = self._slot(slot)
        marks = self._read(fd)
        allow, deny, flags, file_id = marks if marks is not None else ([0] * _WORDS, [0] * _WORDS, 0, 0)
        if not file_id:
            file_id, self._next_id = self._next_id, self._next_id + 1
        pinned = file_id in s.pins
        if not pinned and len(s.pins) >= self.max_files and (verdict not in (None, "keep") or loader):
            raise ExecPolicyFull(f"this sandbox's exec policy marks {len(s.pins)} files already (at most "
                                 f"{self.max_files}): narrow its patterns")
        if verdict != "keep":
            _set_bit(allow, slot, verdict == "allow")
            _set_bit(deny, slot, verdict == "deny")
            key = _once_key(file_id, slot)
            if verdict == "once":
                if self._lib.bpf_map_update_elem(self._once, key, ctypes.byref(ctypes.c_uint8(1)), 0) != 0:
                    raise self._error("approving one exec")
            else:
                self._lib.bpf_map_delete_elem(self._once, key)
        if loader is not None:
            holders = self._loader_slots.setdefault(file_id, set())
            (holders.add if loader else holders.discard)(slot)
            (s.loaders.add if loader else s.loaders.discard)(file_id)
            if not holders:
                del self._loader_slots[file_id]
        flags = (flags | F_LOADER) if file_id in self._loader_slots else (flags & ~F_LOADER)
        held = _bit(allow, slot) or _bit(deny, slot) or file_id in s.loaders or self._has_once(file_id, slot)
        if not any(allow) and not any(deny) and not flags and not self._any_once(file_id):
            self._lib.bpf_map_delete_elem(self._files, ctypes.byref(ctypes.c_int(fd)))
        else:
            value = ctypes.create_string_buffer(_MARKS.pack(*allow, *deny, flags, file_id), _MARKS.size)
            if self._lib.bpf_map_update_elem(self._files, ctypes.byref(ctypes.c_int(fd)), value, 0) != 0:
                raise self._error("marking a file for the exec policy")
        if held and not pinned:
            s.pins[file_id] = os.open(f"/proc/self/fd/{fd}", os.O_PATH | os.O_CLOEXEC)  # the same file, not re-resolved
        elif not held and pinned:
            os.close(s.pins.pop(file_id))

    def _read(self, fd: int) -> tuple[list[int], list[int], int, int] | None:
        value = ctypes.create_string_buffer(_MARKS.size)
        if self._lib.bpf_map_lookup_elem(self._files, ctypes.byref(ctypes.c_int(fd)), value) != 0:
            err = ctypes.get_errno()
            if err == errno.ENOENT:
                return None
            raise OSError(err, f"reading the exec policy's marks of fd {fd}: {os.strerror(err)}")
        words = _MARKS.unpack(value.raw)
        return list(words[:_WORDS]), list(words[_WORDS:2 * _WORDS]), words[-2], words[-1]

    def _has_once(self, file_id: int, slot: int) -> bool:
        return self._lib.bpf_map_lookup_elem(self._once, _once_key(file_id, slot),
                                             ctypes.byref(ctypes.c_uint8())) == 0

    def _any_once(self, file_id: int) -> bool:
        return any(self._has_once(file_id, slot) for slot, s in self._slots.items() if file_id in s.pins)

    # -- refusals ----------------------------------------------------------------------------------

    def _on_refusal(self, _ctx: int | None, data: int, size: int) -> int:
        try:
            (ktime, uid, tgid, slot, hook, file_id, _pad, comm, name) = _REFUSAL.unpack(ctypes.string_at(data, size))
        except struct.error:
            return 0  # not ours to crash on
        self._got.append(Refusal(ktime, uid, tgid, slot, HOOKS.get(hook, str(hook)), file_id, _text(comm),
                                 _text(name)))
        return 0

    def fileno(self) -> int:
        """Readable when refusals are waiting (read_refusals)."""
        return self._bpf.ring_fd()

    def read_refusals(self) -> list[Refusal]:
        self._bpf.consume()
        got, self._got = self._got, []
        return got

    def lost(self) -> int:
        """Refusals the kernel could not write (the ring was full), since the load (they were refused)."""
        values = (ctypes.c_uint64 * self._cpus)()
        if self._lib.bpf_map_lookup_elem(self._lost, ctypes.byref(ctypes.c_uint32(0)), values) != 0:
            return 0
        return sum(values)

    def close(self) -> None:
        """Detach the programs (nothing is enforced from now on) and drop every pin."""
        self._bpf.close()
        for s in self._slots.values():
            for fd in s.pins.values():
                os.close(fd)
        self._slots.clear()


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")


def _bit(words: list[int], slot: int) -> bool:
    return bool(words[slot // 64] >> (slot % 64) & 1)


def _set_bit(words: list[int], slot: int, on: bool) -> None:
    if on:
        words[slot // 64] |= 1 << (slot % 64)
    else:
        words[slot // 64] &= ~(1 << (slot % 64))


def _once_key(file_id: int, slot: int) -> ctypes.Array[ctypes.c_uint32]:
    return (ctypes.c_uint32 * 2)(file_id, slot)


def _text(b: bytes) -> str:
    b = b.split(b"\0", 1)[0]
    return b.decode() if b.isascii() else b.decode(errors="backslashreplace")
