"""A real daemon inside the test process (its own thread and event loop), so tests can read the fake NVML
and the simulated NVIDIA tools it drives while real `xpu` wrappers talk to it over its socket."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from xpud import config
from xpud.daemon.app import Daemon, open_hardware


class InProcDaemon:
    def __init__(self, base: Path, machine: str, config_text: str = "", fake=None):
        cfg = config.parse(config_text, str(base / "xpud.toml"))
        cfg = cfg.replace("devices", backend="simulated", machine=machine)
        cfg = cfg.replace("daemon", runtime_dir=str(base / "run"), state_dir=str(base / "state"))
        self.cfg = cfg
        self.runtime_dir = base / "run"
        if fake is None:
            self.hw, self.fake = open_hardware(cfg)
        else:  # the same simulated cards as a previous daemon: a restart without a reboot
            from xpud.hw.nvml import Nvml

            self.fake = fake
            self.hw = Nvml(fake)
            self.hw.open()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="xpud")
        self.thread.start()
        self.daemon = Daemon(cfg, self.hw, self.fake)
        self.call_async(self.daemon.start())

    @property
    def engine(self):
        return self.daemon.engine

    @property
    def tools(self):
        return self.daemon.tools

    def call_async(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn, *args, timeout: float = 30.0):
        """Run ``fn(*args)`` on the daemon's loop (engine state is only consistent there); a coroutine it
        returns is awaited there."""

        async def go():
            result = fn(*args)
            return await result if asyncio.iscoroutine(result) else result

        return self.call_async(go(), timeout)

    def stop(self) -> None:
        if self.thread.is_alive():
            self.call_async(self.daemon.stop())

            async def settle():  # let cancelled streams finish before the loop goes
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            self.call_async(settle())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()
