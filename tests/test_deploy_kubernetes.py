"""deploy/kubernetes/: every manifest valid for Kubernetes 1.34 (kubernetes-validate, strict: no unknown
fields: the upstream OpenAPI schemas of `kubernetes/kubernetes: api/openapi-spec`), and consistent with
xpud: the ConfigMap is a valid xpud.toml with the device plugin and [cluster] on, completed per node by the
DaemonSet's environment as kubelet expands it; the DaemonSet runs `xpud --kubelet` with that config,
kubelet's device-plugin and pod-resources directories, the driver libraries through runtimeClassName
nvidia, and the MPS tmpfs as /dev/shm; the extender Deployment reads a federated daemon's socket and its
Service is the address the scheduler config's extender calls, with the verbs `xpud extender` serves and
the resources the plugin registers; the Containerfile installs xpud on a CUDA base image. The MPS keeper
DaemonSet owns the MPS control daemons (the config says so) in the directory xpud's pod shares, with the
same driver and /dev/shm, so xpud's DaemonSet rolls while the keeper's is replaced only on delete."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from xpud import config

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
KUBERNETES = "1.34.0"
MANIFESTS = [
    "configmap.yaml",
    "rbac.yaml",
    "daemonset.yaml",
    "mps-keeper.yaml",
    "extender.yaml",
    "runtimeclass.yaml",
]


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifests_are_valid_kubernetes(name):
    for doc in docs(name):
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_a_broken_manifest_is_caught():
    (ds,) = docs("daemonset.yaml")
    ds["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []  # a typo: not a field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, KUBERNETES, strict=True)


NODE_ENV = {"XPUD_CLUSTER_LISTEN": "10.0.0.7:7443", "XPUD_CLUSTER_CERT": "/c", "XPUD_CLUSTER_KEY": "/k"}


def test_the_pieces_fit_together():
    (cm,) = docs("configmap.yaml")
    cfg = config.parse(cm["data"]["xpud.toml"], "configmap.yaml", environ=NODE_ENV)
    assert cfg.kubelet.enabled and cfg.kubelet.socket_dir == "/var/lib/kubelet/device-plugins"
    (ds,) = docs("daemonset.yaml")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"][:2] == ["xpud", "--kubelet"] and "/etc/xpud/xpud.toml" in c["command"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/etc/xpud"]]["configMap"]["name"] == cm["metadata"]["name"]
    assert volumes[mounts[cfg.kubelet.socket_dir]]["hostPath"]["path"] == cfg.kubelet.socket_dir
    assert pod["serviceAccountName"] in {d["metadata"]["name"] for d in docs("rbac.yaml")}
    (sched,) = docs("scheduler-config.yaml")
    assert (
        sched["apiVersion"] == "kubescheduler.config.k8s.io/v1"
        and sched["kind"] == "KubeSchedulerConfiguration"
    )
    (extender,) = sched["extenders"]
    assert (extender["filterVerb"], extender["prioritizeVerb"]) == ("filter", "prioritize")
    assert extender["weight"] > 0 and extender["urlPrefix"].startswith("http")
    assert [r["name"] for r in extender["managedResources"]] == list(cfg.kubelet.resources)


def expand(env: list[dict], downward: dict[str, str]) -> dict[str, str]:
    """A container's environment as kubelet makes it: fieldRef values, then $(VAR) from earlier entries."""
    out: dict[str, str] = {}
    for e in env:
        if "valueFrom" in e:
            out[e["name"]] = downward[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            out[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m.group(1), m.group(0)), e["value"])
    return out


def test_each_node_gets_its_own_cluster_identity_and_the_driver():
    (cm,) = docs("configmap.yaml")
    (ds,) = docs("daemonset.yaml")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = expand(c["env"], {"spec.nodeName": "gpu-7", "status.hostIP": "10.0.0.7"})
    cfg = config.parse(cm["data"]["xpud.toml"], "configmap.yaml", environ=env)
    assert cfg.cluster.enabled and (cfg.cluster.name, cfg.cluster.listen) == ("gpu-7", "10.0.0.7:7443")
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    certs = volumes[mounts["/etc/xpud/certs"]["name"]]["secret"]["secretName"]
    assert certs == "xpud-cluster-certs"
    for path in (cfg.cluster.ca, cfg.cluster.cert, cfg.cluster.key):
        assert Path(path).parent == Path("/etc/xpud/certs"), path
    assert cfg.cluster.cert.endswith("/gpu-7.crt") and pod["hostNetwork"] is True
    # the driver's libraries: nvidia-container-runtime through the RuntimeClass, every card visible
    (rc,) = docs("runtimeclass.yaml")
    assert pod["runtimeClassName"] == rc["metadata"]["name"] == "nvidia" and rc["handler"] == "nvidia"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and "utility" in env["NVIDIA_DRIVER_CAPABILITIES"]
    # kubelet's PodResources socket and the MPS /dev/shm are the host's, at the paths the config names
    pr_dir = str(Path(cfg.kubelet.pod_resources_socket).parent)
    assert volumes[mounts[pr_dir]["name"]]["hostPath"]["path"] == pr_dir
    assert volumes[mounts["/dev/shm"]["name"]]["hostPath"]["path"] == cfg.kubelet.mps_shm_dir
    (init,) = pod["initContainers"]
    assert f"tmpfs {cfg.kubelet.mps_shm_dir}" in init["command"][-1]
    assert init["volumeMounts"][0]["mountPropagation"] == "Bidirectional"
    assert mounts[cfg.daemon.runtime_dir]["mountPropagation"] == "HostToContainer"


