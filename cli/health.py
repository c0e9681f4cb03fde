"""`xpu health`: one line per card (state, score, when it will be back, the top reason); with a card (or
--details) every signal with its threshold, how recovery goes, and the history of state changes. Times
carry their zone; masks are spelled out (clock-event reasons in NVML's words)."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from xpu_cli import output, vocab

from xpud.hw.signals import CLOCK_REASONS

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def when(ts: float, now: float | None = None) -> str:
    """HH:MM:SS ZONE today, else YYYY-MM-DD HH:MM:SS ZONE."""
    now = now or time.time()
    same_day = time.localtime(ts)[:3] == time.localtime(now)[:3]
    return time.strftime("%H:%M:%S %Z" if same_day else "%Y-%m-%d %H:%M:%S %Z", time.localtime(ts))


def in_(seconds: float) -> str:
    return "now" if seconds <= 0 else f"in {vocab.age(seconds)}"


def recovery(h, now: float | None = None) -> str:
    """How and when the card comes back, in one sentence (empty when healthy)."""
    now = now or time.time()
    if h.state == "healthy":
        return ""
    need = f"{h.clear_needed_s:g} s of clear signals"
    why = f"{h.state} ({h.reasons[0]})" if h.reasons else h.state
    if h.clear_since:
        done = now - h.clear_since
        return (
            f"{why}; signals clear since {when(h.clear_since, now)}, {done:.0f} s of the {need} needed: "
            f"back at {when(h.back_at, now)} ({in_(h.back_at - now)}) if nothing new goes wrong"
        )
    if h.HasField("back_at"):
        return (
            f"{why}; the event window holding it ends at {when(h.window_ends, now)}, then {need}: back at "
            f"{when(h.back_at, now)} ({in_(h.back_at - now)}) if nothing new goes wrong"
        )
    return f"{why}; signals say {h.raw_state} now: once they clear, {need} bring it back"


def _top_reason(h, card) -> str:
    if h.reasons:
        return h.reasons[0] + (f" (+{len(h.reasons) - 1} more)" if len(h.reasons) > 1 else "")
    if card is not None and card.drained:
        return f"drained: {card.drain_reason}"
    return "-"


def signal_value(sig, name: str) -> str:
    """A signal's value or threshold as ``vocab.signal_value`` words it; clock-event reasons also named."""
    text = vocab.signal_value(sig, name)
    if sig.name == "clock_events" and name == "value" and sig.HasField("value"):
        names = [word for bit, word in CLOCK_REASONS.items() if int(sig.value) & bit]
        text += f" ({', '.join(names) or 'none'})"
    return text


def _details(h, card, now: float) -> None:
    print(f"card {h.index} ({h.uuid}): {h.state}, score {h.score} now")
    for reason in h.reasons:
        output.note(f"  because: {reason}")
    if card is not None and card.drained:
        output.note(f"  drained: {card.drain_reason}")
    if h.state != "healthy":
        output.note(f"  recovery: {recovery(h, now)}", indent="  ")
    output.table(
        ["  SIGNAL", "VALUE", "THRESHOLD", "STATUS", "RAISED UNTIL", "REASON"],
        [
            [
                f"  {s.name}",
                signal_value(s, "value"),
                signal_value(s, "threshold"),
                s.status,
                when(s.until, now) if s.HasField("until") else "-",
                s.reason,
            ]
            for s in h.signals
        ],
    )
    if h.history:
        print("  history:")
    for ch in h.history:
        output.note(
            f"  {when(ch.timestamp, now)}  {ch.from_state} -> {ch.to_state} (score then {ch.score}): "
            f"{'; '.join(ch.reasons)}"
        )


def health(
    card: Annotated[
        str | None, typer.Argument(help="Card index or UUID (default: one line per card).")
    ] = None,
    details: Annotated[
        bool, typer.Option("--details", "-d", help="Every signal and the history of every card.")
    ] = False,
    history: Annotated[int, typer.Option(help="State changes to show per card.", min=1, max=500)] = 20,
    as_json: JsonOpt = False,
) -> None:
    """Each card's state, score, when it will be back and why; with a card (or --details) every signal
    with its threshold, the recovery and the history of state changes."""
    from xpu_cli.session import client

    with client() as c:
        reply = c.health(card or "", history=history)
        cards = {x.index: x for x in c.cards().cards}
    if as_json:
        return output.print_json([output.to_dict(h) for h in reply.cards])
    now = time.time()
    if card is None and not details:
        rows = []
        for h in reply.cards:
            back = (
                "-"
                if h.state == "healthy"
                else (when(h.back_at, now) if h.HasField("back_at") else "when fixed")
            )
            state = output.Styled(h.state, output.HEALTH_STYLES.get(h.state, ""))
            rows.append([h.index, state, h.score, back, _top_reason(h, cards.get(h.index))])
        output.table(["CARD", "STATE", "SCORE", "BACK AT", "REASON"], rows)
        output.note("BACK AT: when the card returns if nothing new goes wrong; `xpu health CARD` says why.")
        return
    for n, h in enumerate(reply.cards):
        if n:
            print()
        _details(h, cards.get(h.index), now)


def register(app: typer.Typer) -> None:
    from xpu_cli.output import handled

    app.command()(handled(health))
