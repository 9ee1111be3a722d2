"""The deployment files under deploy/ (KubeRay, LeaderWorkerSet, the Dockerfile), checked without a
cluster: every YAML document parses and carries the fields its operator needs; the `tandem serve`
each one runs parses with Tandem's own argument parser; and the numbers that must agree do (the
probes' port and the server's, Ray CPUs and instances, the model path and the volumes, the Service
and the pods, the image's versions and the project's pins).

Nothing here applies a manifest: no Kubernetes runs in this repository's tests.
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.entrypoints.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RAYCLUSTER = DEPLOY / "kuberay" / "raycluster.yaml"
LWS = DEPLOY / "lws" / "leaderworkerset.yaml"
SEPARATORS = set("();|&")
REDIRECTIONS = {">", ">>", "<", ">&", "<&", "&>"}


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


# -- reading a container's shell ---------------------------------------------------------------


def shell_commands(container: dict[str, Any]) -> list[list[str]]:
    """The simple commands a container runs, each as its words: `command` + `args`, or, when that is
    `bash -c [--] SCRIPT`, the commands of the script (continued lines joined, redirections and a
    leading `exec` dropped, quotes removed, variables left as written)."""
    argv = [*container.get("command", []), *container.get("args", [])]
    if not (len(argv) >= 3 and Path(argv[0]).name in ("bash", "sh") and re.fullmatch(r"-\w*c", argv[1])):
        return [argv]
    rest = argv[2:]
    if rest[0] == "--":
        rest = rest[1:]
    # Kubernetes expands $(NAME) from the container's environment before the shell runs.
    script = re.sub(r"\$\(([A-Za-z_]\w*)\)", r"$\1", rest[0].replace("\\\n", " "))
    commands: list[list[str]] = []
    for line in script.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        tokens = iter(lexer)
        for token in tokens:
            if token in REDIRECTIONS:
                next(tokens, None)  # the file (or fd) redirected to
                if words and words[-1].isdigit():
                    words.pop()  # the fd redirected from
            elif set(token) <= SEPARATORS | {"<", ">"}:
                commands.append(words)
                words = []
            else:
                words.append(token)
        commands.append(words)
    return [c[1:] if c[:1] == ["exec"] else c for c in commands if c]


def find_command(container: dict[str, Any], *prefix: str) -> list[str] | None:
    found = [c for c in shell_commands(container) if tuple(c[: len(prefix)]) == prefix]
    assert len(found) <= 1, f"{container['name']} runs {' '.join(prefix)} {len(found)} times"
    return found[0] if found else None


def runs_ray_start(container: dict[str, Any]) -> bool:
    return any(
        c[:2] == ["ray", "start"] or c[:1] == ["$KUBERAY_GEN_RAY_START_CMD"]
        for c in shell_commands(container)
    )


def ray_start_options(words: list[str]) -> dict[str, str | bool]:
    """`ray start --name=value --flag ...` as {name: value or True}; the manifests write every
    option with `=`, so a bare word after an option is an error here."""
    assert words[:2] == ["ray", "start"], words
    options: dict[str, str | bool] = {}
    for word in words[2:]:
        assert word.startswith("--"), f"`ray start` option not written as --name=value: {word!r} in {words}"
        name, eq, value = word[2:].partition("=")
        options[name] = value if eq else True
    return options


# -- what a deployment file describes ----------------------------------------------------------


@dataclass
class Workers:
    name: str
    pod: dict[str, Any]  # pod spec
    labels: dict[str, str]  # what the operator's pods carry
    count: int  # pods per server
    ray_cpus: float  # Ray's CPU resource per pod


@dataclass
class Server:
    path: Path
    docs: list[dict[str, Any]]
    pod: dict[str, Any]
    labels: dict[str, str]
    container: dict[str, Any]
    serve_words: list[str]
    args: argparse.Namespace
    workers: list[Workers] = field(default_factory=list)


def cpu_quantity(value: Any) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def container_cpus(container: dict[str, Any]) -> float:
    """The CPUs Ray counts for a pod whose options do not say (KubeRay: the limit, else the request)."""
    resources = container.get("resources", {})
    for kind in ("limits", "requests"):
        if "cpu" in resources.get(kind, {}):
            return math.ceil(cpu_quantity(resources[kind]["cpu"]))
    raise AssertionError(f"{container['name']}: no CPU request or limit")


def the_container(pod: dict[str, Any]) -> dict[str, Any]:
    containers = pod["containers"]
    assert len(containers) == 1, "one container per Ray pod (KubeRay takes the first as Ray's)"
    return containers[0]


def server_of(path: Path) -> Server:
    docs = load(path)
    kinds = [d["kind"] for d in docs]
    if "RayCluster" in kinds:
        cluster = next(d for d in docs if d["kind"] == "RayCluster")
        name = cluster["metadata"]["name"]
        head = cluster["spec"]["headGroupSpec"]["template"]
        pod, labels = (
            head["spec"],
            {
                **head.get("metadata", {}).get("labels", {}),
                "ray.io/cluster": name,
                "ray.io/node-type": "head",
                "ray.io/group": "headgroup",
            },
        )
        workers = []
        for group in cluster["spec"].get("workerGroupSpecs", []):
            template = group["template"]
            container = the_container(template["spec"])
            explicit = find_command(container, "ray", "start")
            options = ray_start_options(explicit) if explicit else group.get("rayStartParams", {})
            cpus = float(options["num-cpus"]) if "num-cpus" in options else container_cpus(container)
            workers.append(
                Workers(
                    group["groupName"],
                    template["spec"],
                    {
                        **template.get("metadata", {}).get("labels", {}),
                        "ray.io/cluster": name,
                        "ray.io/node-type": "worker",
                        "ray.io/group": group["groupName"],
                    },
                    group["replicas"],
                    cpus,
                )
            )
    elif "LeaderWorkerSet" in kinds:
        lws = next(d for d in docs if d["kind"] == "LeaderWorkerSet")
        name = lws["metadata"]["name"]
        template = lws["spec"]["leaderWorkerTemplate"]
        leader = template["leaderTemplate"]
        pod, labels = (
            leader["spec"],
            {
                **leader.get("metadata", {}).get("labels", {}),
                "leaderworkerset.sigs.k8s.io/name": name,
                "leaderworkerset.sigs.k8s.io/worker-index": "0",
            },
        )
        worker = template["workerTemplate"]
        container = the_container(worker["spec"])
        start = find_command(container, "ray", "start")
        assert start is not None, "LWS workers must run `ray start --address ...`"
        options = ray_start_options(start)
        cpus = float(options["num-cpus"]) if "num-cpus" in options else container_cpus(container)
        workers = [
            Workers(
                "workers",
                worker["spec"],
                {
                    **worker.get("metadata", {}).get("labels", {}),
                    "leaderworkerset.sigs.k8s.io/name": name,
                    "leaderworkerset.sigs.k8s.io/worker-index": "1",
                },
                template["size"] - 1,
                cpus,
            )
        ]
    else:
        raise AssertionError(f"{path}: neither a RayCluster nor a LeaderWorkerSet")
    serving = [(c, find_command(c, "tandem", "serve")) for c in pod["containers"]]
    serving = [(c, words) for c, words in serving if words is not None]
    assert len(serving) == 1, f"{path}: exactly one container of the server pod runs `tandem serve`"
    container, words = serving[0]
    flags = {w.split("=", 1)[0] for w in words[2:] if w.startswith("-")}
    unknown = sorted(flags - set(serve_parser()._option_string_actions))
    assert not unknown, f"{path}: `tandem serve` has no option {unknown}"
    try:
        args = build_parser().parse_args(words[1:])
    except SystemExit:
        pytest.fail(f"{path}: `tandem serve` rejects its arguments: {shlex.join(words)} (see stderr)")
    return Server(path, docs, pod, labels, container, words, args, workers)


DEPLOYMENTS = [RAYCLUSTER, LWS]


@pytest.mark.parametrize("path", DEPLOYMENTS, ids=lambda p: p.parent.name)
def test_tandem_serve_takes_every_option_given(path):
    """Every `--flag` exists in `tandem serve --help` (spelled out: argparse would take a prefix) and
    the whole command line parses."""
    server_of(path)


@pytest.fixture(scope="module", params=DEPLOYMENTS, ids=lambda p: p.parent.name)
def server(request: pytest.FixtureRequest) -> Server:
    return server_of(request.param)


def resolve_port(container: dict[str, Any], port: Any) -> int:
    if isinstance(port, int):
        return port
    named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    assert port in named, f"{container['name']} has no port named {port!r}"
    return named[port]


def pod_templates(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pod spec in a document (anything holding a `containers` list)."""
    found = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("containers"), list):
                found.append(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    return found


# -- every file --------------------------------------------------------------------------------


def test_the_deployment_files_exist():
    assert {RAYCLUSTER, LWS} <= set(yaml_files())
    assert (DEPLOY / "Dockerfile").is_file()


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_document_parses_and_names_itself(path):
    docs = load(path)
    assert docs, f"{path} holds no document"
    for doc in docs:
        assert isinstance(doc, dict), f"{path}: a document that is not a mapping"
        for key in ("apiVersion", "kind"):
            assert isinstance(doc.get(key), str) and doc[key], f"{path}: a document without {key}"
        name = doc.get("metadata", {}).get("name")
        assert isinstance(name, str) and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), (
            f"{path}: {doc['kind']} has no valid metadata.name: {name!r}"
        )


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_container_requests_what_it_needs(path):
    for doc in load(path):
        for pod in pod_templates(doc):
            for container in pod["containers"]:
                where = f"{path.name}: {doc['kind']} container {container.get('name')!r}"
                assert container.get("image"), f"{where} has no image"
                resources = container.get("resources", {})
                requests, limits = resources.get("requests", {}), resources.get("limits", {})
                assert {"cpu", "memory"} <= set(requests), f"{where} requests no cpu/memory"
                if "cpu" in limits:
                    assert cpu_quantity(limits["cpu"]) >= cpu_quantity(requests["cpu"]), where


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_claimed_volumes_are_defined_beside_them(path):
    docs = load(path)
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    for doc in docs:
        for pod in pod_templates(doc):
            for volume in pod.get("volumes", []):
                claim = volume.get("persistentVolumeClaim", {}).get("claimName")
                assert claim is None or claim in claims, f"{path.name}: claim {claim!r} is not defined"


