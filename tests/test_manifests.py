"""The Kubernetes manifests (deploy/kubernetes): rendered offline, schema-checked, and their
security-relevant fields asserted.

No kubectl here: `render` is a small kustomize in Python, the subset these manifests use
(resources, components, namespace, labels, images, config map and secret generators without name
hashes, JSON 6902 patches). It refuses any other field, so a manifest change that needs more fails
here instead of rendering wrong. Every object is validated against the Kubernetes OpenAPI schemas
bundled in `kubernetes-validate` (strict: unknown fields fail too).

The last test deploys to a real cluster and runs the SDK through the gateway: skipped unless
KUBECONFIG is set (and kubectl is installed).
"""

from __future__ import annotations

import base64
import copy
import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests must load on (appArmorProfile etc.)
FAKE_KEYS = "gateway-api-key=test-gateway-key\ncell-api-key=test-cell-key\n"

_CLUSTER_KINDS = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass",
                  "CustomResourceDefinition", "PriorityClass", "IngressClass"}
_KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "namespace", "labels", "resources", "components",
                         "configMapGenerator", "secretGenerator", "images", "patches"}


class RenderError(Exception):
    pass


def _env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            if not sep:
                raise RenderError(f"{path}: not KEY=VALUE: {line!r}")
            out[key] = value
    return out


def _generate(kind: str, gen: dict, base: Path, namespace: str | None, files: dict[str, str]) -> dict:
    unknown = set(gen) - {"name", "namespace", "behavior", "options", "literals", "envs", "files"}
    if unknown:
        raise RenderError(f"generator fields not supported: {unknown}")
    if not gen.get("options", {}).get("disableNameSuffixHash"):
        raise RenderError(f"{gen['name']}: name hashes are not supported here (references would need rewriting)")
    data: dict[str, str] = {}
    for lit in gen.get("literals", []):
        k, _, v = lit.partition("=")
        data[k] = v
    for env in gen.get("envs", []):
        p = base / env
        if str(p) in files:
            tmp = base / f".{uuid.uuid4().hex}"
            tmp.write_text(files[str(p)])
            try:
                data.update(_env_file(tmp))
            finally:
                tmp.unlink()
        else:
            data.update(_env_file(p))
    for f in gen.get("files", []):
        k, _, src = f.partition("=") if "=" in f else (Path(f).name, "", f)
        data[k] = (base / src).read_text()
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": kind,
                           "metadata": {"name": gen["name"], "namespace": gen.get("namespace") or namespace}}
    if obj["metadata"]["namespace"] is None:
        del obj["metadata"]["namespace"]
    if kind == "Secret":
        obj["type"] = "Opaque"
        obj["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    else:
        obj["data"] = data
    return obj


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def _json_patch(obj: dict, ops: list[dict]) -> None:
    for op in ops:
        *parents, last = _pointer(op["path"])
        node: Any = obj
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        key: Any = int(last) if isinstance(node, list) and last != "-" else last
        if op["op"] == "replace":
            node[key] = copy.deepcopy(op["value"])
        elif op["op"] == "add":
            if isinstance(node, list):
                node.append(copy.deepcopy(op["value"])) if key == "-" else node.insert(key, copy.deepcopy(op["value"]))
            else:
                node[key] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del node[key]
        else:
            raise RenderError(f"JSON patch op not supported: {op['op']}")


def _pod_specs(obj: dict) -> list[dict]:
    spec = obj.get("spec", {})
    if "template" in spec:
        return [spec["template"]["spec"]]
    if "jobTemplate" in spec:
        return [spec["jobTemplate"]["spec"]["template"]["spec"]]
    return [spec] if obj["kind"] == "Pod" else []


def _image_name(ref: str) -> str:
    """An image reference without its tag or digest (a registry's :port stays)."""
    ref = ref.split("@", 1)[0]
    head, _, last = ref.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]


