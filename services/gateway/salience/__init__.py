"""Salience (salience.proto): stateful sessions over gRPC."""