def test_files_applied_together_do_not_overwrite_each_other():
    """A name two files (or a file and an operator) both use must hold the same object: LWS owns a
    headless Service named after the LeaderWorkerSet, KubeRay one named `<cluster>-head-svc`."""
    seen: dict[tuple[str, str], tuple[str, Any]] = {}

    def claim(kind: str, name: str, owner: str, content: Any) -> None:
        key = (kind, name)
        if key in seen:
            assert seen[key][1] == content, f"{kind} {name!r}: {seen[key][0]} and {owner} both define it"
        seen[key] = (owner, content)

    for path in yaml_files():
        for doc in load(path):
            claim(doc["kind"], doc["metadata"]["name"], path.name, doc)
            if doc["kind"] == "LeaderWorkerSet":
                claim("Service", doc["metadata"]["name"], f"LWS {doc['metadata']['name']}", "operator")
            if doc["kind"] == "RayCluster":
                claim("Service", f"{doc['metadata']['name']}-head-svc", "KubeRay", "operator")


# -- the server and its workers, in each deployment --------------------------------------------


def test_the_server_listens_where_kubernetes_looks(server):
    args = server.args
    assert args.host == "0.0.0.0", f"{server.path.name}: --host must be 0.0.0.0 in a pod (probes use its IP)"
    ports = {p["containerPort"] for p in server.container.get("ports", [])}
    assert args.port in ports, f"{server.path.name}: port {args.port} is not a containerPort"
    if args.metrics_port is not None:
        assert args.metrics_port in ports, f"{server.path.name}: --metrics-port is not a containerPort"
        assert args.metrics_port != args.port


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe", "livenessProbe"])
def test_the_server_is_probed_on_health(server, probe):
    spec = server.container.get(probe)
    assert spec is not None, f"{server.path.name}: the server container has no {probe}"
    http = spec.get("httpGet")
    assert http is not None, f"{server.path.name}: {probe} is not an HTTP GET"
    assert http.get("path") == "/health", f"{server.path.name}: {probe} asks {http.get('path')!r}"
    assert resolve_port(server.container, http.get("port")) == server.args.port, (
        f"{server.path.name}: {probe} asks port {http.get('port')}, the server listens on {server.args.port}"
    )


