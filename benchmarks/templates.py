"""Templates made from images (issue 27): import times, the store's size with and without shared
layers, create → first result and idle memory per sandbox for the default template next to image
templates (Debian, musl/busybox as Alpine's kind, Debian trixie with its own Python as python:3.x-slim's
kind), all in one run of one server.

    .venv/bin/python benchmarks/templates.py [--runs 20] [--big]      # root; Debian roots via mmdebstrap

Images are made here (tests/oci_images.py: busybox-static + musl, mmdebstrap from the Debian archive) and
served by Debian's docker-registry on loopback; the server imports them through its API. --big adds a
~500 MB image (Debian with gcc, g++, python3). Nothing else leaves the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2b_code_interpreter import Sandbox  # noqa: E402

from tests.oci_images import Registry, debian_tar, musl_root, root_image, umoci  # noqa: E402
from tests.servers import ServerProcess  # noqa: E402


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def _dir_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def _images(tmp: Path, big: bool) -> tuple[Path, dict[str, str]]:
    layout = tmp / "layout"
    root_image(layout, "musl", root=musl_root(tmp / "musl"))
    root_image(layout, "debian", tar=debian_tar("bookworm"))
    root_image(layout, "python", tar=debian_tar("trixie", ("python3", "python3-pip")))
    # an image on the Debian one: its base layer shared, one layer of its own
    umoci("tag", "--image", f"{layout}:debian", "debian-app")
    app = tmp / "app"
    (app / "srv/app").mkdir(parents=True)
    (app / "srv/app/main.sh").write_text("echo app\n")
    umoci("insert", "--image", f"{layout}:debian-app", str(app / "srv"), "/srv")
    tags = {"musl": "musl", "debian": "debian", "python": "python", "debian-app": "debian-app"}
    if big:
        root_image(layout, "big", tar=debian_tar("bookworm", ("gcc", "g++", "python3", "python3-dev")))
        tags["big"] = "big"
    return layout, tags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--big", action="store_true", help="also import a ~500 MB image")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (like the server)")
    tmp = Path(tempfile.mkdtemp(prefix="agentcell-bench-templates-"))
    t = time.monotonic()
    layout, tags = _images(tmp, args.big)
    print(f"images made in {time.monotonic() - t:.1f} s (Debian roots cached in /var/tmp/agentcell-test-images)")
    registry = Registry(tmp / "registry")
    for tag in tags:
        registry.push(f"oci:{layout}:{tag}", f"bench/{tag}:1")
    blob_dir = registry.storage / "docker/registry/v2/blobs"
    state = tmp / "state"
    server = ServerProcess(tmp / "server.log", "--state-dir", str(state), "--egress-uplink", "none",
                           "--insecure-registry", registry.address, "--standbys", "2", "--max-image-mb", "2048")
    server.wait_ready()
    try:
        print(f"\n== import from a loopback registry (registry holds {_dir_bytes(blob_dir) / 1e6:.0f} MB of blobs)")
        with httpx.Client(base_url=server.url, timeout=900) as http:
            for tag in tags:
                t = time.monotonic()
                r = http.post("/templates/imports", json={"name": tag, "fromImage": f"docker://{registry.address}/bench/{tag}:1"})
                r.raise_for_status()
                size = r.json()["sizeBytes"]
                print(f"{tag:12s} {size / 1e6:7.1f} MB unpacked, {len(r.json()['layers'])} layer(s): {time.monotonic() - t:6.2f} s")
            t = time.monotonic()
            http.post("/templates/imports", json={"name": "debian-again", "fromImage": f"docker://{registry.address}/bench/debian:1"}).raise_for_status()
            print(f"{'debian again':12s} (its layer already stored): {time.monotonic() - t:6.2f} s")
        store = state / "templates" / "layers"
        per_template = sum(_dir_bytes(store / d.split(":")[1]) for name in [*tags, "debian-again"]
                           for d in json.loads((state / "templates/templates" / f"{name}.json").read_text())["layers"])
        print(f"\n== the store: {_dir_bytes(store) / 1e6:.0f} MB on disk for {len(tags) + 1} templates; "
              f"{per_template / 1e6:.0f} MB if each kept its own layers")

        print(f"\n== create → first result, {args.runs} runs each (p50 / p90 ms; one server, standbys 2)")
        kw = {"api_key": "e2b_bench", "api_url": server.url, "sandbox_url": server.url}
        rows = {}
        for template in ["base", *tags]:
            if template in ("debian-app", "big"):
                continue
            Sandbox.create(template=template, **kw).kill()  # its standby pool starts
            time.sleep(2)
            cmd, code = [], []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                sb = Sandbox.create(template=template, **kw)
                sb.commands.run("true")
                cmd.append((time.perf_counter() - t0) * 1000)
                t0 = time.perf_counter()
                sb.run_code("1+1")
                code.append((time.perf_counter() - t0) * 1000)
                sb.kill()
                time.sleep(0.3)  # the pool refills between runs, as between a user's creates
            rows[template] = statistics.median(cmd)
            print(f"{template:10s} create+command {statistics.median(cmd):7.1f} / {_pct(cmd, 0.9):7.1f}   "
                  f"then run_code 1+1 {statistics.median(code):7.1f} / {_pct(code, 0.9):7.1f}   "
                  f"ratio to base {statistics.median(cmd) / rows['base']:.2f}")

        print("\n== idle memory per sandbox (its cgroup's memory after a command and 1+1, 5 sandboxes, MiB)")
        for template in ["base", "musl", "debian", "python"]:
            boxes = [Sandbox.create(template=template, **kw) for _ in range(5)]
            for sb in boxes:
                sb.commands.run("true")
                sb.run_code("1+1")
            time.sleep(3)
            used = []
            for sb in boxes:
                metrics = sb.get_metrics()
                if metrics:
                    used.append(metrics[-1].mem_used / (1 << 20))
                sb.kill()
            print(f"{template:10s} {statistics.median(used) if used else float('nan'):6.1f}")
    finally:
        server.stop()
        registry.stop()


if __name__ == "__main__":
    main()
