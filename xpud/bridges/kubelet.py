"""The Kubernetes device plugin: kubelet's device-plugin API v1beta1 (``v1beta1/api.proto``) over the
same engine as `xpu run`, one plugin per resource name.

Devices. ``<domain>/gpu``: one device per card, its UUID. ``<domain>/<slice size>``: slots
``<uuid>_<size>_<k>``, as many per card as slices of that size fit there now (a MIG card: the next one
only). A card held by any lease that is not a pod's (bare metal, Slurm) is withdrawn; slots of cards held
whole are withdrawn; devices pods hold stay listed (kubelet counts them as allocated); an unhealthy card
and its pods' slots are ``Unhealthy``; a card an operator drained is withdrawn.

Allocate makes an ordinary lease anchored to the pod's first device (``pod:<device id>``), owned by root,
and answers with the lease's environment, NVIDIA_VISIBLE_DEVICES and/or CDI names, the device nodes by
minor number (``hw/devnodes.py``; a MIG slice: its parent and its two capability nodes, never all of
/dev/nvidia-caps) and, for MPS, the pipe directory and the MPS /dev/shm. Once kubelet's PodResources API
no longer lists the device for ``pod_gone_grace_s``, the reaper reclaims the lease. kubelet deletes the
plugin sockets when it restarts: the bridge notices and serves and registers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc import aio

from xpud.bridges.anchors import split
from xpud.bridges.podresources.v1 import api_pb2 as pr
from xpud.bridges.podresources.v1 import api_pb2_grpc as pr_grpc
from xpud.bridges.v1beta1 import api_pb2 as dp
from xpud.bridges.v1beta1 import api_pb2_grpc as dpg
from xpud.errors import XpudError
from xpud.hw.devnodes import DevNodeError, DevTree
from xpud.isolation.devices import lease_nodes
from xpud.model import HealthState, Mode, Request

log = logging.getLogger("xpud.bridges")

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
WATCH_INTERVAL_S = 0.5  # how often the sockets are looked at (kubelet restarts) and devices refreshed
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"


def slot_id(uuid: str, size: str, k: int) -> str:
    return f"{uuid}_{size}_{k}"


def slot_card(device_id: str) -> str:
    return device_id.split("_", 1)[0]


def kind_of(resource: str) -> str:
    """``"xpu.dev/vxpu-half"`` -> ``"vxpu-half"``; ``"xpu.dev/gpu"`` -> ``"gpu"``."""
    return resource.partition("/")[2]


class Devices:
    """What one resource offers kubelet now, from the engine's state (read on the event loop)."""

    def __init__(self, engine, kind: str):
        self.engine = engine
        self.kind = kind

    def pod_held(self) -> dict[str, object]:
        """Device ids pods hold on this resource -> their lease."""
        out = {}
        for lease in self.engine.lease_list():
            k, ident = split(lease.anchor)
            if k != "pod":
                continue
            if self.kind == "gpu" and lease.mode is Mode.XPU:
                out.update({uuid: lease for uuid in lease.card_uuids})
            elif lease.mode.value == self.kind:
                out[ident] = lease
        return out

    def list(self) -> list[dp.Device]:
        e, held = self.engine, self.pod_held()
        by_uuid = {c.info.uuid: c for c in e.cards.values()}
        out = []
        if self.kind == "gpu":
            free = set(e.free_whole_cards())
            for c in e.cards.values():
                unhealthy = c.health_state is HealthState.UNHEALTHY
                if c.info.uuid in held or c.info.index in free or (unhealthy and c.idle):
                    out.append(self._device(c.info.uuid, c, unhealthy))
            return out
        for ident in held:
            c = by_uuid.get(slot_card(ident))
            if c is not None:
                out.append(self._device(ident, c, c.health_state is HealthState.UNHEALTHY))
        taken = set(held)
        for c in e.cards.values():
            room = e.slice_room(c.info.index, self.kind)
            k = 0
            while room > 0:
                ident = slot_id(c.info.uuid, self.kind, k)
                if ident not in taken:
                    out.append(self._device(ident, c, False))
                    room -= 1
                k += 1
        return out

    @staticmethod
    def _device(ident: str, card, unhealthy: bool) -> dp.Device:
        topo = None
        if card.info.numa_node is not None:
            topo = dp.TopologyInfo(nodes=[dp.NUMANode(ID=card.info.numa_node)])
        return dp.Device(ID=ident, health=UNHEALTHY if unhealthy else HEALTHY, topology=topo)


