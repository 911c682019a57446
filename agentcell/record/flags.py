"""Flags: behaviour in a sandbox's record worth a reviewer's look (issue 10), raised event by event.

One set of rules, used twice:

* **online**, by the store (`EventStore.add`), on every event handed to it, stored or not: a flood
  that fills a record (or its rate) cannot hide a miner, a `.bashrc` write or a metadata connection
  from the flags; the store keeps them with the record (its `sandboxes` row) and the report merges
  them in;
* **offline**, by the report (`record/report.py`), over the stored events (records from before the
  online flags, and the details a report shows).

A flag cites the `seq` of up to MAX_CITED stored events it rests on and counts every event that
raised it (`count`), and how many of those are not in the record (`not_stored`). `record-incomplete`
says events were lost: refused by the store's bounds or lost by a collector (its `count` is the
number of events known lost). Everything here is bounded per record, whatever the sandbox does.
The report shows each flag as a signature, with a severity and a title (record/signatures.py, which
also holds the matchers the newer rules call: reverse shells, credential files, privilege escalation).
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Callable, Iterable
from typing import Any

from agentcell.record import signatures as rules

METADATA_ADDRESSES = frozenset({"169.254.169.254", "169.254.170.2", "100.100.100.200", "fd00:ec2::254",
                                "169.254.169.123", "metadata.google.internal"})
# syscalls whose refusal says the code reached for privileges or for another namespace
PRIVILEGE_SYSCALLS = frozenset({
    "mount", "umount2", "unshare", "setns", "pivot_root", "chroot", "ptrace", "bpf", "init_module",
    "finit_module", "delete_module", "kexec_load", "kexec_file_load", "keyctl", "add_key", "request_key",
    "perf_event_open", "open_by_handle_at", "name_to_handle_at", "userfaultfd", "fsopen", "fsmount",
    "move_mount", "open_tree", "clone3", "reboot", "swapon", "swapoff", "setdomainname", "sethostname",
    "iopl", "ioperm", "syslog", "acct", "quotactl", "lookup_dcookie", "kcmp", "process_vm_writev",
    "process_vm_readv", "mknod", "mknodat",
})
# shell start-up files and the like: writing them is how code outlives the session
PERSISTENCE_NAMES = frozenset({".bashrc", ".bash_profile", ".profile", ".zshrc", ".bash_login", ".bash_logout",
                               ".pythonrc", ".inputrc", "authorized_keys", "crontab", ".xinitrc"})
PERSISTENCE_DIRS = ("/etc/profile.d/", "/etc/cron", "/var/spool/cron", "/etc/init.d/", "/etc/systemd/",
                    "/home/user/.ssh/", "/root/.ssh/", "/home/user/.config/autostart/")
MINER_WORDS = ("xmrig", "minerd", "cpuminer", "stratum+tcp", "cryptonight", "ethminer", "nicehash")
_MINER_RE = re.compile("|".join(re.escape(w) for w in MINER_WORDS))  # on the lowered line: 5x any(in)
SCAN_PORTS = 20  # distinct ports on one address, or ...
SCAN_HOSTS = 20  # ... distinct addresses, that look like a scan
LONG_RUNNING_S = 60.0  # a process alive this long at the end, started by the code, is "left behind"
MAX_CITED = 20  # events cited per flag
MAX_LIVE = 4096  # live processes tracked per record (a sandbox's pids limit is at most 1024)
MAX_REASONS = 16  # distinct reasons for lost events kept per record; more are summed as "other"

WHY = {
    "cloud-metadata": "reached for a cloud metadata address",
    "host-or-lan": "reached for the host, the LAN or another sandbox",
    "privilege-syscalls": "tried privilege or namespace syscalls",
    "sensitive-paths": "was refused access to protected paths",
    "persistence": "wrote a shell start-up file, ssh keys, cron or init files",
    "crypto-mining": "a process whose command line names a miner or a mining pool",
    "cpu-bound": "ran against its CPU limit for long stretches (mining-like)",
    "left-running": "a process started by the code ran on for a long time in the background",
    "scanning": f"tried {SCAN_HOSTS} addresses or more, or {SCAN_PORTS} ports or more on one",
    "record-incomplete": "events were lost before they could be kept: the record misses some of what happened",
    "secret-misuse": "tried to send a secret (or a rule's header) where it may not go: another host, or plaintext",
    "reverse-shell": "a command line that wires a shell to a network socket (a reverse shell)",
    "credential-read": "named or reached for credential files (shadow, ssh keys, cloud or registry credentials)",
    "privilege-escalation": "reached for root: sudo/su/pkexec/doas, a setuid or setgid bit, or the account files",
    "denied-egress": "tried hosts or addresses the network policy denies",
    "secrets-used": "the egress proxy put secrets in its requests",
}
# net.deny rules that are no decision about the host (an upstream that failed, a malformed request)
NOT_A_HOST_DECISION = frozenset({"upstream", "tls-handshake", "unparsed", "body-too-large", "proxy-budget"})
MAX_SECRET_NAMES = 32  # names a secrets-used flag lists (a sandbox has at most 32 secrets)
INCOMPLETE = "record-incomplete"


class FlagSet:
    """The flags of one record, raised as its events are seen (`see`), in order."""

    __slots__ = ("_flags", "_live", "_ports", "_lost", "_secrets", "dirty")

    def __init__(self) -> None:
        self._flags: dict[str, list[Any]] = {}  # name -> [cited seqs, count, not stored, why]
        self._live: dict[int, tuple[float, int | None]] = {}  # pid -> (exec time, seq): processes running
        self._ports: dict[str, set[int]] | None = {}  # address -> ports tried; None once scanning is flagged
        self._lost: dict[str, int] = {}  # reason -> events lost
        self._secrets: set[str] = set()  # names of the secrets the proxy put in requests
        self.dirty = False  # changed since the store last kept it

    # -- seeing events -------------------------------------------------------------------------------

    def see(self, e: dict[str, Any], seq: int | None) -> None:
        """One event, stored as `seq` (None: not stored). Never raises."""
        try:
            rule = _RULES.get(e.get("kind"))  # type: ignore[arg-type]
            if rule is not None:
                rule(self, e, seq)
        except (TypeError, ValueError, AttributeError):
            pass  # a malformed event raises nothing; it is still stored (or counted) as it came

    def raise_flag(self, name: str, seq: int | None, count: int = 1, why: str | None = None) -> None:
        f = self._flags.get(name)
        if f is None:
            f = self._flags[name] = [[], 0, 0, why or WHY.get(name, "")]
        if seq is None:
            f[2] += count
        elif len(f[0]) < MAX_CITED:
            f[0].append(seq)
        f[1] += count
        self.dirty = True

    def lost(self, reason: str, count: int = 1) -> None:
        """`count` events were lost (refused by the store, or lost by a collector) for `reason`."""
        held = self._lost.get(reason)
        if held is None:
            if len(self._lost) >= MAX_REASONS:
                reason = "other"
            held = self._lost.get(reason, 0)
            self.raise_flag(INCOMPLETE, None, 0)
        self._lost[reason] = held + count
        self.dirty = True

    def cite_note(self, seq: int) -> None:
        """The store's own `record.dropped` note, stored as `seq`: cited by record-incomplete (the
        events it counts were counted by `lost` as they were refused)."""
        self.raise_flag(INCOMPLETE, seq, 0)

    def _exec(self, e: dict[str, Any], seq: int | None) -> None:
        argv = e.get("argv")
        if isinstance(argv, list) and argv:
            try:
                line = " ".join(argv)
            except TypeError:  # not all strings
                line = " ".join(map(str, argv))
        else:
            line = str(e.get("path") or "")
        line = line.lower()
        if _MINER_RE.search(line):
            self.raise_flag("crypto-mining", seq)
        if rules.worth_a_look(line):
            if rules.reverse_shell(line):
                self.raise_flag("reverse-shell", seq)
            if rules.credential_path(line):
                self.raise_flag("credential-read", seq)
        if rules.escalation_command(e.get("path"), argv):
            self.raise_flag("privilege-escalation", seq)
        pid, at = e.get("pid"), e.get("time")
        if isinstance(pid, int) and pid != 1 and isinstance(at, int | float) \
                and (pid in self._live or len(self._live) < MAX_LIVE):
            self._live[pid] = (float(at), seq)  # an exec without a fork ends the program before it

    def _exit(self, e: dict[str, Any], seq: int | None) -> None:
        pid = e.get("pid")
        if isinstance(pid, int):
            self._live.pop(pid, None)

    def _file(self, e: dict[str, Any], seq: int | None) -> None:
        to = e.get("to")  # a rename's; (deleting one is not persisting: no rule for file.delete)
        path = e.get("path")
        if _persistence(path) or (to is not None and _persistence(to)):
            self.raise_flag("persistence", seq)
        if rules.privileged_file(path) or rules.privileged_file(to) \
                or (e.get("kind") == "file.chmod" and rules.setuid_mode(e.get("mode"))):
            self.raise_flag("privilege-escalation", seq)

    def _network(self, e: dict[str, Any], seq: int | None) -> None:
        dst = e.get("dst")
        where = "cloud-metadata" if e.get("domain") in METADATA_ADDRESSES else _address_class(dst) \
            if isinstance(dst, str) and dst else None
        if where:
            self.raise_flag(where, seq)
        kind = e.get("kind")
        if (kind == "net.deny" and e.get("rule") not in NOT_A_HOST_DECISION) \
                or (kind == "dns.query" and e.get("verdict") == "denied"):
            self.raise_flag("denied-egress", seq)
        used = e.get("secrets")
        if used and isinstance(used, list):
            self._secrets_used(used, seq)
        port = e.get("dport")
        ports = self._ports
        if ports is not None and isinstance(port, int) and dst:
            tried = ports.get(str(dst))
            if tried is None:
                tried = ports[str(dst)] = set()
            if port not in tried:
                tried.add(port)
                self._probe(str(dst), len(tried), seq)

    def _probe(self, address: str, ports_on_it: int, seq: int | None) -> None:
        """A new (address, port): cited by scanning, which is raised once either bound is reached;
        then the tracking stops (it is at most SCAN_HOSTS x SCAN_PORTS entries)."""
        assert self._ports is not None
        self.raise_flag("scanning-probe", seq)
        if len(self._ports) >= SCAN_HOSTS or ports_on_it >= SCAN_PORTS:
            probes = self._flags.pop("scanning-probe")
            why = (f"tried {len(self._ports)} addresses" if len(self._ports) >= SCAN_HOSTS
                   else f"tried {ports_on_it} ports on {address}")
            self._flags["scanning"] = [probes[0], probes[1], probes[2], why]
            self._ports = None

    def _refusal(self, e: dict[str, Any], seq: int | None) -> None:
        kind = e.get("kind")
        if kind == "deny.syscall":
            if str(e.get("syscall")) in PRIVILEGE_SYSCALLS:
                self.raise_flag("privilege-syscalls", seq)
        else:
            self.raise_flag("sensitive-paths", seq)
            path = e.get("path")
            if isinstance(path, str) and rules.credential_path(path):
                self.raise_flag("credential-read", seq)
            if kind == "deny.write" and rules.privileged_file(path):
                self.raise_flag("privilege-escalation", seq)

    def _secret(self, e: dict[str, Any], seq: int | None) -> None:
        self.raise_flag("secret-misuse", seq)
        self.raise_flag("denied-egress", seq)

    def _secrets_used(self, names: list[Any], seq: int | None) -> None:
        """A request the proxy put secrets in (net.connect's `secrets`): named in the flag's why, never
        a value (the record holds none)."""
        new = {str(n)[:128] for n in names} - self._secrets
        if new and len(self._secrets) < MAX_SECRET_NAMES:
            self._secrets |= set(sorted(new)[:MAX_SECRET_NAMES - len(self._secrets)])
        self.raise_flag("secrets-used", seq)
        self._flags["secrets-used"][3] = f"{WHY['secrets-used']}: {', '.join(sorted(self._secrets))}"

    def _cpu(self, e: dict[str, Any], seq: int | None) -> None:
        self.raise_flag("cpu-bound", seq)

    def _dropped(self, e: dict[str, Any], seq: int | None) -> None:
        """A collector's (or, in a report, also the store's) record.dropped note."""
        count = e.get("count")
        self.lost(str(e.get("reason") or e.get("collector") or "unknown")[:200],
                  count if isinstance(count, int) and count > 0 else 0)
        if seq is not None:
            self.raise_flag(INCOMPLETE, seq, 0)

    # -- reading ---------------------------------------------------------------------------------------

    def snapshot(self, end: float | None) -> list[dict[str, Any]]:
        """The flags as a report shows them, sorted by name. With `end` (when the record ended, or now),
        also the processes still running then that started LONG_RUNNING_S or more before it."""
        out = {name: _shown(name, f) for name, f in self._flags.items() if name != "scanning-probe"}
        if end is not None:
            left = [seq for at, seq in self._live.values() if end - at >= LONG_RUNNING_S]
            if left:
                held = out.get("left-running")
                cited = sorted({*(held["events"] if held else ()), *(s for s in left if s is not None)})
                out["left-running"] = {"flag": "left-running", "why": WHY["left-running"],
                                       "events": cited[:MAX_CITED], "count": max(len(left), held["count"] if held else 0),
                                       "not_stored": sum(1 for s in left if s is None)}
        if INCOMPLETE in out:
            lost = sum(self._lost.values())
            reasons = ", ".join(f"{r}: {n}" for r, n in sorted(self._lost.items(), key=lambda x: -x[1]))
            out[INCOMPLETE].update(count=lost, not_stored=lost,
                                   why=f"{WHY[INCOMPLETE]} ({lost} known lost; {reasons})" if reasons else WHY[INCOMPLETE])
        return [out[k] for k in sorted(out)]

    def to_json(self, end: float | None) -> dict[str, Any]:
        """What the store keeps with the record (and `restore` reads back after a restart)."""
        return {"flags": self.snapshot(end), "lost": dict(self._lost)}

    @classmethod
    def restore(cls, kept: dict[str, Any] | None) -> FlagSet:
        """A record's flags as kept by `to_json`, going on from there (a paused sandbox resumed after a
        restart). Its running processes and the scan's tracking are not kept: the processes are seen
        again only from their next exec, and a scan flagged before stays flagged."""
        fs = cls()
        if not isinstance(kept, dict):
            return fs
        for f in kept.get("flags") or ():
            fs._flags[f["flag"]] = [list(f.get("events") or [])[:MAX_CITED], int(f.get("count") or 0),
                                    int(f.get("not_stored") or 0), str(f.get("why") or WHY.get(f["flag"], ""))]
        fs._lost = {str(k): int(v) for k, v in (kept.get("lost") or {}).items()}
        if "scanning" in fs._flags:
            fs._ports = None
        used = fs._flags.get("secrets-used")
        if used is not None and ": " in used[3]:  # the names it listed, going on from them
            fs._secrets = set(used[3].split(": ", 1)[1].split(", "))
        return fs


def _shown(name: str, f: list[Any]) -> dict[str, Any]:
    return {"flag": name, "why": f[3], "events": list(f[0]), "count": f[1], "not_stored": f[2]}


def merge(*flag_lists: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One list of flags from several views of one record (the report's pass over the stored events,
    the store's online flags): each flag once, citing the events any of them cites, with the largest
    count; the first view that has a flag gives its `why` and `not_stored` (pass the online view first)."""
    out: dict[str, dict[str, Any]] = {}
    for flags in flag_lists:
        for f in flags:
            held = out.get(f["flag"])
            if held is None:
                out[f["flag"]] = {"flag": f["flag"], "why": f.get("why", ""), "events": list(f.get("events") or []),
                                  "count": int(f.get("count") or 0), "not_stored": int(f.get("not_stored") or 0)}
            else:
                held["events"] = sorted({*held["events"], *(f.get("events") or [])})[:MAX_CITED]
                held["count"] = max(held["count"], int(f.get("count") or 0))
    return [out[k] for k in sorted(out)]


