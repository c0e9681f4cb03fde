"""A stand-in kubelet: the Registration service on ``kubelet.sock``, a DevicePlugin client per registered
plugin (xpud/bridges/v1beta1/api.proto, after kubernetes/kubelet: pkg/apis/deviceplugin/v1beta1/api.proto),
and the PodResourcesLister service on its own socket (xpud/bridges/podresources/v1/api.proto, after
kubernetes/kubelet: pkg/apis/podresources/v1/api.proto), over Unix sockets, with kubelet's habits that
matter to a plugin: it opens ListAndWatch right after Register; PodResources List names the devices of
the pods that run now; ``kubelet_internal_checkpoint`` (the JSON layout kubelet >= 1.20 writes) is written
at admission and rewritten lazily, so a deleted pod stays in it; on restart it deletes every socket in
its directory before serving again. It proves only that xpud agrees with these definitions."""

from __future__ import annotations

import json
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from tests.conftest import wait_until
from xpud.bridges.podresources.v1 import api_pb2 as pr
from xpud.bridges.podresources.v1 import api_pb2_grpc as pr_grpc
from xpud.bridges.v1beta1 import api_pb2 as dp
from xpud.bridges.v1beta1 import api_pb2_grpc as dpg


class Registered:
    """One plugin as kubelet sees it: its channel, options and every device list it sent."""

    def __init__(self, kubelet: StandInKubelet, request: dp.RegisterRequest):
        self.request = request
        self.channel = grpc.insecure_channel(f"unix:{kubelet.dir / request.endpoint}")
        self.stub = dpg.DevicePluginStub(self.channel)
        self.options = self.stub.GetDevicePluginOptions(dp.Empty(), timeout=5)
        self.updates: list[tuple[float, list[dp.Device]]] = []
        self.stream = self.stub.ListAndWatch(dp.Empty())
        self.thread = threading.Thread(target=self._consume, daemon=True)
        self.thread.start()

    def _consume(self) -> None:
        try:
            for update in self.stream:
                self.updates.append((time.monotonic(), list(update.devices)))
        except grpc.RpcError:
            pass  # the plugin went away, or we did

    def devices(self) -> dict[str, str]:
        return {d.ID: d.health for d in self.updates[-1][1]} if self.updates else {}

    def close(self) -> None:
        self.stream.cancel()
        self.channel.close()


class PodResources(pr_grpc.PodResourcesListerServicer):
    def __init__(self, kubelet: StandInKubelet):
        self.kubelet = kubelet

    def List(self, request, context):
        pods = []
        for pod, entries in list(self.kubelet.pods.items()):
            containers = [
                pr.ContainerResources(
                    name=e["ContainerName"],
                    devices=[
                        pr.ContainerDevices(resource_name=e["ResourceName"], device_ids=e["DeviceIDs"]["0"])
                    ],
                )
                for e in entries
            ]
            pods.append(pr.PodResources(name=pod, namespace="default", containers=containers))
        return pr.ListPodResourcesResponse(pod_resources=pods)


class StandInKubelet(dpg.RegistrationServicer):
    def __init__(self, directory: Path, pod_resources: Path | None = None):
        self.dir = directory
        self.pod_resources = pod_resources  # the PodResources socket, when served
        self.plugins: dict[str, Registered] = {}
        self.registrations: list[dp.RegisterRequest] = []
        self.pods: dict[str, list[dict]] = {}  # pod uid -> checkpoint entries
        self.server: grpc.Server | None = None

    # --------------------------------------------------------------------------- Registration
    def Register(self, request, context):
        if request.version != "v1beta1":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version}")
        old = self.plugins.pop(request.resource_name, None)
        if old:
            old.close()
        self.registrations.append(request)
        self.plugins[request.resource_name] = Registered(self, request)
        return dp.Empty()

    def start(self) -> StandInKubelet:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        dpg.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix:{self.dir / 'kubelet.sock'}")
        if self.pod_resources is not None:
            pr_grpc.add_PodResourcesListerServicer_to_server(PodResources(self), self.server)
            self.server.add_insecure_port(f"unix:{self.pod_resources}")
        self.server.start()
        return self

    def stop(self) -> None:
        for p in self.plugins.values():
            p.close()
        self.plugins.clear()
        if self.server:
            self.server.stop(0).wait()
            self.server = None

    def restart(self) -> None:
        """What a kubelet restart looks like to a plugin: its connections go, every socket in the
        directory is deleted, a new kubelet.sock appears."""
        self.stop()
        for sock in self.dir.glob("*.sock"):
            sock.unlink()
        self.start()

    # --------------------------------------------------------------------------- the conversation
    def plugin(self, resource: str, timeout: float = 15) -> Registered:
        return wait_until(lambda: self.plugins.get(resource), timeout=timeout)

    def wait_devices(self, resource: str, pred, timeout: float = 10) -> dict[str, str]:
        return wait_until(lambda: (d := self.plugin(resource).devices()) and pred(d) and d, timeout=timeout)

    def preferred(self, resource: str, available: list[str], size: int, must: list[str] = ()) -> list[str]:
        req = dp.PreferredAllocationRequest(
            container_requests=[
                dp.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, must_include_deviceIDs=list(must), allocation_size=size
                )
            ]
        )
        reply = self.plugin(resource).stub.GetPreferredAllocation(req, timeout=10)
        return list(reply.container_responses[0].deviceIDs)

    def allocate(self, pod: str, resource: str, ids: list[str]) -> dp.ContainerAllocateResponse:
        """Allocate for one container, then checkpoint it as kubelet does."""
        req = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)])
        reply = self.plugin(resource).stub.Allocate(req, timeout=30)
        self.pods.setdefault(pod, []).append(
            {"PodUID": pod, "ContainerName": "main", "ResourceName": resource, "DeviceIDs": {"0": ids}}
        )
        self.write_checkpoint()
        return reply.container_responses[0]

    def delete_pod(self, pod: str) -> None:
        """The pod ends: PodResources stops listing it at once; the checkpoint is rewritten only at the
        next admission (kubelet's lazy habit)."""
        self.pods.pop(pod, None)

    def write_checkpoint(self) -> None:
        entries = [e for es in self.pods.values() for e in es]
        data = {"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {}}, "Checksum": 0}
        tmp = self.dir / "kubelet_internal_checkpoint.tmp"
        tmp.write_text(json.dumps(data))
        tmp.replace(self.dir / "kubelet_internal_checkpoint")
