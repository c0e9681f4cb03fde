"""The Kubernetes device plugin driven by a stand-in kubelet (tests/kubelet_standin.py) over Unix sockets:
registration, ListAndWatch as bare-metal leases come and go and a card goes unhealthy,
GetPreferredAllocation, Allocate, pods going away, and a kubelet restart.

No kubelet or container runtime runs here; the messages follow the upstream definitions:
- `kubernetes/kubelet: pkg/apis/deviceplugin/v1beta1/api.proto` (Registration, DevicePlugin,
  ContainerAllocateResponse {envs, mounts, devices, annotations, cdi_devices}), and
  `kubernetes/kubelet: pkg/apis/podresources/v1/api.proto` (PodResourcesLister.List).
- What a container needs, as `NVIDIA/k8s-device-plugin: internal/plugin/server.go` answers Allocate:
  NVIDIA_VISIBLE_DEVICES=<uuids> (envvar strategy), CDI names QualifiedName("gpu", <uuid>) =
  nvidia.com/gpu=<uuid> for cards and MIG devices alike (cdi-cri), DeviceSpecs by minor number with the
  control nodes optional; `internal/plugin/mps.go`: the MPS pipe directory and a host tmpfs as /dev/shm.
- MIG capability files and nodes in the driver's format (tests/driver_tree.py)."""

from __future__ import annotations

import json
import os
import stat
import time

import grpc
import pytest

from tests import driver_tree
from tests.conftest import wait_until
from tests.daemons import DaemonProc
from tests.kubelet_standin import StandInKubelet

GPU, HALF, QUARTER = "xpu.dev/gpu", "xpu.dev/vxpu-half", "xpu.dev/vxpu-quarter"


@pytest.fixture
def site(short_tmp):
    plugins = short_tmp / "dp"
    plugins.mkdir()
    kubelet = StandInKubelet(plugins, pod_resources=short_tmp / "pr.sock").start()
    tree = driver_tree.build(short_tmp / "drv", list(range(8)))
    config = f"""
[leases]
grace_s = 300.0  # the bare-metal lease below has no Hold stream
[health]
clear_s = 1.0
event_window_s = 0.5
[kubelet]
socket_dir = "{plugins}"
pod_gone_grace_s = 1.0
pod_resources_socket = "{short_tmp / "pr.sock"}"
mps_shm_dir = "{short_tmp / "shm"}"
dev_root = "{tree.dev}"
proc_root = "{tree.proc}"
"""
    (short_tmp / "x").mkdir()
    d = DaemonProc(short_tmp / "x", "pcie-8x-l40s", config, args=("--kubelet",)).start()
    yield d, kubelet
    d.kill()
    kubelet.stop()


def cards_json(d) -> list[dict]:
    return json.loads(d.xpu("ls", "--json").stdout)


def uuids(d) -> list[str]:
    return [c["uuid"] for c in json.loads(d.xpu("ls", "--json").stdout)]


def pod_leases(d) -> dict[str, dict]:
    leases = json.loads(d.xpu("leases", "--json").stdout)["leases"]
    return {le["anchor"]: le for le in leases if (le["anchor"] or "").startswith("pod:")}


