"""Salience (seed 002): stateful sessions over gRPC."""