def _apply(k: dict, base: Path, objs: list[dict], files: dict[str, str]) -> list[dict]:
    """One kustomization's generators and transformers over `objs` (its resources')."""
    ns = k.get("namespace")
    for comp in k.get("components", []):
        objs = _render_dir(base / comp, files, objs)
    for kind, key in (("ConfigMap", "configMapGenerator"), ("Secret", "secretGenerator")):
        for gen in k.get(key, []):
            new = _generate(kind, gen, base, ns, files)
            same = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == gen["name"]]
            behavior = gen.get("behavior", "create")
            if behavior == "create" and same:
                raise RenderError(f"{kind} {gen['name']} generated twice")
            if behavior in ("replace", "merge"):
                if not same:
                    raise RenderError(f"{kind} {gen['name']}: nothing to {behavior}")
                if behavior == "merge":
                    new["data"] = same[0].get("data", {}) | new["data"]
                objs = [o for o in objs if o is not same[0]]
            objs.append(new)
    for patch in k.get("patches", []):
        target = patch.get("target", {})
        ops = yaml.safe_load(patch["patch"]) if "patch" in patch else yaml.safe_load((base / patch["path"]).read_text())
        if not isinstance(ops, list):
            raise RenderError("only JSON 6902 patches are supported")
        hits = [o for o in objs if all(o["kind"] == v if f == "kind" else o["metadata"]["name"] == v
                                       for f, v in target.items() if f in ("kind", "name"))]
        if set(target) - {"kind", "name"} or not hits:
            raise RenderError(f"patch target not supported or not found: {target}")
        for o in hits:
            _json_patch(o, ops)
    if ns:
        for o in objs:
            if o["kind"] not in _CLUSTER_KINDS:
                o["metadata"]["namespace"] = ns
            for s in o.get("subjects", []) if o["kind"] in ("RoleBinding", "ClusterRoleBinding") else []:
                if s.get("kind") == "ServiceAccount":
                    s["namespace"] = ns
    for lab in k.get("labels", []):
        if lab.get("includeSelectors") or lab.get("includeTemplates"):
            raise RenderError("labels: only metadata labels (includeSelectors/includeTemplates false) are supported")
        for o in objs:
            o["metadata"].setdefault("labels", {}).update(lab["pairs"])
    for img in k.get("images", []):
        for o in objs:
            for pod in _pod_specs(o):
                for c in pod.get("containers", []) + pod.get("initContainers", []):
                    if _image_name(c["image"]) == img["name"]:
                        name = img.get("newName", img["name"])
                        c["image"] = f"{name}:{img['newTag']}" if "newTag" in img else name
    return objs


def _render_dir(path: Path, files: dict[str, str], incoming: list[dict] | None = None) -> list[dict]:
    k = yaml.safe_load((path / "kustomization.yaml").read_text())
    unknown = set(k) - _KUSTOMIZATION_FIELDS
    if unknown:
        raise RenderError(f"{path}/kustomization.yaml: fields not supported here: {sorted(unknown)}")
    is_component = k.get("kind") == "Component"
    if is_component != (incoming is not None):
        raise RenderError(f"{path}: a Component must be used as a component, a Kustomization as a resource")
    objs = list(incoming or [])
    for res in k.get("resources", []):
        p = path / res
        if p.is_dir():
            objs += _render_dir(p, files)
        else:
            objs += [d for d in yaml.safe_load_all(p.read_text()) if d]
    return _apply(k, path, objs, files)


def render(path: Path, files: dict[str, str] | None = None) -> list[dict]:
    """The objects `kubectl kustomize path` would print (for the subset above). `files`: contents
    for files that do not exist (e.g. the overlay's api-keys.env), by absolute path."""
    return _render_dir(path, files or {})


# -- the rendered manifests ------------------------------------------------------------------------

EXAMPLE = K8S / "overlays" / "example"


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render(EXAMPLE, {str(EXAMPLE / "api-keys.env"): FAKE_KEYS})


def _one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    hits = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(hits) == 1, f"{len(hits)} {kind} {name or ''}"
    return hits[0]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_the_base_and_the_overlay_render_and_match_the_schemas(objects: list[dict]) -> None:
    import kubernetes_validate

    base = render(K8S / "base")
    assert {o["kind"] for o in base} >= {"Namespace", "DaemonSet", "Service", "NetworkPolicy", "ServiceAccount",
                                         "Role", "RoleBinding", "Deployment", "HorizontalPodAutoscaler",
                                         "PodDisruptionBudget", "ConfigMap"}
    kinds = {o["kind"] for o in objects}
    assert kinds >= {"Secret", "Ingress"} | {o["kind"] for o in base}
    for o in base + objects:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    ids = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    assert len(ids) == len(set(ids)), "an object is defined twice"
    for o in objects:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == "agentcell", o["metadata"]
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}, "nothing cluster-wide beyond the namespace"


