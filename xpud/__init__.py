"""xpud: a dual-mode GPU scheduler (whole cards and isolated slices) for bare-metal AI clusters."""

import os as _os

# gRPC's fork handlers (on by default) crash a child forked while gRPC threads are busy (a rank of a
# multi-host job started by the daemon died with SIGSEGV before its exec now and then). xpud never uses
# gRPC in a forked child: it only execs, so the handlers are off. Read by grpc at its import.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

__version__ = "0.1.0"
