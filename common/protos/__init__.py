"""gRPC protocol definitions served by Tiller and their generated Python stubs.

Regenerate the stubs with ``python -m common.protos.build``.
"""