def test_kube_scheduler_reaches_the_extender_and_the_extender_its_cluster():
    (cm,) = docs("configmap.yaml")
    cfg = config.parse(cm["data"]["xpud.toml"], "configmap.yaml", environ=NODE_ENV)
    deployment, service = docs("extender.yaml")
    pod = deployment["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    cmd = c["command"]
    assert cmd[:2] == ["xpud", "extender"] and cmd[cmd.index("--cluster") + 1] == cfg.daemon.runtime_dir
    (mount,) = c["volumeMounts"]
    (volume,) = pod["volumes"]
    assert mount["mountPath"] == volume["hostPath"]["path"] == cfg.daemon.runtime_dir
    port = int(cmd[cmd.index("--listen") + 1].rsplit(":", 1)[1])
    assert c["ports"][0]["containerPort"] == port
    (sched,) = docs("scheduler-config.yaml")
    (extender,) = sched["extenders"]
    (svc_port,) = service["spec"]["ports"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert extender["urlPrefix"] == f"http://{service['spec']['clusterIP']}:{svc_port['port']}/xpud"
    assert pod["serviceAccountName"] in {d["metadata"]["name"] for d in docs("rbac.yaml")}


def test_the_containerfile_installs_xpud_on_a_cuda_base():
    text = (DEPLOY / "Containerfile").read_text()
    (base,) = re.findall(r"^FROM (\S+)", text, re.M)
    assert base.startswith("docker.io/nvidia/cuda:") and "-base-" in base
    assert re.search(r"pip install --no-cache-dir /src/xpud", text)
    (ds,) = docs("daemonset.yaml")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    assert c["command"][0] == "xpud"  # on the image's PATH (/opt/xpud/bin)


def test_the_configmap_alone_is_refused_without_the_nodes_environment():
    """Seeds without a listen address: the daemon would run unfederated, so the file alone is refused."""
    (cm,) = docs("configmap.yaml")
    with pytest.raises(config.ConfigError, match="set listen too"):
        config.parse(cm["data"]["xpud.toml"], "configmap.yaml")


def test_the_mps_keeper_owns_the_control_daemons_so_xpud_can_roll():
    (cm,) = docs("configmap.yaml")
    cfg = config.parse(cm["data"]["xpud.toml"], "configmap.yaml", environ=NODE_ENV)
    assert cfg.cards.mps_keeper is True  # xpud asks the keeper instead of starting daemons in its pod
    (ds,) = docs("daemonset.yaml")
    (keeper,) = docs("mps-keeper.yaml")
    assert ds["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert keeper["spec"]["updateStrategy"]["type"] == "OnDelete"  # its end ends every MPS client
    xpod, kpod = ds["spec"]["template"]["spec"], keeper["spec"]["template"]["spec"]
    assert keeper["spec"]["selector"]["matchLabels"] != ds["spec"]["selector"]["matchLabels"]
    assert kpod["runtimeClassName"] == xpod["runtimeClassName"] == "nvidia" and kpod["hostPID"] is True
    assert kpod["nodeSelector"] == xpod["nodeSelector"] and kpod["tolerations"] == xpod["tolerations"]
    (xc,), (kc,) = xpod["containers"], kpod["containers"]
    assert kc["image"] == xc["image"]
    mps_dir = str(cfg.runtime_dir / "mps")
    cmd = kc["command"]
    assert cmd[:2] == ["xpud", "mps-keeper"] and cmd[cmd.index("--dir") + 1] == mps_dir
    env = {e["name"]: e["value"] for e in kc["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and "compute" in env["NVIDIA_DRIVER_CAPABILITIES"]

    def host_path(pod, container, path):
        (m,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
        (v,) = [v for v in pod["volumes"] if v["name"] == m["name"]]
        return v["hostPath"]["path"], m.get("mountPropagation")

    # the same host directory: the keeper's --dir is <runtime_dir>/mps inside xpud's pod too
    assert host_path(kpod, kc, mps_dir) == (mps_dir, "HostToContainer")
    assert host_path(xpod, xc, str(cfg.runtime_dir)) == (str(cfg.runtime_dir), "HostToContainer")
    # the daemons' /dev/shm is the MPS tmpfs that client pods get, mounted on the host by either pod
    assert host_path(kpod, kc, "/dev/shm")[0] == cfg.kubelet.mps_shm_dir
    (kinit,), (xinit,) = kpod["initContainers"], xpod["initContainers"]
    assert kinit["command"] == xinit["command"] and f"tmpfs {cfg.kubelet.mps_shm_dir}" in kinit["command"][-1]
    assert "flock " in kinit["command"][-1]  # the two pods' init containers never mount it twice
    assert kinit["volumeMounts"][0]["mountPropagation"] == "Bidirectional"
