"""dyad: multimodal Mixture-of-Experts training with the vision encoder and the MoE LLM as
separate services (see README.md)."""

import os

# gRPC from 1.65 on leaves its log level to absl, which prints INFO lines (a "Got goaway" for each
# connection a stopped server closes) unless GRPC_VERBOSITY names one; ERROR was gRPC's default.
# Here, before any dyad process (the CLI, the router, a worker) imports grpc.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
