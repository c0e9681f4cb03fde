"""Printing for the CLI: aligned tables, JSON, human units. Formatting lives here, not in the daemon."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict

_INT64 = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def to_dict(msg) -> dict:
    """The message as JSON-ready data with the proto's field names, in the proto's field order; 64-bit
    integers stay numbers (protobuf's JSON mapping writes them as strings, which `jq` and scripts would
    have to convert)."""
    d = MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return _tidy(msg.DESCRIPTOR, d)


def _repeated(f) -> bool:
    rep = getattr(f, "is_repeated", None)  # protobuf >= 5.28; `label` is gone in 7
    return rep if rep is not None else f.label == FieldDescriptor.LABEL_REPEATED


def _tidy(desc, d: dict) -> dict:
    out = {}
    for f in desc.fields:
        if f.name not in d:
            real_oneof = f.containing_oneof is not None and f.containing_oneof.name != f"_{f.name}"
            if f.has_presence and not real_oneof:
                out[f.name] = None  # optional and absent: null, not a missing key
            continue
        v = d[f.name]
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            vf = f.message_type.fields_by_name["value"]
            if vf.message_type is not None:
                v = {k: _tidy(vf.message_type, x) for k, x in v.items()}
            elif vf.type in _INT64:
                v = {k: int(x) for k, x in v.items()}
        elif f.message_type is not None:
            v = [_tidy(f.message_type, x) for x in v] if _repeated(f) else _tidy(f.message_type, v)
        elif f.type in _INT64:
            v = [int(x) for x in v] if _repeated(f) else int(v)
        out[f.name] = v
    return out


def print_json(obj) -> None:
    if hasattr(obj, "DESCRIPTOR"):
        obj = to_dict(obj)
    elif isinstance(obj, list):
        obj = [to_dict(o) if hasattr(o, "DESCRIPTOR") else o for o in obj]
    json.dump(obj, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], out=None) -> None:
    out = out or sys.stdout
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for r in cells:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n")


def gib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / (1 << 30):.1f}"


def age(since: float, now: float | None = None) -> str:
    s = max(0, int((now or time.time()) - since))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def cpu_ranges(cpus: Sequence[int]) -> str:
    """[0,1,2,3,8,9] -> '0-3,8-9' (as nvidia-smi prints CPU affinity)."""
    if not cpus:
        return "N/A"
    out, start, prev = [], cpus[0], cpus[0]
    for c in [*cpus[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
        if c is not None:
            start = prev = c
    return ",".join(out)
