"""A session's node graph and the Evergreen spec's rules on it (no I/O: unit-testable on its own).

Rules enforced by :meth:`NodeGraph.add` (each violation raises :class:`SessionAbort`):

* a fragment needs an id and a seq >= 0; a second fragment with a node's seq is ignored silently;
* nothing may follow a node's final fragment (``continued`` false), and a final fragment may not
  precede a seq already received;
* only seq 0 carries chunk metadata, and a leaf's seq 0 must carry a chunk with a mimetype;
* a node is a leaf (``chunk_fragment``) or a parent (``child_ids``), never both;
* no cycles, and no path longer than the nesting limit; node count and inline bytes are bounded;
* ``file://`` refs must pass :func:`refs.resolve_ref` when they arrive;
* a node some action outputs is written by the server only.

Children may be referenced before they arrive: :meth:`NodeGraph.flatten` then reports the input as
not complete yet (a data-dependency barrier), never as an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from common.protos.evergreen.v2 import evergreen_pb2 as eg
from services.gateway.evergreen.errors import SessionAbort
from services.gateway.evergreen.refs import resolve_ref


@dataclass
class Node:
    id: str
    fragments: dict[int, eg.NodeFragment] = field(default_factory=dict)
    final_seq: int | None = None
    leaf: bool | None = None  # unknown until a fragment with content arrives

    @property
    def complete(self) -> bool:
        return self.final_seq is not None and len(self.fragments) == self.final_seq + 1

    def ordered(self) -> list[eg.NodeFragment]:
        return [self.fragments[s] for s in sorted(self.fragments)]

    def child_ids(self) -> list[str]:
        return [c for f in self.ordered() for c in f.child_ids]

    @property
    def metadata(self) -> eg.ChunkMetadata | None:
        first = self.fragments.get(0)
        return first.chunk_fragment.metadata if first is not None and first.HasField("chunk_fragment") else None


@dataclass(frozen=True)
class Leaf:
    """One chunk of a flattened input: its node, metadata and payload parts (bytes or ref URIs) in seq order."""

    node_id: str
    metadata: eg.ChunkMetadata
    parts: tuple[bytes | str, ...]


@dataclass
class Flattened:
    """The leaves known so far under a root, in order; ``missing``: nodes not (fully) received yet."""

    leaves: list[Leaf]
    missing: list[str]

    @property
    def complete(self) -> bool:
        return not self.missing


class NodeGraph:
    def __init__(self, *, max_depth: int, max_nodes: int, max_bytes: int, ref_root: Path) -> None:
        self.nodes: dict[str, Node] = {}
        self.parents: dict[str, set[str]] = {}  # child id -> ids of the nodes listing it
        self.server_owned: set[str] = set()  # output ids of actions: only the server writes them
        self._max_depth = max_depth
        self._max_nodes = max_nodes
        self._max_bytes = max_bytes
        self._ref_root = ref_root
        self._bytes = 0

    # -- adding ---------------------------------------------------------------------------

    def add(self, frag: eg.NodeFragment, *, from_server: bool = False) -> bool:
        """Apply one fragment; False when it was a duplicate (ignored)."""
        if not frag.id:
            raise SessionAbort.invalid("a node_fragment has no id")
        if frag.seq < 0:
            raise SessionAbort.invalid(f"node {frag.id!r}: seq {frag.seq} is negative")
        if frag.id in self.server_owned and not from_server:
            raise SessionAbort.invalid(f"node {frag.id!r} is an action's output: only the server writes it")
        node = self.nodes.get(frag.id)
        if node is not None and frag.seq in node.fragments:
            return False  # the spec: keep the first fragment with a seq, ignore the rest without error
        self._check_content(frag)
        if node is None:
            node = Node(frag.id)
        self._check_boundaries(node, frag)
        is_leaf = frag.HasField("chunk_fragment")
        if (is_leaf or frag.child_ids) and node.leaf is not None and node.leaf != is_leaf:
            kind = "leaf (chunk_fragment)" if node.leaf else "parent (child_ids)"
            raise SessionAbort.invalid(f"node {frag.id!r}: seq {frag.seq} mixes content kinds; the node is a {kind}")
        self._check_leaf_head(node, frag)
        self._check_limits(node, frag)
        for child in frag.child_ids:
            self._check_edge(frag.id, child)

        if node.id not in self.nodes:
            self.nodes[node.id] = node
        node.fragments[frag.seq] = frag
        if not frag.continued:
            node.final_seq = frag.seq
        if is_leaf or frag.child_ids:
            node.leaf = is_leaf
        self._bytes += len(frag.chunk_fragment.data)
        for child in frag.child_ids:
            self.parents.setdefault(child, set()).add(frag.id)
        return True

    def _check_content(self, frag: eg.NodeFragment) -> None:
        if frag.child_ids and frag.HasField("chunk_fragment"):
            raise SessionAbort.invalid(f"node {frag.id!r}: a fragment has both child_ids and chunk_fragment")
        if not frag.HasField("chunk_fragment"):
            return
        chunk = frag.chunk_fragment
        if frag.seq != 0 and chunk.HasField("metadata"):
            raise SessionAbort.invalid(
                f"node {frag.id!r}: seq {frag.seq} carries metadata; only the fragment with seq 0 may"
            )
        if frag.seq == 0 and not chunk.metadata.mimetype:
            raise SessionAbort.invalid(f"node {frag.id!r}: seq 0 of a leaf must carry metadata with a mimetype")
        if chunk.WhichOneof("payload") == "ref":
            resolve_ref(chunk.ref, self._ref_root)

    @staticmethod
    def _check_leaf_head(node: Node, frag: eg.NodeFragment) -> None:
        """A leaf's seq 0 carries its metadata, so a seq 0 without a chunk cannot head a leaf
        (whichever of the two fragments arrives first); else the leaf's data would be lost."""
        head = frag if frag.seq == 0 else node.fragments.get(0)
        is_leaf = frag.HasField("chunk_fragment") or node.leaf is True
        if is_leaf and head is not None and not head.HasField("chunk_fragment"):
            raise SessionAbort.invalid(f"node {node.id!r}: seq 0 of a leaf must carry metadata with a mimetype")

    @staticmethod
    def _check_boundaries(node: Node, frag: eg.NodeFragment) -> None:
        if node.final_seq is not None:
            if frag.seq > node.final_seq:
                raise SessionAbort.invalid(
                    f"node {node.id!r}: fragment seq {frag.seq} follows its final fragment (seq {node.final_seq})"
                )
            if not frag.continued:
                raise SessionAbort.invalid(
                    f"node {node.id!r}: seq {frag.seq} is marked final but seq {node.final_seq} already was"
                )
        later = max(node.fragments, default=-1)
        if not frag.continued and later > frag.seq:
            raise SessionAbort.invalid(f"node {node.id!r}: seq {frag.seq} is marked final but seq {later} was received")

    def _check_limits(self, node: Node, frag: eg.NodeFragment) -> None:
        if node.id not in self.nodes and len(self.nodes) >= self._max_nodes:
            raise SessionAbort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the session holds its limit of {self._max_nodes} nodes")
        if self._bytes + len(frag.chunk_fragment.data) > self._max_bytes:
            raise SessionAbort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"the session's inline data exceeds its limit of {self._max_bytes} bytes"
            )

    def _check_edge(self, parent: str, child: str) -> None:
        path = self._path_down(child, parent)
        if path is not None:
            raise SessionAbort.invalid("cycle in the node graph: " + " → ".join([parent, *path]))
        depth = self._height_above(parent) + 1 + self._height_below(child)
        if depth > self._max_depth:
            raise SessionAbort.invalid(
                f"node {parent!r} → {child!r}: the node graph would nest {depth} levels deep; the limit is {self._max_depth}"
            )

    def _path_down(self, start: str, target: str) -> list[str] | None:
        """A path of child edges from ``start`` to ``target`` (both included), or None."""
        stack: list[tuple[str, list[str]]] = [(start, [start])]
        seen: set[str] = set()
        while stack:
            current, path = stack.pop()
            if current == target:
                return path
            if current in seen:
                continue
            seen.add(current)
            node = self.nodes.get(current)
            if node is not None:
                stack.extend((c, [*path, c]) for c in node.child_ids())
        return None

    def _height_below(self, node_id: str) -> int:
        return self._longest(node_id, lambda n: self.nodes[n].child_ids() if n in self.nodes else ())

    def _height_above(self, node_id: str) -> int:
        return self._longest(node_id, lambda n: self.parents.get(n, ()))

    @staticmethod
    def _longest(start: str, step: Callable[[str], Iterable[str]]) -> int:
        """Edges on the longest path from ``start`` following ``step`` (the graph is acyclic)."""
        memo: dict[str, int] = {}
        order: list[tuple[str, bool]] = [(start, False)]
        while order:
            current, expanded = order.pop()
            if current in memo:
                continue
            nexts = list(step(current))
            if expanded or not nexts:
                memo[current] = 1 + max((memo[n] for n in nexts), default=-1)
                continue
            order.append((current, True))
            order.extend((n, False) for n in nexts if n not in memo)
        return memo[start]

    # -- claiming, dropping ---------------------------------------------------------------

    def claim_output(self, node_id: str) -> None:
        """Reserve an action's output id; it must be new to the session."""
        if not node_id:
            raise SessionAbort.invalid("an action output has no node id")
        if node_id in self.nodes or node_id in self.server_owned:
            raise SessionAbort.invalid(f"output node {node_id!r} is not new: node ids of outputs must not be reused")
        self.server_owned.add(node_id)

    def drop(self, node_ids: Iterable[str]) -> list[str]:
        """Forget nodes (what DROP and an expired TTL do); returns the ids that were held."""
        dropped = []
        for node_id in node_ids:
            node = self.nodes.pop(node_id, None)
            if node is None:
                continue
            dropped.append(node_id)
            self._bytes -= sum(len(f.chunk_fragment.data) for f in node.fragments.values())
            for child in node.child_ids():
                self.parents.get(child, set()).discard(node_id)
        return dropped

    def descendants(self, root: str) -> list[str]:
        """``root`` and every node held below it."""
        out, stack, seen = [], [root], set()
        while stack:
            current = stack.pop()
            if current in seen or current not in self.nodes:
                continue
            seen.add(current)
            out.append(current)
            stack.extend(self.nodes[current].child_ids())
        return out

    # -- reading --------------------------------------------------------------------------

    def flatten(self, root: str, *, max_visits: int) -> Flattened:
        """The leaves under ``root`` in order (a node listed twice appears twice, so the walk is bounded)."""
        leaves: list[Leaf] = []
        missing: list[str] = []
        stack = [root]
        visits = 0
        while stack:
            visits += 1
            if visits > max_visits:
                raise SessionAbort.invalid(f"input {root!r} flattens to more than {max_visits} nodes")
            node_id = stack.pop()
            node = self.nodes.get(node_id)
            if node is None or not node.complete:
                missing.append(node_id)
            if node is None:
                continue
            if node.leaf:
                metadata = node.metadata
                if metadata is not None:
                    parts = tuple(
                        f.chunk_fragment.data if f.chunk_fragment.WhichOneof("payload") != "ref" else f.chunk_fragment.ref
                        for f in node.ordered()
                    )
                    leaves.append(Leaf(node.id, metadata, parts))
            else:
                stack.extend(reversed(node.child_ids()))
        return Flattened(leaves, missing)