def test_the_cell_daemonset_is_a_privileged_drainable_guaranteed_pod_on_its_own_pool(objects: list[dict]) -> None:
    ds = _one(objects, "DaemonSet", "agentcell-cell")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["securityContext"]["privileged"] is True
    assert not (pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC")), "the cell has a netns of its own"
    # a dedicated node pool: selected and tolerated
    assert pod["nodeSelector"] == {"agentcell.dev/pool": "cells"}
    assert {"key": "agentcell.dev/pool", "operator": "Equal", "value": "cells", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["terminationGracePeriodSeconds"] >= 3600
    timeout = [a for a in c["args"] if a.startswith("--max-timeout=")]
    assert timeout and pod["terminationGracePeriodSeconds"] > int(timeout[0].split("=")[1]), "grace >= sandbox lifetime"
    # Guaranteed QoS: requests = limits for CPU and memory, on every container
    for cont in pod["containers"] + pod.get("initContainers", []):
        r = cont["resources"]
        assert set(r["limits"]) >= {"cpu", "memory"} and r["requests"] == r["limits"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "httpGet" not in c["livenessProbe"], "liveness on /health would kill a draining cell (503)"
    env = {e["name"]: e for e in c["env"]}
    assert env["AGENTCELL_CELL_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert env["AGENTCELL_SERVER_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "agentcell-api-keys"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert volumes[mounts["/var/lib/agentcell"]]["hostPath"]["path"] == "/var/lib/agentcell"
    # uid ranges are reserved node-wide: a successor cell or a host server never gets the same ids
    assert volumes[mounts["/run/agentcell/uids"]]["hostPath"]["path"] == "/run/agentcell/uids"
    # the runtime's own /sys/fs/cgroup (the container's cgroup, in its cgroup namespace) is the one
    # to use: a hostPath of the host's tree would put sandboxes outside the pod's cgroup and limits
    assert not any(v.get("hostPath", {}).get("path", "").startswith("/sys") for v in volumes.values())
    assert c["image"] == "registry.example.com/agentcell:0.1.0"
    assert c["args"][0] == "serve" and "--host=0.0.0.0" in c["args"]


def test_the_headless_service_and_the_network_policy_select_the_cells(objects: list[dict]) -> None:
    ds = _one(objects, "DaemonSet", "agentcell-cell")
    cell_labels = ds["spec"]["template"]["metadata"]["labels"]
    gw_labels = _one(objects, "Deployment", "agentcell-gateway")["spec"]["template"]["metadata"]["labels"]
    svc = _one(objects, "Service", "agentcell-cells")
    assert svc["spec"]["clusterIP"] == "None"
    assert _selects(svc["spec"]["selector"], cell_labels) and not _selects(svc["spec"]["selector"], gw_labels)
    np = _one(objects, "NetworkPolicy", "agentcell-cells")
    assert _selects(np["spec"]["podSelector"]["matchLabels"], cell_labels)
    assert set(np["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    (rule,) = np["spec"]["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}, "only gateway pods (of this namespace), no ipBlock or namespace"
    assert _selects(peer["podSelector"]["matchLabels"], gw_labels)
    assert not _selects(peer["podSelector"]["matchLabels"], cell_labels)
    # sandboxes' egress: no cluster-internal or metadata addresses
    blocks = [p["ipBlock"] for r in np["spec"]["egress"] for p in r["to"] if "ipBlock" in p]
    v4 = [b for b in blocks if b["cidr"] == "0.0.0.0/0"]
    assert v4 and {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16"} <= set(v4[0]["except"])


def test_the_gateway_may_only_read_endpointslices_in_its_namespace(objects: list[dict]) -> None:
    dep = _one(objects, "Deployment", "agentcell-gateway")
    pod = dep["spec"]["template"]["spec"]
    sa = pod["serviceAccountName"]
    _one(objects, "ServiceAccount", sa)
    role = _one(objects, "Role")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    rb = _one(objects, "RoleBinding")
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "agentcell"}]
    (c,) = pod["containers"]
    args = c["args"]
    assert args[0] == "gateway" and "--discovery=kubernetes" in args
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"  # 503 without a routable cell
    assert "httpGet" not in c["livenessProbe"], "liveness on /health would restart every gateway while the cells are down"
    assert "--k8s-service=agentcell-cells" in args
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    secret = _one(objects, "Secret", "agentcell-api-keys")
    for ref in env.values():
        assert ref["name"] == "agentcell-api-keys" and ref["key"] in secret["data"]
    assert set(env) == {"AGENTCELL_GATEWAY_API_KEY", "AGENTCELL_CELL_API_KEY"}
    hpa = _one(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "agentcell-gateway"}
    assert hpa["spec"]["minReplicas"] >= 2
    pdb = _one(objects, "PodDisruptionBudget")
    assert _selects(pdb["spec"]["selector"]["matchLabels"], dep["spec"]["template"]["metadata"]["labels"])
    gsvc = _one(objects, "Service", "agentcell-gateway")
    assert _selects(gsvc["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])
    ing = _one(objects, "Ingress")
    hosts = [r["host"] for r in ing["spec"]["rules"]]
    assert any(h.startswith("*.") for h in hosts)
    for r in ing["spec"]["rules"]:
        assert r["http"]["paths"][0]["backend"]["service"]["name"] == "agentcell-gateway"


def test_the_secrets_in_the_repository_are_placeholders() -> None:
    example = _env_file(EXAMPLE / "api-keys.env.example")
    assert set(example) == {"gateway-api-key", "cell-api-key"}
    assert all(v.startswith("REPLACE-") for v in example.values())
    assert "api-keys.env" in (EXAMPLE / ".gitignore").read_text().split()
    tracked = subprocess.run(["git", "ls-files", str(K8S)], cwd=REPO, capture_output=True, text=True).stdout.split()
    assert not [t for t in tracked if t.endswith("api-keys.env")], "a real key file is committed"
    for o in render(K8S / "base"):
        assert o["kind"] != "Secret", "keys come from an overlay, never the base"


def _cli_options(command: str) -> set[str] | None:
    from agentcell.cli import main

    cmd = main.commands.get(command) if hasattr(main, "commands") else None
    if cmd is None:
        return None
    return {opt for p in cmd.params for opt in getattr(p, "opts", [])}


def test_the_pods_flags_exist_in_the_cli(objects: list[dict]) -> None:
    """The args are checked against `agentcell serve` / `agentcell gateway` (a command not in this
    checkout yet, e.g. the gateway on a branch without it, is skipped)."""
    checked = 0
    for o in objects:
        for pod in _pod_specs(o):
            for c in pod["containers"]:
                opts = _cli_options(c["args"][0])
                if opts is None:
                    continue
                for a in c["args"][1:]:
                    assert a.split("=", 1)[0] in opts, f"{c['args'][0]}: no option {a}"
                checked += 1
    assert checked >= 1


def test_the_dockerfile_builds_from_the_repository() -> None:
    text = (REPO / "deploy" / "Dockerfile").read_text()
    assert "pip install" in text and "COPY" in text
    assert re.search(r"pip install .*-e \"\.\[[a-z,]*kubernetes", text), "the gateway's discovery needs the kubernetes extra"
    # /opt is the zygote's (a tmpfs with the neutral runtime paths over it): the venv lives elsewhere
    assert not re.search(r"python3? -m venv /opt", text)
    assert "/var/lib/agentcell" not in re.findall(r"^VOLUME.*", text, re.M), "state is the DaemonSet's hostPath"


# -- a real cluster --------------------------------------------------------------------------------


@pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="needs a Kubernetes cluster: set KUBECONFIG "
                    "(and AGENTCELL_K8S_IMAGE to an image built from deploy/Dockerfile)")
def test_deploy_to_a_cluster_and_run_the_sdk_through_the_gateway(tmp_path: Path) -> None:
    """Deploys the example overlay (with the given image and random keys) to the cluster, waits for
    the cells and the gateway, port-forwards the gateway and runs code through it with the SDK,
    then deletes everything. Nodes must carry the cells' pool label and taint (docs/kubernetes.md)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    image = os.environ.get("AGENTCELL_K8S_IMAGE")
    if not image:
        pytest.skip("set AGENTCELL_K8S_IMAGE to an image built from deploy/Dockerfile")
    gateway_key = uuid.uuid4().hex
    objs = render(EXAMPLE, {str(EXAMPLE / "api-keys.env"):
                            f"gateway-api-key={gateway_key}\ncell-api-key={uuid.uuid4().hex}\n"})
    for o in objs:
        for pod in _pod_specs(o):
            for c in pod["containers"]:
                c["image"] = image
    objs = [o for o in objs if o["kind"] != "Ingress"]  # reached through a port-forward
    manifest = tmp_path / "agentcell.yaml"
    manifest.write_text(yaml.safe_dump_all(objs))

    def k(*args: str, timeout: float = 600) -> str:
        return subprocess.run([kubectl, *args], check=True, capture_output=True, text=True, timeout=timeout).stdout

    k("apply", "-f", str(manifest))
    forward = None
    try:
        k("-n", "agentcell", "rollout", "status", "daemonset/agentcell-cell", "--timeout=600s")
        k("-n", "agentcell", "rollout", "status", "deployment/agentcell-gateway", "--timeout=300s")
        port = 40000 + os.getpid() % 20000
        forward = subprocess.Popen([kubectl, "-n", "agentcell", "port-forward", "service/agentcell-gateway",
                                    f"{port}:80"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        time.sleep(3)
        from agentcell.sdk.sandbox_sync import Sandbox

        sbx = Sandbox.create(api_url=f"http://127.0.0.1:{port}", api_key=gateway_key)
        try:
            assert sbx.run_code("sum(range(10))").text == "45"
            assert sbx.commands.run("echo ok").stdout.strip() == "ok"
        finally:
            sbx.kill()
    finally:
        if forward is not None:
            forward.terminate()
            forward.wait(10)
        k("delete", "--wait=false", "-f", str(manifest), timeout=120)
