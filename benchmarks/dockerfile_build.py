"""Dockerfile builds through `agentcell serve`: cold, fully cached, one step changed, --no-cache.

    .venv/bin/python benchmarks/dockerfile_build.py [--runs 5] [--mib 20] [--files 200] [--no-run]

As root. Starts a loopback registry with a musl/busybox base image (tests/oci_images.py) and a server
(`--egress-uplink none`), then builds one Dockerfile (ENV, WORKDIR, a COPY of one big file, a COPY of
many small ones, a RUN, a COPY of one small file) as the CLI does (templates/dockerfile.py, E2B's
upload and build API, status polled every 0.2 s): the first build (base import + every step), the
same again (every step cached), the last COPY's file changed (only that step and after), and
`--no-cache`. Each figure is the whole client-side time (hashing the context, uploads, the build,
the polling), p50 over --runs. `--no-run` leaves the RUN step out (a server whose builds cannot run
commands yet).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agentcell.templates.dockerfile import convert_dockerfile  # noqa: E402
from agentcell.templates.remote_build import build_on_server  # noqa: E402
from tests.oci_images import Registry, musl_root, root_image  # noqa: E402
from tests.servers import SERVE, ServerProcess  # noqa: E402

KEY = "bench-key"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--mib", type=int, default=20, help="size of the big file copied")
    ap.add_argument("--files", type=int, default=200, help="small files copied (10 kB each)")
    ap.add_argument("--no-run", action="store_true", help="no RUN step")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="df-bench-") as tmp:
        root = Path(tmp)
        rootfs = musl_root(root / "rootfs")
        # E2B's images have "user", and its Dockerfile conversion ends with USER user
        (rootfs / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n")
        (rootfs / "etc/group").write_text("root:x:0:\nuser:x:1000:\n")
        (rootfs / "home/user").mkdir(parents=True)
        root_image(root / "layout", "1", rootfs)
        registry = Registry(root / "registry")
        try:
            registry.push(f"oci:{root / 'layout'}:1", "bench/busybox:1")
            ctx = root / "ctx"
            (ctx / "app").mkdir(parents=True)
            (ctx / "big.bin").write_bytes(b"\1" * (args.mib << 20))
            for i in range(args.files):
                (ctx / "app" / f"f{i}.txt").write_text(str(i) * 10_000)
            (ctx / "conf.ini").write_text("v=0\n")
            run = "" if args.no_run else "RUN echo built > /srv/built.txt\n"
            dockerfile = (f"FROM {registry.address}/bench/busybox:1\nENV APP=bench\nWORKDIR /srv\n"
                          f"COPY big.bin /srv/\nCOPY app/ ./app/\n{run}COPY conf.ini /srv/\n")
            server_args = ["--state-dir", str(root / "state"), "--egress-uplink", "none", "--standbys", "0",
                           "--no-record", "--insecure-registry", registry.address, "--api-key", KEY]
            with ServerProcess(root / "server.log", *server_args, command=SERVE) as server:
                def build(tag: str, skip_cache: bool = False) -> float:
                    t0 = time.perf_counter()
                    converted = convert_dockerfile(dockerfile, ctx)
                    build_on_server(converted, f"bench:{tag}", api_url=server.url, api_key=KEY, skip_cache=skip_cache)
                    return time.perf_counter() - t0

                figures = {"cold (base import + every step)": [build("cold")]}
                figures["fully cached"] = [build(f"cached{i}") for i in range(args.runs)]
                changed = []
                for i in range(args.runs):
                    (ctx / "conf.ini").write_text(f"v={i + 1}\n")
                    changed.append(build(f"changed{i}"))
                figures["last COPY's file changed"] = changed
                figures["--no-cache (every step, base kept)"] = [build(f"nocache{i}", True) for i in range(args.runs)]
        finally:
            registry.stop()
    print(f"Dockerfile build, {args.mib} MiB + {args.files} files copied, "
          f"{'no RUN' if args.no_run else 'one RUN'}; p50 of {args.runs} (cold: 1)")
    for name, values in figures.items():
        print(f"  {name:38s} {statistics.median(values) * 1000:8.0f} ms")


if __name__ == "__main__":
    main()