def test_liveness_outlasts_the_drain(server):
    """SIGTERM drains for --drain-timeout: the pod must be given longer, and a liveness probe (503
    while draining) must not kill the container first."""
    drain = server.args.drain_timeout
    grace = server.pod.get("terminationGracePeriodSeconds", 30)
    assert grace > drain, (
        f"{server.path.name}: terminationGracePeriodSeconds {grace} <= --drain-timeout {drain}"
    )
    live = server.container["livenessProbe"]
    assert live.get("periodSeconds", 10) * live.get("failureThreshold", 3) > drain


def test_the_server_runs_on_ray_with_several_instances(server):
    args = server.args
    assert args.num_instances > 1 and args.ray_address is not None, server.serve_words
    assert args.num_threads is not None, f"{server.path.name}: --num-threads sets what each instance reserves"
    assert args.model_tag is not None and args.model_tag.startswith("/"), "MODEL: an absolute path"


def test_the_server_starts_ray_first_and_does_not_block(server):
    commands = shell_commands(server.container)
    starts = [i for i, c in enumerate(commands) if c[:2] == ["ray", "start"]]
    serves = [i for i, c in enumerate(commands) if c[:2] == ["tandem", "serve"]]
    assert len(starts) == 1 and starts[0] < serves[0], f"{server.path.name}: `ray start --head` first"
    options = ray_start_options(commands[starts[0]])
    assert options.get("head") is True
    assert "block" not in options, f"{server.path.name}: `ray start --block` never returns to `tandem serve`"
    if server.args.ray_address not in ("auto", None):
        assert server.args.ray_address.endswith(f":{options.get('port', '6379')}")


