"""Tables as a user sees them: they fit the terminal (COLUMNS, a tty) and cut with an ellipsis, pipes get
whole rows, colour only on a terminal and never with NO_COLOR, and one vocabulary (HELD BY, FREE, MODE,
MEMORY, user names) in `xpu ls`, `xpu leases` and the dashboard."""

from __future__ import annotations

import io
import os
import pwd
import re
import subprocess

import pytest
from xpu_cli import output, vocab

from tests.conftest import BIN, wait_until, xpu_env
from xpud.api.v1 import xpu_pb2 as pb

ME = pwd.getpwuid(os.getuid()).pw_name


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def render(headers, rows, width=None, out=None, **kw) -> list[str]:
    out = out if out is not None else io.StringIO()
    output.table(headers, rows, out=out, width=width, **kw)
    return out.getvalue().splitlines()


def test_the_widest_column_is_cut_with_an_ellipsis_to_fit():
    rows = [["0", "x" * 100, "healthy 100"], ["1", "short", "degraded 70"]]
    lines = render(["CARD", "HELD BY", "HEALTH"], rows, width=40)
    assert max(map(len, lines)) <= 40
    assert lines[1].split()[1].endswith("…") and lines[1].endswith("healthy 100")  # others whole
    assert lines[2].split()[:2] == ["1", "short"]


def test_optional_columns_go_before_others_are_cut_below_16_cells_and_a_note_says_so():
    rows = [["0", "H100 80GB HBM3", "a1b2c3d4 (half), e5f6a7b8 (quarter)", "31C", "healthy 100"]]
    lines = render(["CARD", "NAME", "HELD BY", "TEMP", "HEALTH"], rows, width=44, optional=("TEMP", "NAME"))
    assert lines[0].split() == ["CARD", "HELD", "BY", "HEALTH"]
    assert "a1b2c3d4 (half), e5f6a7b…" in lines[1] and max(map(len, lines[:2])) <= 44
    assert lines[-1] == "(TEMP, NAME left out to fit 44 columns; --json has everything)"
    wide = render(["CARD", "NAME", "HELD BY", "TEMP", "HEALTH"], rows, width=200, optional=("TEMP", "NAME"))
    assert len(wide) == 2 and "H100 80GB HBM3" in wide[1]


def test_width_comes_from_COLUMNS_or_the_terminal_and_a_pipe_gets_whole_rows(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert output.width_for(io.StringIO()) is None
    monkeypatch.setattr(output.shutil, "get_terminal_size", lambda: os.terminal_size((57, 20)))
    assert output.width_for(Tty()) == 57
    monkeypatch.setenv("COLUMNS", "80")
    assert output.width_for(io.StringIO()) == 80


def test_colour_only_on_a_terminal_and_never_with_NO_COLOR(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    rows = [["0", output.Styled("unhealthy 12", "red")]]
    assert "\x1b[" not in "".join(render(["CARD", "HEALTH"], rows))  # a pipe
    tty = render(["CARD", "HEALTH"], rows, width=80, out=Tty())
    assert "\x1b[31munhealthy 12\x1b[0m" in tty[1] and tty[0].startswith("\x1b[1mCARD")
    # the padding is computed on the text, not on the escape codes
    assert re.sub(r"\x1b\[[0-9;]*m", "", tty[0]) == "CARD  HEALTH"
    monkeypatch.setenv("NO_COLOR", "1")
    assert "\x1b[" not in "".join(render(["CARD", "HEALTH"], rows, width=80, out=Tty()))


def _card(**kw) -> pb.Card:
    return pb.Card(index=0, name="NVIDIA H100 80GB HBM3", mode="whole", isolation="mig", **kw)


def test_one_vocabulary_for_a_card_in_the_cli_and_the_dashboard():
    from xpu_tui.cardtile import holders_text, tile_lines
    from xpu_tui.hoststate import CardHistory

    whole = _card(whole_lease="78a228d2", free_memory_fraction=0.0, free_compute_pct=0)
    sliced = _card(free_memory_fraction=0.25, free_compute_pct=55)
    sliced.mode = "sliced"
    sliced.slices.add(lease_id="1f2e3d4c", size="vxpu-half")
    sliced.slices.add(lease_id="9a8b7c6d", size="vxpu-quarter")
    idle = _card(free_memory_fraction=1.0, free_compute_pct=100)
    drained = _card(free_memory_fraction=1.0, free_compute_pct=100, drained=True, drain_reason="fan")
    assert [vocab.held_by(c) for c in (whole, sliced, idle)] == [
        "78a228d2 (whole)",
        "1f2e3d4c (half), 9a8b7c6d (quarter)",
        "-",
    ]
    assert [vocab.free(c) for c in (whole, sliced, idle, drained)] == [
        "0% mem 0% sm",
        "25% mem 55% sm",
        "100% mem 100% sm",
        "drained",
    ]
    assert vocab.mode(sliced) == "sliced/mig" and vocab.memory(1 << 29, 85520809984) == "0.5/79.6 GiB"
    assert holders_text(sliced) == "held by 1f2e3d4c (half), 9a8b7c6d (quarter)"
    tile = "\n".join(t.plain for t in tile_lines(sliced, CardHistory(), 60))
    assert "free 25% mem 55% sm" in tile


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line]


@pytest.mark.slow
def test_listings_fit_80_columns_with_names_and_the_drain_reason(daemon):
    assert daemon.xpu("mode", "3", "sliced").returncode == 0
    procs = [daemon.xpu_popen("run", "-m", "vxpu-quarter", "--", "sleep", "30") for _ in range(3)]
    procs.append(daemon.xpu_popen("run", "-g", "2", "--", "sleep", "30"))
    try:
        with daemon.client() as c:
            wait_until(lambda: len(c.leases().leases) == 4, timeout=20)
        reason = "fan noise on the left side of the chassis"
        assert daemon.xpu("drain", "5", "--reason", reason).returncode == 0
        env = {"COLUMNS": "80"}
        ls = _xpu(daemon, env, "ls")
        assert ls.returncode == 0 and max(map(len, _lines(ls.stdout))) <= 80, ls.stdout
        assert f"card 5 drained: {reason}" in ls.stdout
        rows = {line.split()[0]: line for line in _lines(ls.stdout)[1:9]}
        assert "drained" in rows["5"] and "100% mem 100% sm"[:10] in rows["4"]
        assert re.search(r"[0-9a-f]{8} \(qu", rows["3"]), rows["3"]
        leases = _xpu(daemon, env, "leases")
        assert max(map(len, _lines(leases.stdout))) <= 80
        assert leases.stdout.splitlines()[0].split()[3] == "USER" and f" {ME} " in leases.stdout
        for cmd in (("health",), ("health", "0"), ("info",)):
            r = _xpu(daemon, env, *cmd)
            assert r.returncode == 0 and max(map(len, _lines(r.stdout))) <= 80, (cmd, r.stdout)
        # into a pipe without COLUMNS: whole rows, nothing cut
        whole = daemon.xpu("ls")
        assert "…" not in whole.stdout and max(map(len, _lines(whole.stdout))) > 80
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(20)


def _xpu(daemon, env: dict[str, str], *args: str):
    return subprocess.run(
        [str(BIN / "xpu"), *args],
        env=xpu_env(daemon.runtime_dir, **env),
        capture_output=True,
        text=True,
        timeout=60,
    )