def test_the_whole_conversation(site, short_tmp):
    d, kubelet = site
    cards = uuids(d)
    for resource in (GPU, HALF, QUARTER):
        p = kubelet.plugin(resource)
        assert p.request.version == "v1beta1" and p.request.endpoint.endswith(".sock")
        assert p.options.get_preferred_allocation_available
    gpus = kubelet.wait_devices(GPU, lambda devs: len(devs) == 8)
    assert set(gpus) == set(cards) and set(gpus.values()) == {"Healthy"}
    numa = {x.ID: [n.ID for n in x.topology.nodes] for x in kubelet.plugin(GPU).updates[-1][1]}
    assert numa[cards[0]] == [0] and numa[cards[7]] == [1]
    # slots: as many per card as fit there now (MPS shares: 2 halves, 4 quarters)
    assert len(kubelet.wait_devices(HALF, lambda devs: len(devs) == 16)) == 16
    assert len(kubelet.wait_devices(QUARTER, lambda devs: len(devs) == 32)) == 32

    # a bare-metal lease withdraws its cards from every resource, and kubelet cannot allocate them
    with d.client() as c:
        bare = c.acquire_lease("xpu", gpus=2)
    held = [cards[i] for i in bare.lease.cards]
    kubelet.wait_devices(GPU, lambda devs: len(devs) == 6)
    withdrawn_at = kubelet.plugin(GPU).updates[-1][0]
    kubelet.wait_devices(HALF, lambda devs: not any(k.split("_")[0] in held for k in devs))
    with pytest.raises(grpc.RpcError) as e:
        kubelet.allocate("pod-x", GPU, [held[0]])
    assert (
        e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        and f"held by lease {bare.lease.id}" in e.value.details()
    )
    kubelet.pods.clear()

    # the preferred pair is one PCIe switch (PIX), as placement would choose
    free = sorted(kubelet.plugin(GPU).devices())
    pair = kubelet.preferred(GPU, free, 2)
    topo = json.loads(d.xpu("topo", "--json").stdout)
    i, j = (cards.index(x) for x in pair)
    assert topo["labels"][i][j] == "PIX", (pair, topo["labels"][i])
    must = kubelet.preferred(GPU, free, 2, must=[free[-1]])
    assert free[-1] in must and len(must) == 2

    # Allocate: a lease owned by the pod, with what `xpu run` gives its child
    resp = kubelet.allocate("pod-a", GPU, pair)
    lease = pod_leases(d)[f"pod:{pair[0]}"]
    assert sorted(lease["cards"]) == sorted([i, j]) and lease["owner_uid"] == 0 and not lease["held"]
    assert resp.envs["CUDA_VISIBLE_DEVICES"] == ",".join(pair) and resp.envs["XPU_LEASE_ID"] == lease["id"]
    # envvar strategy (the default): nvidia-container-runtime gives exactly these cards, not the image's `all`
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(pair) and not resp.cdi_devices
    minors = {c["uuid"]: c["minor_number"] for c in cards_json(d)}
    nodes = {x.container_path: x.host_path for x in resp.devices}
    assert set(nodes) == {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"} | {
        f"/dev/nvidia{minors[u]}" for u in pair
    }
    assert nodes["/dev/nvidiactl"].startswith(str(short_tmp)) and all(
        x.permissions == "rw" for x in resp.devices
    )
    # the pod's cards stay listed (kubelet counts them as allocated); their slots go
    kubelet.wait_devices(HALF, lambda devs: not any(k.split("_")[0] in pair for k in devs))
    assert set(pair) <= set(kubelet.plugin(GPU).devices())

    half = sorted(kubelet.plugin(HALF).devices())
    slot = kubelet.preferred(HALF, half, 1)
    resp = kubelet.allocate("pod-b", HALF, slot)
    assert resp.envs["XPU_MODE"] == "vxpu-half" and resp.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    pipe = resp.envs["CUDA_MPS_PIPE_DIRECTORY"]
    # the pipes and the MPS server's shared memory (a host tmpfs as the pod's /dev/shm)
    assert [(m.host_path, m.container_path) for m in resp.mounts] == [
        (pipe, pipe),
        (str(short_tmp / "shm"), "/dev/shm"),
    ]
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == slot[0].split("_")[0]  # an MPS slice: its card
    sliced = slot[0].split("_")[0]
    kubelet.wait_devices(GPU, lambda devs: sliced not in devs)  # a sliced card is no whole card
    kubelet.wait_devices(HALF, lambda devs: slot[0] in devs and sum(k.startswith(sliced) for k in devs) == 2)
    kubelet.wait_devices(QUARTER, lambda devs: sum(k.startswith(sliced) for k in devs) == 2)  # half is left

    # an unhealthy card: its pod's slot is reported Unhealthy; a free card is reported Unhealthy
    free_card = next(x for x in kubelet.plugin(GPU).devices() if x not in pair)
    for u in (sliced, free_card):
        assert d.xpu("fault", "inject", str(cards.index(u)), "xid", "79").returncode == 0
    kubelet.wait_devices(HALF, lambda devs: devs.get(slot[0]) == "Unhealthy")
    kubelet.wait_devices(GPU, lambda devs: devs.get(free_card) == "Unhealthy")
    for u in (sliced, free_card):
        assert d.xpu("fault", "clear", str(cards.index(u))).returncode == 0
    kubelet.wait_devices(GPU, lambda devs: devs.get(free_card) == "Healthy", timeout=15)

    # kubelet restarts (its sockets deleted): the plugins serve again and register again, state intact
    before = len(kubelet.registrations)
    kubelet.restart()
    wait_until(lambda: len(kubelet.registrations) >= before + 3, timeout=15)
    gpus = kubelet.wait_devices(GPU, lambda devs: set(pair) <= set(devs) and held[0] not in devs)
    assert len(pod_leases(d)) == 2

    # pod A goes: once kubelet's PodResources no longer lists it, its lease is reclaimed (the checkpoint
    # still lists it: kubelet rewrites that lazily)
    kubelet.delete_pod("pod-a")
    wait_until(lambda: f"pod:{pair[0]}" not in pod_leases(d), timeout=15)
    assert f"pod:{slot[0]}" in pod_leases(d)
    # pod B goes and kubelet gives its slot to pod C at once (before the grace): the old lease ends first
    old = pod_leases(d)[f"pod:{slot[0]}"]["id"]
    kubelet.delete_pod("pod-b")
    resp = kubelet.allocate("pod-c", HALF, slot)
    assert (
        resp.envs["XPU_LEASE_ID"] != old
        and pod_leases(d)[f"pod:{slot[0]}"]["id"] == resp.envs["XPU_LEASE_ID"]
    )

    # the bare-metal lease goes: its cards come back; never offered while it was held
    released_at = time.monotonic()  # updates before this were sent while it was held (the update that
    with d.client() as c:  # offers its cards back may come before Release answers)
        c.release(bare.lease.id, bare.token)
    kubelet.wait_devices(GPU, lambda devs: set(held) <= set(devs))
    for resource in (GPU, HALF, QUARTER):
        for t, devs in kubelet.plugin(resource).updates:
            if withdrawn_at <= t < released_at:
                assert not {x.ID.split("_")[0] for x in devs} & set(held), (resource, t)


