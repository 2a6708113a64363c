"""Generated protobuf and gRPC modules for verst.v1 (see proto/generate.py)."""