class Plugin(dpg.DevicePluginServicer):
    """The DevicePlugin service for one resource name."""

    def __init__(self, engine, resource: str, stopping: asyncio.Event, delivery: Delivery | None = None):
        self.engine = engine
        self.delivery = delivery or Delivery()
        self.resource = resource
        self.kind = kind_of(resource)
        self.devices = Devices(engine, self.kind)
        self.stopping = stopping

    async def GetDevicePluginOptions(self, request, context):
        return dp.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def ListAndWatch(self, request, context):
        q = self.engine.watch()
        try:
            last = None
            while not self.stopping.is_set():
                devices = self.devices.list()
                key = [(d.ID, d.health) for d in devices]
                if key != last:
                    last = key
                    yield dp.ListAndWatchResponse(devices=devices)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(q.get(), WATCH_INTERVAL_S)
                while not q.empty():  # a burst of changes: one list
                    q.get_nowait()
        finally:
            self.engine.unwatch(q)

    async def GetPreferredAllocation(self, request, context):
        out = []
        for r in request.container_requests:
            out.append(dp.ContainerPreferredAllocationResponse(deviceIDs=self.preferred(r)))
        return dp.PreferredAllocationResponse(container_responses=out)

    def preferred(self, r) -> list[str]:
        e, n = self.engine, r.allocation_size
        must, available = list(r.must_include_deviceIDs), list(r.available_deviceIDs)
        if self.kind != "gpu":  # slots: on the card the engine would slice next, then packed
            index = {c.info.uuid: c.info.index for c in e.cards.values()}
            best = e.preferred_slice_card(
                self.kind, {index[slot_card(d)] for d in available if slot_card(d) in index}
            )
            rest = sorted(
                (d for d in available if d not in must), key=lambda d: (index.get(slot_card(d)) != best, d)
            )
            return (must + rest)[:n]
        index = {c.info.uuid: c.info.index for c in e.cards.values()}
        uuid = {i: u for u, i in index.items()}
        cards = [index[d] for d in available if d in index]
        group = e.preferred_group(cards, n, [index[d] for d in must if d in index])
        return [uuid[i] for i in group] if group else (must + [d for d in available if d not in must])[:n]

    async def Allocate(self, request, context):
        responses, made = [], []
        try:
            for r in request.container_requests:
                lease = await self._lease(list(r.devices_ids))
                made.append(lease)
                h = handout(lease, self.engine)
                responses.append(await asyncio.to_thread(container_response, h, self.delivery))
        except (XpudError, DevNodeError) as e:
            for lease in made:  # all or nothing: kubelet fails the pod
                await self.engine.reclaim(lease.id, "the rest of the pod's allocation failed")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.resource}: {e}")
        return dp.AllocateResponse(container_responses=responses)

    async def _lease(self, ids: list[str]):
        e = self.engine
        by_uuid = {c.info.uuid: c.info.index for c in e.cards.values()}
        if not ids:
            raise XpudError("no devices asked")
        if self.kind == "gpu":
            unknown = [d for d in ids if d not in by_uuid]
            cards, mode = tuple(by_uuid.get(d, -1) for d in ids), Mode.XPU
        else:
            if len(ids) != 1:
                raise XpudError(f"{len(ids)} {self.kind} slices for one container: ask for 1")
            unknown = [d for d in ids if slot_card(d) not in by_uuid]
            cards, mode = (by_uuid.get(slot_card(ids[0]), -1),), Mode(self.kind)
        if unknown:
            raise XpudError(f"device {unknown[0]!r} is not one of this plugin's")
        # kubelet allocates only devices it holds free: a pod lease still on one is a pod kubelet has let
        # go before the checkpoint check noticed (its grace): end it now rather than fail the new pod
        for device, lease in self.devices.pod_held().items():
            if device in ids:
                await e.reclaim(lease.id, "kubelet gave its device to a new container")
        req = Request(
            mode=mode,
            gpus=len(cards) if mode is Mode.XPU else 1,
            owner_uid=0,
            cards=cards,
            anchor=f"pod:{ids[0]}",
            command=f"kubelet {self.resource} {','.join(ids)}"[:200],
            exempt=True,
            account=e.cfg.accounts.kubernetes_account,  # charged to [accounts] kubernetes_account
        )
        lease, _token = await e.acquire(e.validate(req))
        return lease

    async def PreStartContainer(self, request, context):
        return dp.PreStartContainerResponse()