def test_the_workers_can_hold_every_instance(server):
    """Each instance reserves --num-threads CPUs on one node (a placement-group bundle); the server
    waits for all of them, so the worker pods must hold N bundles."""
    threads = server.args.num_threads
    head = ray_start_options(find_command(server.container, "ray", "start"))
    capacity = int(float(head.get("num-cpus", container_cpus(server.container))) // threads)
    for group in server.workers:
        container = the_container(group.pod)
        assert group.ray_cpus >= threads, f"{group.name}: {group.ray_cpus} Ray CPUs < --num-threads {threads}"
        assert container_cpus(container) >= group.ray_cpus, (
            f"{group.name}: Ray is told {group.ray_cpus} CPUs, the container has {container_cpus(container)}"
        )
        capacity += group.count * int(group.ray_cpus // threads)
    assert capacity >= server.args.num_instances, (
        f"{server.path.name}: room for {capacity} instances of {threads} CPUs, "
        f"--num-instances is {server.args.num_instances}"
    )


def test_every_pod_sees_the_model_at_the_same_path(server):
    model = Path(server.args.model_tag)

    def source(pod: dict[str, Any], container: dict[str, Any]) -> Any:
        mounts = [m for m in container.get("volumeMounts", []) if model.is_relative_to(m["mountPath"])]
        assert mounts, f"{server.path.name}: {container['name']} does not mount {model}"
        volume = next(v for v in pod.get("volumes", []) if v["name"] == mounts[0]["name"])
        return {k: v for k, v in volume.items() if k != "name"}

    expected = source(server.pod, server.container)
    for group in server.workers:
        assert source(group.pod, the_container(group.pod)) == expected, (
            f"{group.name} mounts another volume at {model}'s path"
        )


def test_every_ray_pod_runs_the_same_image(server):
    images = {c["image"] for c in server.pod["containers"]}
    for group in server.workers:
        images |= {c["image"] for c in group.pod["containers"]}
    assert len(images) == 1, f"{server.path.name}: Ray needs one Ray and Python version everywhere: {images}"


def test_the_service_reaches_the_server_only(server):
    services = [d for d in server.docs if d["kind"] == "Service"]
    assert services, f"{server.path.name}: no Service"
    for service in services:
        selector = service["spec"]["selector"]
        assert selector.items() <= server.labels.items(), (
            f"{server.path.name}: Service {service['metadata']['name']} does not select the server pod"
        )
        for group in server.workers:
            assert not selector.items() <= group.labels.items(), f"the Service also selects {group.name}"
        targets = [
            resolve_port(server.container, p.get("targetPort", p["port"])) for p in service["spec"]["ports"]
        ]
        assert server.args.port in targets


@pytest.mark.parametrize("path", DEPLOYMENTS, ids=lambda p: p.parent.name)
def test_ray_start_options_exist(path):
    """Each `ray start` parses with Ray's own command-line definition."""
    scripts = pytest.importorskip("ray.scripts.scripts")
    for doc in load(path):
        for pod in pod_templates(doc):
            for container in pod["containers"]:
                words = find_command(container, "ray", "start")
                if words is None:
                    continue
                try:
                    scripts.start.make_context("ray start", words[2:])
                except Exception as exc:  # click's usage errors
                    pytest.fail(f"{path.name}: {shlex.join(words)}: {exc}")


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_container_scripts_are_valid_shell(path):
    """`bash -n`: every `bash -c SCRIPT` parses (quotes closed, loops ended), without running it."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash here")
    for doc in load(path):
        for pod in pod_templates(doc):
            for container in pod["containers"]:
                argv = [*container.get("command", []), *container.get("args", [])]
                if len(argv) >= 3 and Path(argv[0]).name == "bash" and re.fullmatch(r"-\w*c", argv[1]):
                    script = argv[3] if argv[2] == "--" else argv[2]
                    proc = subprocess.run([bash, "-n", "-c", script], capture_output=True, text=True)
                    assert proc.returncode == 0, f"{path.name}: {container['name']}: {proc.stderr}"


# -- KubeRay -----------------------------------------------------------------------------------


def test_raycluster_fields():
    docs = load(RAYCLUSTER)
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    spec = cluster["spec"]
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    assert spec["workerGroupSpecs"], "no worker group"
    for group in [head, *spec["workerGroupSpecs"]]:
        params = group.get("rayStartParams", {})
        bad = {k: v for k, v in params.items() if not isinstance(v, str)}
        assert not bad, f"rayStartParams values must be strings (quote them): {bad}"
    for group in spec["workerGroupSpecs"]:
        assert group.get("groupName")
        counts = {k: group.get(k) for k in ("replicas", "minReplicas", "maxReplicas")}
        assert all(isinstance(v, int) for v in counts.values()), f"{group.get('groupName')}: {counts}"
        assert counts["minReplicas"] <= counts["replicas"] <= counts["maxReplicas"], counts


def test_raycluster_head_starts_ray_as_its_params_say():
    cluster = next(d for d in load(RAYCLUSTER) if d["kind"] == "RayCluster")
    head = cluster["spec"]["headGroupSpec"]
    options = ray_start_options(find_command(the_container(head["template"]["spec"]), "ray", "start"))
    for key, value in head["rayStartParams"].items():
        assert str(options.get(key)).lower() == value.lower(), (
            f"rayStartParams {key}={value!r}, the head's `ray start` says {options.get(key)!r}"
        )


def test_raycluster_every_pod_starts_ray_when_commands_are_overwritten():
    """With ray.io/overwrite-container-cmd, KubeRay runs the containers' commands as written: a
    group whose container does not start Ray itself never joins the cluster."""
    cluster = next(d for d in load(RAYCLUSTER) if d["kind"] == "RayCluster")
    if cluster["metadata"].get("annotations", {}).get("ray.io/overwrite-container-cmd") != "true":
        pytest.skip("KubeRay generates the commands")
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    for group in groups:
        container = the_container(group["template"]["spec"])
        assert runs_ray_start(container), f"{container['name']} does not start Ray"


def test_raycluster_ray_version_matches_the_image():
    cluster = next(d for d in load(RAYCLUSTER) if d["kind"] == "RayCluster")
    image_ray = re.search(r"^ARG RAY_VERSION=(\S+)$", (DEPLOY / "Dockerfile").read_text(), re.M)
    assert image_ray is not None, "deploy/Dockerfile pins no RAY_VERSION"
    assert cluster["spec"]["rayVersion"] == image_ray.group(1)


# -- LeaderWorkerSet ---------------------------------------------------------------------------


def test_leaderworkerset_fields():
    lws = next(d for d in load(LWS) if d["kind"] == "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    template = lws["spec"]["leaderWorkerTemplate"]
    assert isinstance(template["size"], int) and template["size"] >= 2, "1 leader + at least 1 worker"
    for role in ("leaderTemplate", "workerTemplate"):
        assert template[role]["spec"]["containers"], f"{role} has no container"
    # The leader is Ready only once its instances run on the workers: LeaderReady would never
    # create them.
    assert lws["spec"].get("startupPolicy", "LeaderCreated") == "LeaderCreated"
    # A gang is scheduled by one scheduler: both roles name the same one.
    names = {template[role]["spec"].get("schedulerName") for role in ("leaderTemplate", "workerTemplate")}
    assert len(names) == 1, f"leader and workers use different schedulers: {names}"


def test_leaderworkerset_workers_join_the_leader():
    lws = next(d for d in load(LWS) if d["kind"] == "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    leader = ray_start_options(
        find_command(the_container(template["leaderTemplate"]["spec"]), "ray", "start")
    )
    worker = ray_start_options(
        find_command(the_container(template["workerTemplate"]["spec"]), "ray", "start")
    )
    port = leader.get("port", "6379")
    assert worker.get("address") in (f"$LWS_LEADER_ADDRESS:{port}", f"${{LWS_LEADER_ADDRESS}}:{port}"), worker
    assert worker.get("block") is True, "a worker's `ray start` must stay in the foreground (--block)"
    for role in ("leaderTemplate", "workerTemplate"):
        container = the_container(template[role]["spec"])
        assert any(m["mountPath"] == "/dev/shm" for m in container.get("volumeMounts", [])), (
            f"{role}: Ray's object store needs a /dev/shm larger than the 64 MiB default"
        )


# -- the image ---------------------------------------------------------------------------------


def test_dockerfile_installs_the_pinned_torch_and_the_cluster_extra():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    pin = re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin is not None
    image_torch = re.search(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.M)
    assert image_torch is not None and image_torch.group(1) == pin.group(1)
    assert "--index-url https://download.pytorch.org/whl/cpu" in dockerfile
    assert re.search(r"pip install .*\"\.\[cluster\]\"", dockerfile)
    assert re.search(r"^FROM python:3\.\d+-slim", dockerfile, re.M)
