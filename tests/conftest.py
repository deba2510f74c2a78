"""Settings every test process shares, made before any test module imports grpc."""

import os

# gRPC from 1.65 on leaves its C core's log level to absl, which prints INFO lines to stderr (a
# "Got goaway" for each connection an in-process server closes) unless GRPC_VERBOSITY names a
# level; ERROR is what gRPC printed before. Processes the tests start inherit it.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
