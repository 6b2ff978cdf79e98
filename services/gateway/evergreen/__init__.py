"""The Evergreen protocol: ``evergreen.v2.EvergreenService/StartSession`` on the gateway's gRPC port.

Modules: :mod:`.graph` (the node graph and its rules), :mod:`.refs` (external refs), :mod:`.turns`
(flattened chunks to chat turns), :mod:`.config` (action configs), :mod:`.actions` (GENERATE and the
session-management actions), :mod:`.session` (one StartSession stream), :mod:`.service` (the servicer).
"""
