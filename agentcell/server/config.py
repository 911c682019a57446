"""Server configuration."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from agentcell.backends.base import COLLECTOR_NAMES, Limits
from agentcell.network.secrets import is_host_pattern


def default_max_limits() -> Limits:
    """The most a client may ask for one sandbox unless the operator says otherwise."""
    return Limits(memory_mb=8192, pids=1024, cpu_count=float(os.cpu_count() or 1), disk_mb=8192,
                  open_files=65536, file_size_mb=8192)


E2B_BASE_IMAGE = "docker.io/e2bdev/base:latest"  # what E2B's SDKs call "the E2B base image"


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 3000
    uds: str | None = None  # serve on this unix socket instead of host:port
    api_key: str | None = None  # None = accept any X-API-KEY (the SDK always sends one)
    console: bool = True  # the web console at /ui (--no-console: off; docs/console.md)
    console_viewer_key: str | None = None  # a key that signs in to the console read-only
    max_sandboxes: int = 1000
    standbys: int = 4  # sandboxes kept prepared ahead of creates (with the default limits)
    limits: Limits = field(default_factory=Limits)  # default limits of a new sandbox
    max_limits: Limits = field(default_factory=default_max_limits)  # the most a create request may ask
    default_timeout: int = 300  # seconds, when the create request has none
    max_timeout: int = 3600  # seconds: a sandbox's lifetime (create, set_timeout, connect)
    # Admission (registry.Admission): how far the sandboxes' limits together may exceed what all of
    # them may use at once (the parent cgroup's memory and pids limits).
    memory_overcommit: float = 32.0
    pids_overcommit: float = 4.0
    backend: str = "linux"  # the default backend
    accel: str = "auto"  # the microvm backend's accelerator: kvm, tcg, or auto (KVM if a probe VM boots)
    template_backends: tuple[tuple[str, str], ...] = ()  # (template, backend): the template's sandboxes run there
    create_backends: tuple[str, ...] = ()  # backends a create may ask for by name ("backend": agentcell extension)
    # --- lifecycle (docs/architecture.md, "Pause, resume, snapshots") ---
    state_dir: str = "/var/lib/agentcell"  # snapshots and the files of paused sandboxes
    paused_ttl: int = 86400  # seconds a paused sandbox is kept, then removed
    max_paused: int = 100  # paused sandboxes kept at once
    hibernate_after: int | None = 600  # seconds paused before a sandbox's memory goes to disk (gvisor); None: never
    snapshot_quota_mb: int = 10240  # disk all snapshots together may take
    max_snapshots: int = 1000
    volume_size_mb: int = 1024  # a new volume's quota (agentcell/volumes/)
    max_volume_size_mb: int = 10240
    max_volumes: int = 100  # each holds a loop device while the server runs
    max_fork: int = 16  # most sandboxes one fork makes
    # --- the behaviour record (issue 10; record/store.py) ---
    record: bool = True  # False: no record, no collectors (--no-record)
    record_collectors: tuple[str, ...] = COLLECTOR_NAMES  # the linux backend's host-side collectors that run
    # what the linux backend's kernel tracer sees of refused path syscalls: "failures" (at the failed
    # capability check: free for allowed calls; not read-only mounts) or "syscalls" (every failing one, at
    # the cost of every syscall of the host; docs/architecture.md, "The behaviour record")
    record_denials: str = "failures"
    events_retention: int = 7 * 86400  # seconds a sandbox's record is kept after it is gone
    events_per_sandbox: int = 100_000  # events kept per sandbox (more are counted, not kept)
    events_rate: float = 2000.0  # events per second per sandbox and source (burst: 10 s of it)
    events_max_mb: int = 1024  # disk the whole record store may take, roughly
    audit_log: str | None = None  # also write every event as a JSON line here ("-": stdout)
    # --- a cell behind `agentcell gateway` (server/cell.py) ---
    cell_id: str | None = None  # the prefix of every sandbox id; None: no cell id (ids as before)
    drain_grace: float | None = None  # seconds SIGTERM waits for live sandboxes; None: max_timeout with a cell id, else 0
    uid_base: int | None = None  # first host uid of this server's sandboxes; None = a free range
    # The `domain` reported to SDKs. None = the Host the request came to, so an SDK without
    # E2B_SANDBOX_URL never falls back to E2B's own cloud domain.
    domain: str | None = None
    max_upload_mb: int = 4096  # largest /files upload (streamed into the sandbox, never held whole)
    max_uploads: int = 64  # uploads in progress server-wide; more wait their turn
    max_uploads_per_sandbox: int = 8
    # host-wide kernel pools (backends/linux/host.py): raise fs.file-max, kernel.pid_max and
    # kernel.pty.max at start when they are too small for max_sandboxes; False leaves them (and logs
    # what is then not protected)
    tune_sysctls: bool = True
    ptys_per_sandbox: int = 64  # each sandbox's own PTY pool (its devpts max=)
    memory_reserve_mb: int | None = None  # host memory no sandbox may take; None: max(1 GiB, 10%)
    log_level: str = "info"
    log_format: str = "text"  # text | json (agentcell/logs.py)
    # TLS on the listening socket (uvicorn's ssl options): PEM certificate chain and its key; None: plain HTTP
    tls_cert: str | None = None
    tls_key: str | None = None
    # --- the HTTP edge (docs/architecture.md, "The HTTP edge") ---
    insecure_no_auth: bool = False  # allow a non-loopback address without an API key
    allowed_hosts: tuple[str, ...] = ()  # extra Host names ("*.example.com" = any subdomain; "*" = any)
    allowed_origins: tuple[str, ...] = ()  # extra browser origins, e.g. "https://app.example.com"
    header_timeout: float = 10.0  # seconds to send a request's line and headers
    body_timeout: float = 30.0  # seconds a request body may stall
    max_connections: int = 1024  # open client connections, server-wide
    max_body_memory_mb: int = 64  # JSON request bodies held in memory at once, server-wide
    # --- egress (docs/network.md) ---
    egress_uplink: str = "host"  # host | netns:PATH | usermode (rootless) | none (no sandbox gets internet)
    egress_dns: tuple[str, ...] = ()  # upstream resolvers; () = the host's /etc/resolv.conf
    egress_ca_bundle: str | None = None  # extra CAs (PEM) for the real certificates of secrets' hosts
    egress_allow_ranges: tuple[str, ...] = ()  # never-list ranges sandboxes may reach after all
    egress_plain_http_hosts: tuple[str, ...] = ()  # secrets may go over plain HTTP to these (answered addresses)
    egress_proxy_ranges: tuple[str, ...] = ()  # never-list ranges a sandbox's network.egressProxy may be in
    # whether a create that says nothing about it gets internet; None: on when there is an uplink
    internet_default: bool | None = None
    # --- the system service (docs/system-service.md; server/system_listen.py, server/tenancy.py) ---
    system: bool = False  # a group-shared unix socket; each sandbox belongs to the uid that made it
    socket_group: str = "agentcell"  # the group that may connect to the system socket
    system_tcp: bool = False  # the system service also listens on host:port (needs api_key)
    mcp: bool = True  # serve agentcell's MCP server at /mcp (agentcell/mcp/mounted.py; --no-mcp: not)
    max_sandboxes_per_user: int | None = None  # with system: sandboxes one user may hold at once
    max_memory_mb_per_user: int | None = None  # with system: the memory their limits may add up to
    # --- templates from OCI images (agentcell/templates/; POST /templates/imports) ---
    allowed_registries: tuple[str, ...] = ()  # registries imports may use; () = any at a public address
    insecure_registries: tuple[str, ...] = ()  # HOST:PORT served over plain HTTP (or unverified TLS), allowed
    max_image_mb: int = 4096  # one image's size, compressed and unpacked
    template_store_max_gb: float = 50.0  # the imported layers together (each stored once)
    template_store_dir: str | None = None  # None: <state_dir>/templates
    max_concurrent_imports: int = 2
    # --- E2B's template builds (agentcell/templates/builds.py; server/template_builds.py) ---
    max_concurrent_builds: int = 2  # builds running at once; more wait (E2B's "waiting"), 16 at most
    build_timeout_s: float = 3600.0  # one build, all of its steps
    registry_mirrors: tuple[tuple[str, str], ...] = ()  # (registry, mirror): build bases fetched from the mirror
    # what E2B's default base (Template(), from_base_image()) is in builds: E2B's own image, as on E2B;
    # "builtin" (or None): agentcell's built-in template, on which RUN steps cannot run yet
    e2b_base_image: str | None = E2B_BASE_IMAGE

    @property
    def internet_by_default(self) -> bool:
        if self.internet_default is None:
            return self.egress_uplink != "none"
        return self.internet_default


def backend_names(config: ServerConfig) -> list[str]:
    """Every backend the server runs: the default first."""
    names = [config.backend, *(b for _, b in config.template_backends), *config.create_backends]
    return list(dict.fromkeys(names))


def check(config: ServerConfig) -> None:
    """Refuse a configuration whose defaults exceed its own maximums (raises ValueError)."""
    config.limits.validate()
    config.max_limits.validate_ranges()  # ceilings, not a sandbox: the disk-in-memory rule is per sandbox
    for f in dataclasses.fields(Limits):
        default, most = getattr(config.limits, f.name), getattr(config.max_limits, f.name)
        if default is not None and most is not None and default > most:  # disk_mb None: follows memory
            raise ValueError(f"the default {f.name} ({default}) is above the maximum ({most})")
    if config.internet_default and config.egress_uplink == "none":
        raise ValueError("--internet-default on needs an egress uplink (--egress-uplink host or netns:PATH)")
    bad = [h for h in config.egress_plain_http_hosts if not is_host_pattern(h)]
    if bad:
        raise ValueError(f"--egress-plain-http-host {bad[0]!r} is not a host name (or *.name); no scheme, port or path")
    if not 0 < config.default_timeout <= config.max_timeout:
        raise ValueError(f"the default timeout ({config.default_timeout} s) must be within 1..{config.max_timeout} s")
