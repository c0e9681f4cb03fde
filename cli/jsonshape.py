"""The JSON every `--json` prints: one shape per object (a card, a lease, a queue entry, a card's health),
the same in every command, documented in docs/json.md (tests/test_cli_json.py checks each command
against that document).

The rules, for every protobuf message the CLI prints (so a new command's objects follow them too):

- every field is there, in the proto's order: a value the daemon did not give (an unset optional field,
  an unset message, an empty string, a "none" sentinel such as pid 0 or card -1) is ``null``;
- shares are percentages 0-100 named ``*_pct`` (the proto's ``*_fraction`` 0-1 fields are converted,
  and so are signals measured as a ratio);
- a card's health is ``health_state`` and ``health_score`` wherever it appears (`xpu ls` and `xpu health`);
- beside a uid, ``user``: the name this machine knows for it (as the tables show), else ``uid N``;
- 64-bit integers stay numbers (protobuf's own JSON mapping quotes them); times are seconds since the
  epoch (UTC), durations seconds.
"""

from __future__ import annotations

import base64

from google.protobuf.descriptor import FieldDescriptor
from xpu_cli.vocab import user_name

# message -> {proto field: JSON key}: one name for one thing across objects
RENAMES = {"CardHealth": {"state": "health_state", "score": "health_score"}}
# (message, field) -> the value that means "none"
NONE_VALUES = {
    ("Lease", "holder_pid"): 0,
    ("CardHealth", "clear_since"): 0.0,
    ("Event", "card"): -1,
    ("UsageRow", "used_pct"): -1.0,
    ("UsageRow", "peak_pct"): -1.0,
    ("UsageRow", "mem_used_bytes"): -1,
    ("QueueEntry", "not_before"): 0.0,
}
# message -> {uid field: key added after it with the user's name}
USERS = {"Lease": "owner_uid", "QueueEntry": "owner_uid", "InfoReply": "caller_uid"}
FRACTION = "_fraction"


def _repeated(f) -> bool:
    rep = getattr(f, "is_repeated", None)  # protobuf >= 5.28; `label` is gone in 7
    return rep if rep is not None else f.label == FieldDescriptor.LABEL_REPEATED


def _value(f, v):
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        return to_dict(v)
    if f.type == FieldDescriptor.TYPE_ENUM:
        return f.enum_type.values_by_number[v].name if v in f.enum_type.values_by_number else v
    if f.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64encode(v).decode() if v else None
    if f.type == FieldDescriptor.TYPE_STRING:
        return v or None
    return v


def to_dict(msg) -> dict:
    """``msg`` (a protobuf message) as its documented JSON object (the rules above)."""
    desc = msg.DESCRIPTOR
    renames = RENAMES.get(desc.name, {})
    out: dict = {}
    for f in desc.fields:
        key = renames.get(f.name, f.name)
        v = getattr(msg, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            vf = f.message_type.fields_by_name["value"]
            v = {k: (to_dict(x) if vf.message_type is not None else x) for k, x in v.items()}
        elif _repeated(f):
            v = [_value(f, x) for x in v]
        elif f.has_presence and not msg.HasField(f.name):
            v = None
        else:
            v = _value(f, v)
            if (desc.name, f.name) in NONE_VALUES and v == NONE_VALUES[desc.name, f.name]:
                v = None
        if key.endswith(FRACTION):
            key = key.removesuffix(FRACTION) + "_pct"
            v = None if v is None else round(v * 100, 2)
        out[key] = v
        if USERS.get(desc.name) == f.name:
            out["user"] = user_name(v)
    if desc.name == "Signal" and out.get("unit") == "ratio":
        for k in ("value", "threshold"):
            out[k] = None if out[k] is None else round(out[k] * 100, 2)
        out["unit"] = "%"
    return out
