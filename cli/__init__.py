"""The `xpu` command line (imported as ``xpu_cli``)."""

import os

# `xpu run` forks its command while gRPC threads run; gRPC's fork handlers would only log noise then.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
