"""[daemon] event_loop: uvloop's loop when installed (an optional dependency, ``xpud[fast]``), else
asyncio's own; the daemon grants and releases the same on both."""

from __future__ import annotations

import sys

import pytest

from xpud.daemon.app import StartupError, loop_factory

try:
    import uvloop  # noqa: F401

    HAVE_UVLOOP = True
except ImportError:
    HAVE_UVLOOP = False


@pytest.fixture
def no_uvloop(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError


def test_asyncio_is_asyncio_whatever_is_installed():
    assert loop_factory("asyncio") is None


def test_without_uvloop_auto_falls_back_to_asyncio_and_uvloop_is_refused_in_one_line(no_uvloop):
    assert loop_factory("auto") is None
    with pytest.raises(StartupError, match=r"event_loop = \"uvloop\", but uvloop is not installed: pip"):
        loop_factory("uvloop")


@pytest.mark.skipif(not HAVE_UVLOOP, reason="uvloop is not installed (pip install 'xpud[fast]')")
def test_with_uvloop_auto_and_uvloop_run_on_it():
    import uvloop

    assert loop_factory("auto") is uvloop.new_event_loop
    assert loop_factory("uvloop") is uvloop.new_event_loop


def _cycle(d, mode: str) -> None:
    with d.client() as c:
        g = c.acquire_lease(mode, wait_s=10.0, command="t")
        assert g.lease.mode == mode
        assert c.release(g.lease.id, g.token).state == "released"


@pytest.mark.parametrize("choice", ["asyncio", "auto"])
def test_the_daemon_grants_and_releases_on_the_loop_it_says(daemon_factory, choice):
    d = daemon_factory(config=f'[daemon]\nevent_loop = "{choice}"\nlog_level = "info"\n')
    for mode in ("vxpu-quarter", "xpu", "vxpu-quarter"):
        _cycle(d, mode)
    want = "uvloop" if choice == "auto" and HAVE_UVLOOP else "asyncio"
    assert f"(event loop: {want})" in d.log.read_text()


def test_a_bad_choice_is_refused_with_the_key(daemon_factory):
    d = daemon_factory(config='[daemon]\nevent_loop = "trio"\n', start=False)
    d.start(wait=False)
    assert d.proc.wait(30) != 0
    text = d.log.read_text()
    assert "event_loop" in text and "trio" in text and "Traceback" not in text