@dataclass(frozen=True)
class Delivery:
    """How Allocate hands a lease to the container runtime (``[kubelet]`` keys)."""

    strategy: str = "envvar"  # envvar | cdi | both (NVIDIA's plugin: envvar, cdi-cri)
    cdi_vendor: str = "nvidia.com"
    mps_shm_dir: str = "/run/xpud/mps/shm"
    tree: DevTree = field(default_factory=DevTree)


@dataclass(frozen=True)
class Handout:
    """A lease's devices, read from the engine on the event loop: whole cards or MPS slices as (minor,
    card UUID); MIG slices as (parent minor, GPU instance, compute instance, MIG UUID)."""

    lease_id: str
    env: dict
    cards: tuple[tuple[int, str], ...]
    migs: tuple[tuple[int, int, int, str], ...]


def handout(lease, engine) -> Handout:
    """What the lease gives, by minor number (``isolation.devices.lease_nodes``); raises DevNodeError when a
    card's minor or a MIG instance is unknown (a node picked by NVML index could be another card's)."""
    cards, migs = lease_nodes(lease, engine)
    uuid = {c.info.index: c.info.uuid for c in engine.cards.values()}
    return Handout(lease.id, dict(lease.env), tuple((m, uuid[i]) for i, m in cards), tuple(migs))


def container_response(h: Handout, how: Delivery) -> dp.ContainerAllocateResponse:
    """What `xpu run` gives its child, for a container (NVIDIA/k8s-device-plugin: internal/plugin/server.go,
    getAllocateResponse): the lease's environment; NVIDIA_VISIBLE_DEVICES and/or CDI names of its card or
    MIG UUIDs; the device nodes by minor number (control nodes that exist, each card, and for a MIG slice
    its parent and its two capability nodes, made when missing); for an MPS slice the pipe directory and
    the MPS /dev/shm. Runs off the event loop (it reads the driver's files and may mknod)."""
    env, tree = dict(h.env), how.tree
    names = [n for n in tree.control() if os.path.exists(tree.host(n))]  # optional, as NVIDIA's plugin has it
    visible = []
    for minor, uuid in h.cards:
        names.append(tree.card(minor))
        visible.append(uuid)
    for parent, gi, ci, uuid in h.migs:
        names += [n for n in tree.mig_nodes(parent, gi, ci) if n not in names]
        visible.append(uuid)
    if how.strategy in ("envvar", "both"):
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(visible)
    cdi = []
    if how.strategy in ("cdi", "both"):  # NVIDIA's plugin names MIG devices in the gpu class too
        cdi = [dp.CDIDevice(name=f"{how.cdi_vendor}/gpu={u}") for u in visible]
    devices = [
        dp.DeviceSpec(container_path=f"/dev/{n}", host_path=tree.host(n), permissions="rw") for n in names
    ]
    mounts = []
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY")
    if pipe:  # MPS clients reach their server through the pipes and memory it shares in /dev/shm
        mounts.append(dp.Mount(container_path=pipe, host_path=pipe, read_only=False))
        mounts.append(dp.Mount(container_path="/dev/shm", host_path=how.mps_shm_dir, read_only=False))
    annotations = {"xpu.dev/lease": h.lease_id}
    return dp.ContainerAllocateResponse(
        envs=env, devices=devices, mounts=mounts, annotations=annotations, cdi_devices=cdi
    )


# ------------------------------------------------------------------------------------------- pods gone
async def pod_resource_devices(socket: str | os.PathLike, timeout: float = 5) -> set[str] | None:
    """Every device id kubelet's PodResources API (v1 ``List``) says a running pod's container holds now
    (None: kubelet does not answer)."""
    try:
        async with aio.insecure_channel(f"unix:{socket}") as channel:
            reply = await pr_grpc.PodResourcesListerStub(channel).List(
                pr.ListPodResourcesRequest(), timeout=timeout
            )
    except grpc.RpcError as e:
        log.warning("kubelet's PodResources API at %s: %s", socket, e.details() or e.code())
        return None
    return {d for p in reply.pod_resources for c in p.containers for dev in c.devices for d in dev.device_ids}


