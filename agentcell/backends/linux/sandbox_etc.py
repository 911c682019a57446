"""The sandbox's /etc: a few host files programs read, copied; everything else generated.

The host's /etc describes the host: its users, its network, its package and tool configuration
(pip.conf with an index URL and token, gitconfig, wgetrc), its login policy, its shell start-up
files (profile.d can put the host's tool paths on PATH). A sandbox gets none of that. What it gets
is copied once per zygote into the template's /etc tmpfs (no bind mount: fewer mounts to copy per
sandbox, and no view of later host changes); world-readable files only, never /etc/ssl/private.
"""

from __future__ import annotations

import glob
import os
import shutil
import stat

from agentcell.network.router import RESOLVER

# Copied from the host when present, each because programs read it:
COPIED = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d",  # the dynamic linker finds libraries with these
    "alternatives",  # the symlinks behind /usr/bin/awk, editor, pager ...
    "ssl",  # TLS trust roots and openssl.cnf (OpenSSL, Python's ssl)
    "fonts",  # fontconfig (fc-match, Matplotlib's system fonts)
    "localtime", "timezone",  # the time zone (a symlink into /usr/share/zoneinfo)
    "os-release", "debian_version",  # which distribution: code picks packages and paths by it
    "mime.types",  # Python's mimetypes, file managers
    "protocols", "services",  # getprotobyname, getservbyname (socket.getservbyname)
    "host.conf", "gai.conf",  # resolver and getaddrinfo() ordering options
    "terminfo", "inputrc",  # terminal descriptions, readline key bindings (REPLs, bash)
    "magic", "magic.mime",  # libmagic's local rules (file)
    "locale.alias",  # locale names (setlocale)
    "shells",  # valid login shells (chsh, some tools check it)
    "R",  # Debian's R conf (/usr/lib/R/etc links here: Renviron, ldpaths ...): R contexts
)
COPIED_PATTERNS = ("java-*-openjdk",)  # Debian's JDK conf (java.security ...): Java contexts, any JVM
# the host's TLS private keys; the operator's R site files (Debian's only name a CRAN mirror, runner.R
# sets the same; an operator's may hold tokens, as pip.conf does)
_NEVER = ("ssl/private", "R/Renviron.site", "R/Rprofile.site")

# Generated: the sandbox's own users and name service, and shell start-up files that keep the PATH
# the sandbox was given (Debian's /etc/profile resets it, which would hide the template's Python from
# `bash -l`, how every command runs).
NSSWITCH = (
    "passwd: files\ngroup: files\nshadow: files\ngshadow: files\nhosts: files dns\nnetworks: files\n"
    "protocols: files\nservices: files\nethers: files\nrpc: files\n"
)
PROFILE = (
    "# agentcell: the sandbox's /etc/profile keeps the PATH the sandbox was given\n"
    'if [ -n "$BASH_VERSION" ] && [ "$PS1" ] && [ -f /etc/bash.bashrc ]; then . /etc/bash.bashrc; fi\n'
)
BASHRC = (
    "# agentcell: the sandbox's system-wide bashrc\n"
    '[ -z "$PS1" ] && return\n'
    "shopt -s checkwinsize\n"
    "PS1='\\u@\\h:\\w\\$ '\n"
)


def generated(uid: int, home: str) -> dict[str, str]:
    return {
        "passwd": "root:x:0:0:root:/root:/bin/bash\n"
        f"user:x:{uid}:{uid}:user:{home}:/bin/bash\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nuser:x:{uid}:\nnogroup:x:65534:\n",
        # the router's resolver (network/router.py): it answers only what the sandbox's policy
        # allows, and nothing at all for a sandbox without internet
        "resolv.conf": f"nameserver {RESOLVER}\noptions timeout:2 attempts:2 edns0\n",
        "nsswitch.conf": NSSWITCH,
        "profile": PROFILE,
        "bash.bashrc": BASHRC,
    }


EXTRA_CA = "ssl/certs/agentcell-egress-ca.pem"
SYSTEM_BUNDLE = "ssl/certs/ca-certificates.crt"


def trust(etc: str, ca_path: str) -> None:
    """Add the CA at `ca_path` to the sandbox's trust store: its own file, and the system bundle that
    OpenSSL, Python's ssl, curl and (through SSL_CERT_FILE / REQUESTS_CA_BUNDLE) requests and httpx read."""
    with open(ca_path, "rb") as f:
        pem = f.read()
    os.makedirs(os.path.join(etc, "ssl/certs"), mode=0o755, exist_ok=True)
    for name in (EXTRA_CA, SYSTEM_BUNDLE):
        with open(os.path.join(etc, name), "ab") as f:
            f.write(b"\n" + pem)
        os.chmod(os.path.join(etc, name), 0o644)


def copy_from_host(etc: str, host_etc: str = "/etc") -> None:
    """Copy the COPIED entries of `host_etc` that exist into `etc` (a fresh directory)."""
    names = list(COPIED)
    for pattern in COPIED_PATTERNS:
        names += sorted(os.path.basename(p) for p in glob.glob(os.path.join(host_etc, pattern)))
    for name in names:
        _copy(os.path.join(host_etc, name), os.path.join(etc, name), name)


def _copy(src: str, dst: str, rel: str) -> None:
    if rel in _NEVER:
        return
    try:
        st = os.lstat(src)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)  # e.g. localtime -> /usr/share/zoneinfo/..., into /usr
    elif not st.st_mode & stat.S_IROTH:
        return  # not readable by others on the host: not the sandbox's either
    elif stat.S_ISDIR(st.st_mode):
        os.mkdir(dst, 0o755)
        for name in sorted(os.listdir(src)):
            _copy(os.path.join(src, name), os.path.join(dst, name), f"{rel}/{name}")
        os.chmod(dst, stat.S_IMODE(st.st_mode) & 0o755)
    elif stat.S_ISREG(st.st_mode):
        shutil.copyfile(src, dst, follow_symlinks=False)
        os.chmod(dst, stat.S_IMODE(st.st_mode) & 0o755)