@pytest.mark.parametrize(
    ("resources", "error"),
    [
        ('["xpu.dev/vxpu-tiny"]', "use <domain>/gpu or <domain>/<slice size>"),
        ('["gpu"]', "use <domain>/gpu"),
        ('["Bad_Domain/gpu"]', "use <domain>/gpu"),
        ('["a.io/gpu", "b.io/gpu"]', "each kind (gpu or a slice size) may be served once"),
        ('["a.io/vxpu-a-very-long-slice-name"]', "over kubelet's 63 characters"),
    ],
)
def test_resource_names_are_checked(resources, error):
    from xpud import config
    from xpud.errors import ConfigError

    sizes = "[slices.vxpu-a-very-long-slice-name]\nmemory_fraction = 0.1\ncompute_pct = 10\n"
    with pytest.raises(ConfigError, match=r"\[kubelet\] resources") as e:
        config.parse(f"[kubelet]\nresources = {resources}\n{sizes}", "x.toml")
    assert error in str(e.value)
    assert config.parse('[kubelet]\nresources = ["example.com/vxpu-half"]\n').kubelet.resources == (
        "example.com/vxpu-half",
    )


def test_pod_check_asks_kubelets_pod_resources_with_a_grace(short_tmp):
    import asyncio

    from xpud.bridges.kubelet import PodCheck

    sock = short_tmp / "pr.sock"
    now = [0.0]
    check = PodCheck(sock, grace_s=10, clock=lambda: now[0])
    assert asyncio.run(check({"a"})) == {}  # no kubelet answers: cannot tell, keep
    kubelet = StandInKubelet(short_tmp, pod_resources=sock).start()
    try:
        kubelet.pods["p1"] = [{"ContainerName": "c", "ResourceName": GPU, "DeviceIDs": {"0": ["a", "b"]}}]
        kubelet.pods["p2"] = [{"ContainerName": "c", "ResourceName": HALF, "DeviceIDs": {"0": ["c"]}}]
        assert asyncio.run(check({"a", "c", "z"})) == {}  # z missing: its grace starts
        now[0] = 10.5
        gone = asyncio.run(check({"a", "c", "z"}))
        assert set(gone) == {"z"} and "PodResources" in gone["z"] and "10 s" in gone["z"]
        del kubelet.pods["p2"]
        assert asyncio.run(check({"c"})) == {}  # c's grace starts now
    finally:
        kubelet.stop()
    now[0] = 30
    assert asyncio.run(check({"c"})) == {}  # kubelet gone: keep


