"""gRPC protocol (package resihp.v1) and its generated code."""
