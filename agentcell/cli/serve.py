"""`agentcell serve` and `agentcell gateway`: run a server (a cell) or a gateway in front of cells."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import click

from agentcell.backends.base import COLLECTOR_NAMES
from agentcell.cli import main
from agentcell.cli.config_file import config_option
from agentcell.cli.secret_options import key_file_option, resolve_key, warn_exposed_keys

DEFAULT_PORT = 49982


def _watch_lifeline() -> None:
    """Embedded mode: exit when the SDK process that started us dies (its end of the pipe closes)."""
    raw = os.environ.pop("AGENTCELL_LIFELINE_FD", None)
    if raw is None:
        return
    try:
        fd = int(raw)
        os.set_inheritable(fd, False)  # sandboxes and other children must not hold it
    except (ValueError, OSError):
        return

    def watch() -> None:
        try:
            while os.read(fd, 4096):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)  # graceful shutdown: the sandboxes are killed
        time.sleep(20)
        os._exit(1)

    threading.Thread(target=watch, name="agentcell-lifeline", daemon=True).start()


def _check_runtime_early(opts: dict[str, Any]) -> None:
    """Start the runtime store's check now, while the server's modules import (runtime_prefetch)."""
    from agentcell import rootless

    backends = {opts["backend"], *(b.partition("=")[2] for b in opts["template_backends"]), *opts["create_backends"]}
    if "linux" in backends and os.geteuid() == 0 and not rootless.active():
        from agentcell.backends.linux import runtime_prefetch

        runtime_prefetch.start()


_LOG_FORMAT = click.option("--log-format", default="text", show_default=True, type=click.Choice(["text", "json"]),
                           help="The log's lines: text, or one JSON object a line (docs/operations.md).")
_TLS_CERT = click.option("--tls-cert", default=None, type=click.Path(exists=True, dir_okay=False), metavar="PEM",
                         help="Serve HTTPS with this certificate chain (needs --tls-key). Default: plain HTTP.")
_TLS_KEY = click.option("--tls-key", default=None, type=click.Path(exists=True, dir_okay=False), metavar="PEM",
                        help="The private key of --tls-cert.")


def _tls(opts: dict[str, Any]) -> None:
    if (opts["tls_cert"] is None) != (opts["tls_key"] is None):
        raise click.ClickException("--tls-cert and --tls-key go together: pass both, or neither")


@main.command()
@config_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Any non-loopback address needs --api-key (or --insecure-no-auth).")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=int, help="TCP port.")
@click.option("--uds", default=None, help="Listen on this unix socket instead of host:port.")
@click.option("--api-key", default=None, envvar="AGENTCELL_SERVER_API_KEY",
              help="Require this X-API-KEY on the control plane (default: accept any). On the command line it "
                   "shows in `ps`: prefer --api-key-file or $AGENTCELL_SERVER_API_KEY.")
@key_file_option("api_key", "AGENTCELL_SERVER_API_KEY_FILE", "the API key")
@_TLS_CERT
@_TLS_KEY
@click.option("--insecure-no-auth", is_flag=True,
              help="Allow a non-loopback --host without --api-key: anyone who reaches it can run code.")
@click.option("--domain", default=None,
              help="Domain reported to SDKs; sandbox hosts are {port}-{id}.<domain> (default: the request's Host).")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="Also accept this Host header (repeatable; '*.example.com' for subdomains, '*' for any). "
                   "Loopback names, --domain and the --host address are always accepted.")
@click.option("--allowed-origin", "allowed_origins", multiple=True, metavar="ORIGIN",
              help="Also accept browser requests from this origin, e.g. https://app.example.com (repeatable).")
@click.option("--header-timeout", default=10.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds a client has to send a request's line and headers.")
@click.option("--body-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds a request body may stall (it must also average 1 KiB/s).")
@click.option("--max-connections", default=1024, show_default=True, type=click.IntRange(1, 1 << 20),
              help="Open client connections; past it new ones get 503 and are closed.")
@click.option("--max-body-memory-mb", default=64, show_default=True, type=click.IntRange(8, 1 << 20),
              help="JSON request bodies held in memory at once, server-wide; more requests wait.")
@click.option("--max-sandboxes", default=1000, show_default=True, type=click.IntRange(1, 1 << 20),
              help="Most sandboxes alive at once.")
@click.option("--standbys", default=4, show_default=True, type=click.IntRange(0, 1024),
              help="Sandboxes kept prepared (fenced, agent and default context started) for creates with "
                   "the default limits; each idle one holds ~15 MiB. 0: every create prepares its own.")
@click.option("--cell-id", default=None, envvar="AGENTCELL_CELL_ID",
              help="Run as a cell behind `agentcell gateway`: every sandbox id starts with this id (8 chars "
                   "a-z0-9; a longer value such as a pod UID is hashed to 8). Default: none.")
@click.option("--drain-grace", default=None, type=click.FloatRange(min=0),
              help="Seconds SIGTERM waits for live sandboxes to end (creates get 429, /health 503) before "
                   "stopping. Default: --max-timeout with --cell-id, else 0 (stop at once).")
@click.option("--uid-base", default=None, type=click.IntRange(1000, (1 << 31) - 1),
              help="First host uid of this server's sandboxes (default: a free range, disjoint from other servers').")
@click.option("--backend", default="linux", show_default=True, type=click.Choice(["linux", "gvisor", "microvm"]),
              help="Isolation backend (gvisor: runsc sandboxes, no network; AGENTCELL_GVISOR_PLATFORM=ptrace; "
                   "microvm: a QEMU VM per sandbox, its own kernel, the network through the egress router).")
@click.option("--accel", default="auto", show_default=True, type=click.Choice(["auto", "kvm", "tcg"]),
              envvar="AGENTCELL_MICROVM_ACCEL",
              help="The microvm backend's accelerator. auto: KVM if a probe VM boots under it, else refuse to "
                   "start; tcg: QEMU's emulator (slow; labelled 'emulated — no hardware isolation claim').")
@click.option("--template-backend", "template_backends", multiple=True, metavar="TEMPLATE=BACKEND",
              help="Run this template's sandboxes on another backend, e.g. code-interpreter-v1=gvisor (repeatable).")
@click.option("--create-backends", "create_backends", multiple=True, metavar="BACKEND",
              help="A backend a create may ask for by name (its body's \"backend\"; repeatable). Default: none.")
@click.option("--max-memory-mb", type=click.IntRange(32), default=None,
              help="Most memory one sandbox may ask for (default 8192).")
@click.option("--max-pids", type=click.IntRange(8), default=None, help="Most processes+threads per sandbox (default 1024).")
@click.option("--max-cpus", type=click.FloatRange(0.05), default=None, help="Most CPUs per sandbox (default: the host's).")
@click.option("--max-disk-mb", type=click.IntRange(1), default=None, help="Most disk per sandbox (default 8192).")
@click.option("--max-open-files", type=click.IntRange(64), default=None, help="Most open files per process (default 65536).")
@click.option("--max-timeout", type=click.IntRange(1), default=3600, show_default=True,
              help="Longest sandbox lifetime a client may ask for, in seconds.")
@click.option("--host-sysctls/--no-host-sysctls", default=True, show_default=True,
              help="Raise fs.file-max, kernel.pid_max and kernel.pty.max at start when too small for "
                   "--max-sandboxes (without: log what stays unprotected).")
@click.option("--ptys-per-sandbox", default=64, show_default=True, type=click.IntRange(1, 4096),
              help="PTYs each sandbox may open.")
@click.option("--memory-reserve-mb", default=None, type=click.IntRange(0),
              help="Host memory all sandboxes together may never take (default: max(1 GiB, 10%)).")
@click.option("--memory-overcommit", default=32.0, show_default=True, type=click.FloatRange(min=0.1),
              help="The sandboxes' memory limits together may add up to this many times the memory all of "
                   "them may use at once (the host's memory minus a reserve).")
@click.option("--pids-overcommit", default=4.0, show_default=True, type=click.FloatRange(min=0.1),
              help="The same for their pids limits, against the host's task budget.")
@click.option("--egress-uplink", default="host", show_default=True, envvar="AGENTCELL_EGRESS_UPLINK",
              help="Where sandboxes' internet traffic leaves: host (masqueraded out of this host's interfaces), "
                   "netns:PATH (into that network namespace), usermode (slirp4netns: rootless mode's, its default "
                   "where it can run), or none (no sandbox gets internet).")
@click.option("--egress-dns", multiple=True, metavar="IP",
              help="Upstream DNS server for the sandboxes' resolver (default: /etc/resolv.conf's, minus loopback).")
@click.option("--egress-ca-bundle", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Extra CA certificates (PEM) to trust for the hosts secrets are sent to (default: the system's).")
@click.option("--egress-allow-range", "egress_allow_ranges", multiple=True, metavar="CIDR",
              help="A private (or link-local, CGNAT ...) range sandboxes with internet may reach after all, "
                   "e.g. an internal package mirror. Default: none of them.")
@click.option("--egress-proxy-range", "egress_proxy_ranges", multiple=True, metavar="CIDR",
              help="A private (or link-local, CGNAT ...) range a sandbox's network.egressProxy (its SOCKS5 proxy) "
                   "may be in, e.g. a corporate proxy at 10.0.0.5. Sandboxes still cannot reach it directly. "
                   "Default: none; proxies must be at public addresses.")
@click.option("--egress-plain-http-host", "egress_plain_http_hosts", multiple=True, metavar="HOST",
              help="A host (or *.domain) whose secrets and network.rules headers may be sent over plain HTTP, only "
                   "to addresses the sandbox's resolver answered for it. Default: none; secrets go over verified "
                   "HTTPS only.")
@click.option("--internet-default", type=click.Choice(["on", "off"]), default=None, envvar="AGENTCELL_INTERNET_DEFAULT",
              help="Whether a create that does not say gets internet (default: on when there is an uplink).")
@click.option("--state-dir", default="/var/lib/agentcell", show_default=True, type=click.Path(file_okay=False),
              help="Where snapshots and the files of paused sandboxes are kept (root-only).")
@click.option("--paused-ttl", default=86400, show_default=True, type=click.IntRange(1),
              help="Seconds a paused sandbox is kept; then it is removed.")
@click.option("--max-paused", default=100, show_default=True, type=click.IntRange(0),
              help="Paused sandboxes kept at once; more pauses are refused (a timeout's pause kills instead).")
@click.option("--hibernate-after", default=600, show_default=True, type=click.IntRange(0),
              help="Seconds a sandbox stays paused with its memory resident before its memory is written to disk "
                   "and freed (backends with memory snapshots; 0: never).")
@click.option("--snapshot-quota-mb", default=10240, show_default=True, type=click.IntRange(1),
              help="Disk all snapshots together may take.")
@click.option("--max-snapshots", default=1000, show_default=True, type=click.IntRange(0), help="Snapshots kept at once.")
@click.option("--volume-size-mb", default=1024, show_default=True, type=click.IntRange(16),
              help="A new volume's size (its quota) when the create names none (docs/volumes.md).")
@click.option("--max-volume-size-mb", default=10240, show_default=True, type=click.IntRange(16),
              help="The largest volume a create may ask for (sizeMB).")
@click.option("--max-volumes", default=100, show_default=True, type=click.IntRange(0),
              help="Volumes kept at once (each is an ext4 image, loop-mounted while the server runs).")
@click.option("--max-fork", default=16, show_default=True, type=click.IntRange(1, 256),
              help="Most sandboxes one fork may make.")
@click.option("--console/--no-console", default=True, show_default=True,
              help="Serve the web console at /ui (sign-in with the API key): docs/console.md.")
@click.option("--console-viewer-key", default=None, envvar="AGENTCELL_CONSOLE_VIEWER_KEY",
              help="A second key that signs in to the console read-only (viewer role).")
@key_file_option("console_viewer_key", "AGENTCELL_CONSOLE_VIEWER_KEY_FILE", "the console's viewer key")
@click.option("--record/--no-record", default=True, show_default=True,
              help="Keep every sandbox's behaviour record (processes, files, network, denials, limits, API calls).")
@click.option("--record-collectors", default=",".join(COLLECTOR_NAMES), show_default=True, metavar="LIST",
              help="The host-side collectors of the record that run (comma-separated): processes (execs, exits, "
                   "refused syscalls and writes), files, limits. API calls, network and the sandbox's life are always kept.")
@click.option("--record-denials", type=click.Choice(["failures", "syscalls"]), default="failures", show_default=True,
              help="What the record sees of refused file operations. failures: those a permission or capability "
                   "check refused (seen at that check: allowed calls cost nothing); Landlock's and seccomp's come from "
                   "the kernel's audit either way. syscalls: every path syscall failing with EACCES/EPERM/EROFS "
                   "(read-only mounts too), seen at its exit: every syscall of the host then pays the kernel's "
                   "slow path (~+0.1-0.2 us; +5 % on a syscall-heavy build).")
@click.option("--events-retention", default=7 * 86400, show_default=True, type=click.IntRange(0),
              help="Seconds a sandbox's behaviour record (GET /sandboxes/{id}/events) is kept after it is gone.")
@click.option("--events-per-sandbox", default=100_000, show_default=True, type=click.IntRange(100),
              help="Events kept per sandbox; more are counted as dropped.")
@click.option("--events-rate", default=2000.0, show_default=True, type=click.FloatRange(min=1),
              help="Events per second one sandbox may add to its record (a burst of 10 s of it), each class of event keeping "
                   "a reserved share; more are counted as dropped.")
@click.option("--events-max-mb", default=1024, show_default=True, type=click.IntRange(16),
              help="Disk the behaviour records of all sandboxes may take (the oldest ended ones go first).")
@click.option("--mcp/--no-mcp", "mcp", default=True, show_default=True,
              help="Serve agentcell's MCP server at /mcp, under the API key (docs/mcp.md).")
@click.option("--audit-log", default=None, metavar="PATH|-",
              help="Also write every event of every sandbox as a JSON line to this file ('-': stdout), for a SIEM.")
@click.option("--system", is_flag=True,
              help="Run as the machine's shared service (docs/system-service.md): listen on the unix socket systemd "
                   "passes, else on --uds (default /run/agentcell/agentcell.sock) made root:--socket-group 0660; "
                   "each sandbox belongs to the uid that created it, other users get 404; no TCP port unless "
                   "--system-tcp.")
@click.option("--socket-group", default="agentcell", show_default=True,
              help="With --system: the group whose members may connect to the socket.")
@click.option("--system-tcp", is_flag=True,
              help="With --system: also listen on --host:--port; needs --api-key (its holders are one tenant).")
@click.option("--max-sandboxes-per-user", default=20, show_default=True, type=click.IntRange(1),
              help="With --system: sandboxes (running or paused) one user may hold at once; root has no quota.")
@click.option("--max-memory-mb-per-user", default=None, type=click.IntRange(32),
              help="With --system: the memory limits of one user's sandboxes together (default: no bound).")
@click.option("--runtime-store", "runtime_store_dir", default=None,
              envvar="AGENTCELL_RUNTIME_STORE", type=click.Path(file_okay=False),
              help="The sandboxes' Python runtime, built from this server's interpreter and venv (files stored once "
                   "by content, shared by every server and venv of the host; root-only). Default: "
                   "/var/lib/agentcell/runtime; rootless: ~/.cache/agentcell/runtime.")
@click.option("--runtime-store-max-gb", default=10.0, show_default=True, envvar="AGENTCELL_RUNTIME_STORE_MAX_GB",
              type=click.FloatRange(min=0),
              help="Disk the runtime store may keep: beyond it, the parts no running server holds are removed, least "
                   "recently used first (and any unused for a day, whatever the size).")
@click.option("--allowed-registry", "allowed_registries", multiple=True, metavar="HOST[:PORT]",
              help="A registry template imports may use (repeatable; docker.io for Docker Hub). Default: any "
                   "registry at a public address.")
@click.option("--insecure-registry", "insecure_registries", multiple=True, metavar="HOST:PORT",
              help="A registry served over plain HTTP (or with an unverified certificate) that imports may use "
                   "(repeatable). Default: none.")
@click.option("--max-image-mb", default=4096, show_default=True, type=click.IntRange(1),
              help="Largest image a template import takes (its layers, compressed and unpacked).")
@click.option("--template-store-max-gb", default=50.0, show_default=True, type=click.FloatRange(min=0),
              help="Disk the imported templates' layers may take together (each layer stored once; unused ones "
                   "are collected when an import needs room).")
@click.option("--template-store-dir", default=None, type=click.Path(file_okay=False),
              help="Where imported and built templates are kept (default: STATE_DIR/templates). Cells behind one "
                   "gateway share one (docs/gateway.md): each cell starts sandboxes of the others' templates.")
@click.option("--max-concurrent-imports", default=2, show_default=True, type=click.IntRange(1, 64),
              help="Template imports running at once; more are answered 429.")
@click.option("--max-concurrent-builds", default=2, show_default=True, type=click.IntRange(1, 64),
              help="Template builds (E2B's Template.build) running at once; up to 16 more wait, then 429.")
@click.option("--registry-mirror", "registry_mirrors", multiple=True, metavar="REGISTRY=MIRROR",
              help="Fetch template builds' base images of REGISTRY (docker.io for Docker Hub) from MIRROR (HOST:PORT; "
                   "name it with --insecure-registry or --allowed-registry too). Repeatable.")
@click.option("--e2b-base-image", default="docker.io/e2bdev/base:latest", show_default=True, metavar="IMAGE",
              help="The image template builds start from for E2B's default base (Template(), from_base_image()): "
                   "E2B's own base image, pulled as any import (the registry policy applies), or another, e.g. "
                   "ubuntu:24.04. 'builtin': agentcell's built-in template, on which RUN steps and sandboxes of "
                   "the result are not supported yet.")
@click.option("--build-timeout", "build_timeout_s", default=3600.0, show_default=True,
              type=click.FloatRange(min=1), help="Seconds one template build may take, all its steps.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@click.option("--rootless/--no-rootless", default=None,
              help="Run as an ordinary user, in a user namespace of yours (default: when not root). Weaker "
                   "limits, no internet for sandboxes: docs/rootless.md, `agentcell doctor`.")
@_LOG_FORMAT
@click.pass_context
def serve(ctx: click.Context, **opts: Any) -> None:
    """Run the server (control plane and every sandbox's data plane on one port). As root, or rootless."""
    import dataclasses

    from agentcell import logs
    from agentcell.cli import rootless_serve

    rootless_serve.reexec_if_needed(opts.pop("rootless"))
    rootless_serve.adjust(opts)
    logs.configure(opts["log_level"], opts["log_format"])  # before the runtime check below logs progress
    # the runtime store is the backends' (runtime_store.store_dir, max_bytes), read from the environment
    if (store := opts.pop("runtime_store_dir")) is not None:
        os.environ["AGENTCELL_RUNTIME_STORE"] = store
    os.environ["AGENTCELL_RUNTIME_STORE_MAX_GB"] = repr(opts.pop("runtime_store_max_gb"))
    _check_runtime_early(opts)

    from agentcell.backends.base import Limits
    from agentcell.server import ServerConfig
    from agentcell.server import serve as run_server
    from agentcell.server.config import check, default_max_limits
    from agentcell.server.hosts import HostPolicy, check_exposure

    resolve_key(ctx, opts, "api_key")
    if resolve_key(ctx, opts, "console_viewer_key") is not None and opts["console_viewer_key"] == opts["api_key"]:
        raise click.BadParameter("is the API key: a viewer key must differ from it", param_hint="--console-viewer-key")
    _tls(opts)
    warn_exposed_keys(ctx, ("api_key", "console_viewer_key"))
    ceilings = {name: opts.pop(f"max_{flag}") for name, flag in (
        ("memory_mb", "memory_mb"), ("pids", "pids"), ("cpu_count", "cpus"), ("disk_mb", "disk_mb"),
        ("open_files", "open_files"))}
    max_limits = dataclasses.replace(default_max_limits(), **{k: v for k, v in ceilings.items() if v is not None})
    # A lowered maximum lowers the default with it (disk_mb None: the default disk follows the memory).
    defaults = Limits()
    limits = Limits(**{f.name: d if (d := getattr(defaults, f.name)) is None else min(d, getattr(max_limits, f.name))
                       for f in dataclasses.fields(Limits)})
    pairs = [item.partition("=") for item in opts["template_backends"]]
    if any(not t or not b for t, _, b in pairs):
        raise click.BadParameter("use TEMPLATE=BACKEND, e.g. code-interpreter-v1=gvisor", param_hint="--template-backend")
    opts["template_backends"] = tuple((t, b) for t, _, b in pairs)
    opts["create_backends"] = tuple(opts["create_backends"])
    opts["hibernate_after"] = opts["hibernate_after"] or None
    if not {"linux", "microvm"} & {opts["backend"], *(b for _, b in opts["template_backends"]), *opts["create_backends"]} \
            and opts["egress_uplink"] != "none":
        # runsc's sandboxes cannot have a network here (google/gvisor#10704)
        click.echo(f"agentcell: the {opts['backend']} backend gives sandboxes no network: --egress-uplink none", err=True)
        opts["egress_uplink"] = "none"
    opts["tune_sysctls"] = opts.pop("host_sysctls")
    collectors = tuple(c for c in opts["record_collectors"].split(",") if c)
    if set(collectors) - set(COLLECTOR_NAMES):
        raise click.BadParameter(f"choose from {', '.join(COLLECTOR_NAMES)}", param_hint="--record-collectors")
    opts["record_collectors"] = collectors
    opts["cell_id"] = _cell_id(opts["cell_id"])
    opts["egress_dns"] = tuple(opts["egress_dns"])
    opts["allowed_registries"] = tuple(opts["allowed_registries"])
    opts["insecure_registries"] = tuple(opts["insecure_registries"])
    opts["registry_mirrors"] = tuple(_mirror(m) for m in opts["registry_mirrors"])
    opts["egress_allow_ranges"] = tuple(opts["egress_allow_ranges"])
    opts["egress_proxy_ranges"] = tuple(opts["egress_proxy_ranges"])
    opts["egress_plain_http_hosts"] = tuple(h.strip().lower().rstrip(".") for h in opts["egress_plain_http_hosts"])
    opts["internet_default"] = None if opts["internet_default"] is None else opts["internet_default"] == "on"
    if not opts["system"]:  # quotas are per user, and only the system service knows its users
        opts["max_sandboxes_per_user"] = opts["max_memory_mb_per_user"] = None
    elif opts["uds"] is None:
        from agentcell.server.system_listen import SYSTEM_SOCKET

        opts["uds"] = SYSTEM_SOCKET
    config = ServerConfig(**opts, limits=limits, max_limits=max_limits,
                          default_timeout=min(300, opts["max_timeout"]))
    from agentcell.server import system_listen

    try:
        check(config)
        check_exposure(config)
        HostPolicy.from_config(config)
        system_listen.check(config)
    except (ValueError, system_listen.ListenError) as e:
        raise click.ClickException(str(e)) from None
    _watch_lifeline()
    try:
        run_server(config)
    except system_listen.ListenError as e:
        raise click.ClickException(str(e)) from None


@main.command()
@config_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Any non-loopback address needs --api-key (or --insecure-no-auth).")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=int, help="TCP port.")
@key_file_option("api_key", "AGENTCELL_GATEWAY_API_KEY_FILE", "the clients' API key")
@key_file_option("cell_api_key", "AGENTCELL_CELL_API_KEY_FILE", "the cells' API key")
@_TLS_CERT
@_TLS_KEY
@click.option("--api-key", default=None, envvar="AGENTCELL_GATEWAY_API_KEY",
              help="Require this X-API-KEY of clients on the control plane, checked here before anything "
                   "reaches a cell (default: accept any).")
@click.option("--cell-api-key", default=None, envvar="AGENTCELL_CELL_API_KEY",
              help="The X-API-KEY the cells require, sent only with requests whose key matched "
                   "(default: --api-key).")
@click.option("--insecure-no-auth", is_flag=True, help="Allow a non-loopback --host without --api-key.")
@click.option("--discovery", default="static", show_default=True, type=click.Choice(["static", "kubernetes"]),
              help="How cells are found: a fixed list, or the EndpointSlices of the cells' headless Service.")
@click.option("--cell", "cells", multiple=True, metavar="URL", help="A cell, e.g. http://10.0.0.5:49982 (static; repeatable).")
@click.option("--cells-file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A file of cell URLs, one a line, '#' comments (static).")
@click.option("--k8s-service", default="agentcell-cells", show_default=True,
              help="The cells' headless Service (kubernetes).")
@click.option("--k8s-namespace", default=None,
              help="Its namespace (default: the gateway pod's own, else 'default').")
@click.option("--k8s-port-name", default=None, help="The EndpointSlice port to use (default: the first).")
@click.option("--poll-interval", default=1.0, show_default=True, type=click.FloatRange(min=0.05),
              help="Seconds between polls of each cell's /v1/cell (placement figures, liveness).")
@click.option("--header-timeout", default=10.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds a client has to send a request's line and headers.")
@click.option("--body-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds a request body may stall (it must also average 1 KiB/s); then 408.")
@click.option("--max-connections", default=4096, show_default=True, type=click.IntRange(1, 1 << 20),
              help="Open client connections; past it new ones get 503 and are closed.")
@click.option("--max-body-memory-mb", default=64, show_default=True, type=click.IntRange(8, 1 << 20),
              help="Create bodies held in memory at once (the only bodies the gateway holds; others stream); "
                   "more creates wait.")
@click.option("--console/--no-console", default=True, show_default=True,
              help="Serve the web console at /ui, across the cells (sign-in with --api-key): docs/console.md.")
@click.option("--console-viewer-key", default=None, envvar="AGENTCELL_CONSOLE_VIEWER_KEY",
              help="A second key that signs in to the console read-only (viewer role).")
@key_file_option("console_viewer_key", "AGENTCELL_CONSOLE_VIEWER_KEY_FILE", "the console's viewer key")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@_LOG_FORMAT
@click.pass_context
def gateway(ctx: click.Context, **opts: Any) -> None:
    """Run a stateless gateway in front of many cells (agentcell serve --cell-id): docs/gateway.md."""
    from agentcell import logs
    from agentcell.gateway.app import GatewayApp
    from agentcell.gateway.app import serve as run_gateway
    from agentcell.gateway.banner import Listen
    from agentcell.gateway.discovery import Discovery, StaticDiscovery
    from agentcell.server.hosts import is_loopback

    resolve_key(ctx, opts, "api_key")
    resolve_key(ctx, opts, "cell_api_key")
    if resolve_key(ctx, opts, "console_viewer_key") is not None and opts["console_viewer_key"] == opts["api_key"]:
        raise click.BadParameter("is the API key: a viewer key must differ from it", param_hint="--console-viewer-key")
    _tls(opts)
    logs.configure(opts["log_level"], opts["log_format"])
    warn_exposed_keys(ctx, ("api_key", "cell_api_key", "console_viewer_key"))
    if not is_loopback(opts["host"]) and opts["api_key"] is None and not opts["insecure_no_auth"]:
        raise click.ClickException(f"refusing to listen on {opts['host']!r} without an API key: pass --api-key KEY, "
                                   "listen on 127.0.0.1, or pass --insecure-no-auth")
    discovery: Discovery
    try:
        if opts["discovery"] == "static":
            discovery = StaticDiscovery(opts["cells"], opts["cells_file"])
        else:
            from agentcell.gateway.kubernetes import KubernetesDiscovery

            discovery = KubernetesDiscovery(opts["k8s_service"], opts["k8s_namespace"], opts["k8s_port_name"])
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    listen = Listen(opts["host"], opts["port"], opts["tls_cert"] is not None, opts["discovery"])  # the banner's
    app = GatewayApp(discovery, opts["api_key"], opts["cell_api_key"], opts["poll_interval"],
                     body_timeout=opts["body_timeout"], max_body_memory=opts["max_body_memory_mb"] << 20,
                     listen=listen, console=opts["console"], console_viewer_key=opts["console_viewer_key"])
    run_gateway(app, opts["host"], opts["port"], opts["log_level"], header_timeout=opts["header_timeout"],
                max_connections=opts["max_connections"], tls=(opts["tls_cert"], opts["tls_key"]),
                log_format=opts["log_format"])


def _cell_id(raw: str | None) -> str | None:
    from agentcell.server.cell import normalise_cell_id

    try:
        return normalise_cell_id(raw)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--cell-id") from None


def _mirror(text: str) -> tuple[str, str]:
    registry, sep, mirror = text.partition("=")
    if not sep or not registry.strip() or not mirror.strip() or "/" in mirror:
        raise click.BadParameter(f"{text!r}: REGISTRY=HOST[:PORT], e.g. docker.io=127.0.0.1:5000",
                                 param_hint="--registry-mirror")
    return registry.strip().lower(), mirror.strip()
