"""Tests of server/: engine loop, gRPC service, client and CLI."""
