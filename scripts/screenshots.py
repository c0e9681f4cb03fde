"""Write the README's screenshots of `xpu top` (SVG, exported by Textual) to docs/.

    .venv/bin/python scripts/screenshots.py [OUTDIR]

They show the constructed data of ``xpu_tui.demo`` (the same as ``xpu top --demo`` and the snapshot
tests), played through the app's normal data path, so they are the same on every run.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from xpu_tui import demo
from xpu_tui.app import XpuTop

ROOT = Path(__file__).resolve().parents[1]

# file name -> (source, cluster, size, keys pressed once the data is in)
SHOTS = {
    "xpu-top-host.svg": (lambda: demo.dgx_source(admin=True), None, (120, 40), ()),
    "xpu-top-80x24.svg": (lambda: demo.dgx_source(admin=True), None, (80, 24), ()),
    "xpu-top-health.svg": (lambda: demo.health_source(admin=True), None, (80, 24), ()),
    "xpu-top-leases.svg": (lambda: demo.dgx_source(admin=True), None, (120, 32), ("2", "down")),
    "xpu-top-events.svg": (lambda: demo.dgx_source(admin=True), None, (120, 24), ("3",)),
    "xpu-top-cluster.svg": (lambda: demo.dgx_source(admin=True), demo.cluster, (120, 32), ("4",)),
    "xpu-top-200x60.svg": (lambda: demo.dgx_source(admin=True), None, (200, 60), ()),
    "xpu-top-card.svg": (lambda: demo.dgx_source(admin=True), None, (100, 40), ("down", "enter")),
    "xpu-top-drain.svg": (
        lambda: demo.dgx_source(admin=True),
        None,
        (100, 30),
        ("right", "right", "right", "d"),
    ),
}


async def shoot(name: str, outdir: Path) -> None:
    make_source, make_cluster, size, keys = SHOTS[name]
    app = XpuTop(
        make_source(),
        make_cluster() if make_cluster else None,
        clock=demo.now,
        localtime=time.gmtime,
        owner=lambda uid: f"user{uid}",
    )
    async with app.run_test(size=size) as pilot:
        while app.state.updates < demo.SAMPLES or app.selected_card is None:
            await pilot.pause(0.02)
        if make_cluster:
            while not app.cluster_view.hosts:
                await pilot.pause(0.02)
        for key in keys:
            await pilot.press(key)
        await pilot.pause(0.2)
        while hasattr(app.screen, "report") and app.screen.report is None:  # the card's health signals
            await pilot.pause(0.02)
        await pilot.pause(0.1)
        app.save_screenshot(name, str(outdir))
    print(outdir / name)


def main() -> None:
    outdir = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs"
    outdir.mkdir(parents=True, exist_ok=True)
    for name in SHOTS:
        asyncio.run(shoot(name, outdir))


if __name__ == "__main__":
    main()
