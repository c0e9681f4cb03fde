"""The Kubernetes device plugin driven by a stand-in kubelet speaking the real v1beta1 protocol over Unix
sockets: registration, ListAndWatch as bare-metal leases come and go and a card goes unhealthy,
GetPreferredAllocation, Allocate, pods going away, and a kubelet restart."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from tests.conftest import DaemonProc, wait_until
from tests.kubelet_standin import StandInKubelet

GPU, HALF, QUARTER = "xpu.dev/gpu", "xpu.dev/vxpu-half", "xpu.dev/vxpu-quarter"


@pytest.fixture
def site(short_tmp):
    plugins = short_tmp / "dp"
    plugins.mkdir()
    kubelet = StandInKubelet(plugins).start()
    config = f"""
[leases]
grace_s = 300.0  # the bare-metal lease below has no Hold stream
[health]
clear_s = 1.0
event_window_s = 0.5
[kubelet]
socket_dir = "{plugins}"
pod_gone_grace_s = 1.0
"""
    (short_tmp / "x").mkdir()
    d = DaemonProc(short_tmp / "x", "pcie-8x-l40s", config, args=("--kubelet",)).start()
    yield d, kubelet
    d.kill()
    kubelet.stop()


def uuids(d) -> list[str]:
    return [c["uuid"] for c in json.loads(d.xpu("ls", "--json").stdout)]


def pod_leases(d) -> dict[str, dict]:
    leases = json.loads(d.xpu("leases", "--json").stdout)["leases"]
    return {le["anchor"]: le for le in leases if (le["anchor"] or "").startswith("pod:")}


def test_the_whole_conversation(site):
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
    nodes = {x.host_path for x in resp.devices}
    assert {"/dev/nvidiactl", f"/dev/nvidia{i}", f"/dev/nvidia{j}"} <= nodes
    # the pod's cards stay listed (kubelet counts them as allocated); their slots go
    kubelet.wait_devices(HALF, lambda devs: not any(k.split("_")[0] in pair for k in devs))
    assert set(pair) <= set(kubelet.plugin(GPU).devices())

    half = sorted(kubelet.plugin(HALF).devices())
    slot = kubelet.preferred(HALF, half, 1)
    resp = kubelet.allocate("pod-b", HALF, slot)
    assert resp.envs["XPU_MODE"] == "vxpu-half" and resp.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    pipe = resp.envs["CUDA_MPS_PIPE_DIRECTORY"]
    assert [(m.host_path, m.container_path) for m in resp.mounts] == [(pipe, pipe)]
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

    # pod A goes: once the checkpoint no longer lists it, its lease is reclaimed
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


def test_pod_check_reads_the_checkpoint_with_a_grace(tmp_path):
    import asyncio

    from xpud.bridges.kubelet import PodCheck, checkpoint_devices

    path = tmp_path / "kubelet_internal_checkpoint"
    now = [0.0]
    check = PodCheck(path, grace_s=10, clock=lambda: now[0])
    assert asyncio.run(check({"a"})) == {}  # no checkpoint: cannot tell, keep
    entries = [
        {"PodUID": "p1", "ContainerName": "c", "ResourceName": "xpu.dev/gpu", "DeviceIDs": {"0": ["a", "b"]}},
        {"PodUID": "p2", "ContainerName": "c", "ResourceName": "xpu.dev/gpu", "DeviceIDs": ["c"]},  # < 1.20
    ]
    path.write_text(json.dumps({"Data": {"PodDeviceEntries": entries}, "Checksum": 1}))
    assert checkpoint_devices(path) == {"a", "b", "c"}
    assert asyncio.run(check({"a", "z"})) == {}  # z missing: its grace starts
    now[0] = 10.5
    gone = asyncio.run(check({"a", "z"}))
    assert set(gone) == {"z"} and "10 s" in gone["z"]
    path.write_text("{not json")
    assert asyncio.run(check({"z"})) == {}  # unreadable: keep


def test_mig_slices_for_pods(short_tmp):
    plugins = short_tmp / "dp"
    plugins.mkdir()
    kubelet = StandInKubelet(plugins).start()
    (short_tmp / "x").mkdir()
    config = f'[kubelet]\nsocket_dir = "{plugins}"\nresources = ["xpu.dev/gpu", "xpu.dev/vxpu-half"]\n'
    d = DaemonProc(short_tmp / "x", "dgx-h100", config, args=("--kubelet",)).start()
    try:
        half = kubelet.wait_devices(HALF, lambda devs: len(devs) == 8)  # MIG: the next slice per card only
        slot = kubelet.preferred(HALF, sorted(half), 1)
        resp = kubelet.allocate("pod-m", HALF, slot)
        assert resp.envs["CUDA_VISIBLE_DEVICES"].startswith("MIG-")
        assert "/dev/nvidia-caps" in {x.host_path for x in resp.devices}
        card = slot[0].split("_")[0]
        # the card is sliced now: it leaves xpu.dev/gpu, and its second half appears as a slot
        kubelet.wait_devices(GPU, lambda devs: len(devs) == 7 and card not in devs)
        kubelet.wait_devices(HALF, lambda devs: sum(k.startswith(card) for k in devs) == 2)
        assert QUARTER not in kubelet.plugins  # only the configured resources are registered
    finally:
        d.kill()
        kubelet.stop()
