"""deploy/kubernetes/: every manifest valid for Kubernetes 1.34 (kubernetes-validate, strict: no unknown
fields), and consistent with xpud: the ConfigMap is a valid xpud.toml with the device plugin on, the
DaemonSet runs `xpud --kubelet` with that config and kubelet's directory, and the scheduler config's
extender names the verbs `xpud extender` serves and the resources the plugin registers."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from xpud import config

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
KUBERNETES = "1.34.0"
MANIFESTS = ["configmap.yaml", "rbac.yaml", "daemonset.yaml"]


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


def test_the_pieces_fit_together():
    (cm,) = docs("configmap.yaml")
    cfg = config.parse(cm["data"]["xpud.toml"], "configmap.yaml")
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
