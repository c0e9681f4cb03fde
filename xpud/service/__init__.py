"""The gRPC servicers: thin handlers that check the caller, convert and call the engine."""
