"""Python run as another uid by a test running as root: the child imports all it needs, then drops to that
uid. After the drop, the checkout and the interpreter's files may be unreadable to it (a clone in a 0700
directory, a Python under /root), so nothing may be imported from then on."""

from __future__ import annotations

NOBODY = 65534  # the uid (and gid) the tests act as when they need someone who is not root

# grpc imports _channel, _interceptor and _utilities at first use (insecure_channel, ...): imported here.
PRELUDE = """
import json, os, sys
import grpc, grpc._channel, grpc._interceptor, grpc._utilities
from xpud.api.client import Client
from xpud.errors import XpudError
os.setgroups([]); os.setgid({uid}); os.setuid({uid})
"""
