"""The hetfed aggregator service: gRPC server, round engine, state store and numpy server halves."""