def test_whole_cards_by_minor_number_and_cdi_names_on_dgx_a100(short_tmp):
    """dgx-a100's minors are not in NVML order: a node picked by index would be another card's."""
    plugins = short_tmp / "dp"
    plugins.mkdir()
    kubelet = StandInKubelet(plugins).start()
    tree = driver_tree.build(short_tmp / "drv", [], gis=range(0))
    (short_tmp / "x").mkdir()
    config = (
        f'[kubelet]\nsocket_dir = "{plugins}"\nresources = ["xpu.dev/gpu"]\ndevice_list_strategy = "both"\n'
        f'dev_root = "{tree.dev}"\nproc_root = "{tree.proc}"\n'
    )
    d = DaemonProc(short_tmp / "x", "dgx-a100", config, args=("--kubelet",)).start()
    try:
        cards = cards_json(d)
        minor = {c["uuid"]: c["minor_number"] for c in cards}
        index = {c["uuid"]: c["index"] for c in cards}
        kubelet.wait_devices(GPU, lambda devs: len(devs) == 8)
        ids = sorted(minor, key=lambda u: index[u])[:2]  # cards 0 and 1: minors 2 and 3
        assert [minor[u] for u in ids] != [index[u] for u in ids]
        resp = kubelet.allocate("pod-w", GPU, ids)
        paths = {x.container_path for x in resp.devices}
        assert {f"/dev/nvidia{minor[u]}" for u in ids} <= paths
        assert not {f"/dev/nvidia{index[u]}" for u in ids} & paths
        assert {x.host_path for x in resp.devices} >= {f"{tree.dev}/nvidia{minor[u]}" for u in ids}
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(ids)
        assert [c.name for c in resp.cdi_devices] == [f"nvidia.com/gpu={u}" for u in ids]
    finally:
        d.kill()
        kubelet.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="making capability nodes (mknod) needs root")
def test_mig_slices_for_pods(short_tmp):
    """A MIG slice gets its parent card's node and its GPU-instance and compute-instance capability
    nodes, read from the driver's capability files and made when missing; never /dev/nvidia-caps whole
    (it holds the MIG config capability)."""
    plugins = short_tmp / "dp"
    plugins.mkdir()
    kubelet = StandInKubelet(plugins).start()
    (short_tmp / "x").mkdir()
    probe = DaemonProc(short_tmp / "x", "dgx-a100", "").start()  # the machine's minors, from xpu ls
    minors = [c["minor_number"] for c in cards_json(probe)]
    probe.kill()
    tree = driver_tree.build(short_tmp / "drv", minors, cis=range(2))
    config = (
        f'[kubelet]\nsocket_dir = "{plugins}"\nresources = ["xpu.dev/gpu", "xpu.dev/vxpu-half"]\n'
        f'device_list_strategy = "cdi"\ndev_root = "{tree.dev}"\nproc_root = "{tree.proc}"\n'
    )
    (short_tmp / "y").mkdir()
    d = DaemonProc(short_tmp / "y", "dgx-a100", config, args=("--kubelet",)).start()
    try:
        half = kubelet.wait_devices(HALF, lambda devs: len(devs) == 8)  # MIG: the next slice per card only
        slot = kubelet.preferred(HALF, sorted(half), 1)
        resp = kubelet.allocate("pod-m", HALF, slot)
        mig = resp.envs["CUDA_VISIBLE_DEVICES"]
        assert mig.startswith("MIG-") and "NVIDIA_VISIBLE_DEVICES" not in resp.envs  # cdi only
        assert [c.name for c in resp.cdi_devices] == [f"nvidia.com/gpu={mig}"]
        card = slot[0].split("_")[0]
        parent = next(c["minor_number"] for c in cards_json(d) if c["uuid"] == card)
        paths = {x.container_path: x.host_path for x in resp.devices}
        assert "/dev/nvidia-caps" not in paths and f"/dev/nvidia{parent}" in paths
        caps = sorted(p for p in paths if p.startswith("/dev/nvidia-caps/"))
        assert len(caps) == 2, paths
        by_minor = {m: rel for rel, m in tree.cap_minors.items()}
        rels = sorted(by_minor[int(p.rsplit("nvidia-cap", 1)[1])] for p in caps)
        gi_file, ci_file = rels  # gpu<parent>/mig/gi<g>/access and .../gi<g>/ci<c>/access
        assert gi_file.startswith(f"gpu{parent}/mig/gi") and gi_file.endswith("/access")
        assert ci_file.startswith(gi_file.removesuffix("access") + "ci")
        for p in caps:  # made as nvidia-modprobe -f makes them
            st = os.stat(paths[p])
            n = int(p.rsplit("nvidia-cap", 1)[1])
            assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(driver_tree.CAPS_MAJOR, n)
            assert stat.S_IMODE(st.st_mode) == 0o444 and paths[p] == f"{tree.dev}/nvidia-caps/nvidia-cap{n}"
        # the card is sliced now: it leaves xpu.dev/gpu, and its second half appears as a slot
        kubelet.wait_devices(GPU, lambda devs: len(devs) == 7 and card not in devs)
        kubelet.wait_devices(HALF, lambda devs: sum(k.startswith(card) for k in devs) == 2)
        assert QUARTER not in kubelet.plugins  # only the configured resources are registered
    finally:
        d.kill()
        kubelet.stop()