def _persistence(path: Any) -> bool:
    if not isinstance(path, str):
        return False
    return path[path.rfind("/") + 1:] in PERSISTENCE_NAMES or path.startswith(PERSISTENCE_DIRS)


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


@functools.lru_cache(maxsize=4096)
def _address_class(dst: str) -> str | None:
    """"cloud-metadata", "host-or-lan" or None for a destination address (cached: a sandbox talks to
    few; one that varies them pays ~1 us an event)."""
    if dst in METADATA_ADDRESSES:
        return "cloud-metadata"
    try:
        ip = ipaddress.ip_address(dst)
    except ValueError:
        return None
    if ip.version == 6:  # an IPv4 address inside an IPv6 one is the same place
        inner = ip.ipv4_mapped or ip.sixtofour or (
            ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in _NAT64 else None)
        if inner is not None:
            return _address_class(str(inner))
    return "host-or-lan" if ip.is_private or ip.is_loopback or ip.is_link_local else None


_RULES: dict[str, Callable[[FlagSet, dict[str, Any], int | None], None]] = {
    "process.exec": FlagSet._exec,
    "process.exit": FlagSet._exit,
    **{k: FlagSet._file for k in ("file.create", "file.write", "file.rename", "file.chmod")},
    **{k: FlagSet._network for k in ("net.connect", "net.deny", "dns.query")},
    **{k: FlagSet._refusal for k in ("deny.syscall", "deny.write", "deny.access")},
    "limit.cpu": FlagSet._cpu,
    "secret.refused": FlagSet._secret,
    "record.dropped": FlagSet._dropped,
}
