"""The Kubernetes device plugin: kubelet's device-plugin API v1beta1 (``v1beta1/api.proto``) over the
same engine as `xpu run`, one plugin per resource name.

Devices. ``<domain>/gpu``: one device per card, its UUID. ``<domain>/<slice size>``: slots
``<uuid>_<size>_<k>``, as many per card as slices of that size fit there now (a MIG card: the next one
only). A card held by any lease that is not a pod's (bare metal, Slurm) is withdrawn; slots of cards held
whole are withdrawn; devices pods hold stay listed (kubelet counts them as allocated); an unhealthy card
and its pods' slots are ``Unhealthy``; a card an operator drained is withdrawn.

Allocate makes an ordinary lease anchored to the pod's first device (``pod:<device id>``), owned by root,
and answers with the lease's environment, the device nodes and the MPS pipe directory. kubelet records the
allocation in its checkpoint; once the checkpoint no longer lists the device for ``pod_gone_grace_s``, the
reaper reclaims the lease. kubelet deletes the plugin sockets when it restarts: the bridge notices and
serves and registers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

import grpc
from grpc import aio

from xpud.bridges.anchors import split
from xpud.bridges.v1beta1 import api_pb2 as dp
from xpud.bridges.v1beta1 import api_pb2_grpc as dpg
from xpud.errors import XpudError
from xpud.model import HealthState, Mode, Request

log = logging.getLogger("xpud.bridges")

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT = "kubelet_internal_checkpoint"
WATCH_INTERVAL_S = 0.5  # how often the sockets are looked at (kubelet restarts) and devices refreshed
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


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

    def __init__(self, engine, resource: str, stopping: asyncio.Event):
        self.engine = engine
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
                responses.append(container_response(lease, self.engine))
        except XpudError as e:
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
        )
        lease, _token = await e.acquire(e.validate(req))
        return lease

    async def PreStartContainer(self, request, context):
        return dp.PreStartContainerResponse()


def container_response(lease, engine) -> dp.ContainerAllocateResponse:
    """What `xpu run` gives its child, for a container: the lease's environment, the device nodes of its
    cards (and the control nodes), and the MPS pipe directory when the slice is MPS."""
    env = dict(lease.env)
    nodes = [*CONTROL_DEVICES, *(f"/dev/nvidia{i}" for i in lease.cards)]  # minor number = index
    if any(s.handle.startswith("MIG-") for s in lease.slices):
        nodes.append("/dev/nvidia-caps")
    devices = [dp.DeviceSpec(container_path=p, host_path=p, permissions="rw") for p in nodes]
    mounts = []
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY")
    if pipe:
        mounts.append(dp.Mount(container_path=pipe, host_path=pipe, read_only=False))
    annotations = {"xpu.dev/lease": lease.id}
    return dp.ContainerAllocateResponse(envs=env, devices=devices, mounts=mounts, annotations=annotations)


# ------------------------------------------------------------------------------------------- checkpoint
def checkpoint_devices(path: Path) -> set[str] | None:
    """Every device id kubelet's checkpoint says a pod holds (None: no readable checkpoint)."""
    try:
        data = json.loads(path.read_text())
        entries = data["Data"]["PodDeviceEntries"] or []
    except (OSError, ValueError, KeyError, TypeError):
        return None
    out: set[str] = set()
    for entry in entries:
        ids = entry.get("DeviceIDs") if isinstance(entry, dict) else None
        if isinstance(ids, dict):  # by NUMA node (kubelet >= 1.20)
            for v in ids.values():
                out.update(x for x in v or () if isinstance(x, str))
        elif isinstance(ids, list):
            out.update(x for x in ids if isinstance(x, str))
    return out


class PodCheck:
    """The reaper's question to kubelet: which pods are gone? A pod is gone once its device has been
    missing from the checkpoint for ``grace_s`` (kubelet writes it just after Allocate)."""

    def __init__(self, path: Path, grace_s: float, clock=time.monotonic):
        self.path, self.grace_s, self.clock = path, grace_s, clock
        self.missing_since: dict[str, float] = {}

    async def __call__(self, ids: set[str]) -> dict[str, str]:
        present = await asyncio.to_thread(checkpoint_devices, self.path)
        if present is None:
            return {}
        now, gone = self.clock(), {}
        for ident in ids:
            if ident in present:
                self.missing_since.pop(ident, None)
                continue
            since = self.missing_since.setdefault(ident, now)
            if now - since >= self.grace_s:
                gone[ident] = f"kubelet's checkpoint has not listed it for {now - since:.0f} s"
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

    def __init__(self, engine, socket_dir: str | os.PathLike, resources: Iterable[str]):
        self.engine = engine
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
        dpg.add_DevicePluginServicer_to_server(Plugin(self.engine, resource, self.stopping), server)
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