class PodCheck:
    """The reaper's question to kubelet: which pods are gone? A pod is gone once its device has been
    missing from kubelet's PodResources List for ``grace_s`` (kubelet lists a container's devices from
    its admission on; the grace covers the moment between Allocate and that)."""

    def __init__(self, socket: str | os.PathLike, grace_s: float, clock=time.monotonic):
        self.socket, self.grace_s, self.clock = socket, grace_s, clock
        self.missing_since: dict[str, float] = {}

    async def __call__(self, ids: set[str]) -> dict[str, str]:
        present = await pod_resource_devices(self.socket)
        if present is None:
            return {}
        now, gone = self.clock(), {}
        for ident in ids:
            if ident in present:
                self.missing_since.pop(ident, None)
                continue
            since = self.missing_since.setdefault(ident, now)
            if now - since >= self.grace_s:
                gone[ident] = f"kubelet's PodResources API has not listed it for {now - since:.0f} s"
        for ident in set(self.missing_since) - ids:
            del self.missing_since[ident]
        return gone


# ------------------------------------------------------------------------------------------- the bridge
def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


class KubeletBridge:
    """Serves each resource on its socket in kubelet's directory and registers it; serves and registers
    again when kubelet restarts (its socket re-created, ours deleted)."""

    def __init__(
        self,
        engine,
        socket_dir: str | os.PathLike,
        resources: Iterable[str],
        delivery: Delivery | None = None,
    ):
        self.engine = engine
        self.delivery = delivery or Delivery()
        self.dir = Path(socket_dir)
        self.resources = list(resources)
        self.stopping = asyncio.Event()
        self.servers: dict[str, tuple[aio.Server, tuple[int, int] | None]] = {}
        self.kubelet_id: tuple[int, int] | None = None
        self.registrations = 0  # how many times a plugin was registered (tests, logs)
        self._task: asyncio.Task | None = None

    def endpoint(self, resource: str) -> str:
        return f"xpud-{kind_of(resource)}.sock"

    async def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.ensure_future(self._watch())

    async def stop(self) -> None:
        self.stopping.set()
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for resource in list(self.servers):
            await self._stop_server(resource)

    async def _watch(self) -> None:
        while True:
            try:
                await self._tick()
            except Exception:
                log.exception("kubelet device plugin")
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def _tick(self) -> None:
        kubelet = _identity(self.dir / KUBELET_SOCKET)
        restarted = kubelet is not None and kubelet != self.kubelet_id
        for resource in self.resources:
            path = self.dir / self.endpoint(resource)
            server = self.servers.get(resource)
            if server is None or _identity(path) != server[1]:  # deleted by kubelet (or never made)
                await self._stop_server(resource)
                await self._serve(resource)
                restarted = restarted or kubelet is not None
        if restarted and await self._register_all():
            self.kubelet_id = kubelet

    async def _serve(self, resource: str) -> None:
        path = self.dir / self.endpoint(resource)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        server = aio.server()
        dpg.add_DevicePluginServicer_to_server(
            Plugin(self.engine, resource, self.stopping, self.delivery), server
        )
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        self.servers[resource] = (server, _identity(path))
        self.kubelet_id = None  # a new endpoint must be registered

    async def _stop_server(self, resource: str) -> None:
        server = self.servers.pop(resource, None)
        if server is not None:
            await server[0].stop(grace=0.5)

    async def _register_all(self) -> bool:
        async with aio.insecure_channel(f"unix:{self.dir / KUBELET_SOCKET}") as channel:
            stub = dpg.RegistrationStub(channel)
            for resource in self.resources:
                request = dp.RegisterRequest(
                    version=API_VERSION,
                    endpoint=self.endpoint(resource),
                    resource_name=resource,
                    options=dp.DevicePluginOptions(get_preferred_allocation_available=True),
                )
                try:
                    await stub.Register(request, timeout=5)
                except grpc.RpcError as e:
                    log.warning("registering %s with kubelet: %s", resource, e.details() or e.code())
                    return False
                self.registrations += 1
                log.info("registered %s with kubelet as %s", resource, self.endpoint(resource))
        return True
