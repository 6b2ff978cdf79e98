"""Health: the ``Health`` query every service answers, the figures of its reply, and liveness (``Alive``)."""

from __future__ import annotations

import msgspec

from common.wire.base import Msg


class Health(Msg, tag="health"):
    pass


class WorkerStage(msgspec.Struct, kw_only=True):
    """The best stage among a scheduler's workers; generation needs ``ready``."""

    stage: str = "absent"  # "absent" | "loading" | "ready" | "failed"
    progress: int = 0
    message: str = "no worker has connected yet"
    workers: int = 0
    device: str = ""


class ControllerStepStats(msgspec.Struct, kw_only=True):
    """Main-channel cost so far: wall time of post_pre_process/mid_process calls, sequence-steps run, and how
    many controlled steps went out before the result of the step before them (``controllers.pipeline``)."""

    main_s: float = 0.0
    seq_steps: int = 0
    us_per_seq_step: float = 0.0
    followed_steps: int = 0


class WorkerLoad(msgspec.Struct, kw_only=True):
    """One worker as the scheduler sees it: its load, its KV pool and how placement used it."""

    worker: str  # its id (the ZeroMQ identity it announced)
    stage: str
    device: str
    running: int
    kv_capacity_tokens: int
    kv_used_tokens: int
    kv_cached_tokens: int
    kv_free_tokens: int
    kv_reserved_tokens: int
    prefix_blocks_indexed: int  # its prefix blocks in the scheduler's placement index
    prefix_hit_rate: float  # share of the prompt tokens placed there whose KV its cache held
    placed: dict[str, int] = {}  # why sequences went there: reason -> count
    forward: str = ""  # its engine's backend (WorkerHello.forward)
    fallback_reason: str = ""  # why it runs the transformers fallback, when it does


class GatewayPeer(msgspec.Struct, kw_only=True):
    """One gateway as the scheduler sees it, from its heartbeats (``GatewayAlive``)."""

    gateway: str  # its ZeroMQ identity (gateway-<host>-<pid>)
    incarnation: str
    requests: int  # its live requests
    silent_s: float  # since its last message


class ModelFacts(msgspec.Struct, kw_only=True):
    """The scheduler's health: the served model's facts (from its first ready worker; the configured
    context before one is) and its load. Gateways admit requests against these, and ``/health``
    shows them as they are."""

    worker: WorkerStage = msgspec.field(default_factory=WorkerStage)
    model: str = ""
    vocab_size: int = 0  # 0: no ready worker yet
    max_model_len: int = 0
    eos_token_ids: list[int] = []
    kv_capacity_tokens: int = 0
    kv_free_tokens: int = 0  # empty, as the workers' last steps left it
    kv_cached_tokens: int = 0  # holding reusable prefixes only (evicted on demand)
    kv_used_tokens: int = 0  # holding live sequences
    kv_reserved_tokens: int = 0  # promised to admitted requests and parked sessions
    queued: int = 0
    running: int = 0
    paused: int = 0
    controller_runtime: str = ""  # "ok", or what is wrong with it
    controller_steps: ControllerStepStats = msgspec.field(default_factory=ControllerStepStats)
    hidden_size: int = 0
    num_layers: int = 0  # the served model's decoder layers (0: no ready worker yet)
    readout_concepts: list[str] = []
    readout_layers: list[int] = []
    parked_sessions: int = 0
    parked_tokens: int = 0
    workers: list[WorkerLoad] = []
    gateways: list[GatewayPeer] = []


class EngineStats(msgspec.Struct, kw_only=True):
    """A ready worker's engine: its backend and its KV pool and prefix-cache figures. Blocks: ``total``
    usable, ``free`` (unreferenced, empty), ``cached`` (unreferenced, holding a reusable prefix), ``used``
    by live sequences; ``kv_*_tokens`` count the same in tokens. The hit rate is the share of fed tokens
    whose KV came from the cache."""

    backend: str
    weights: str
    active_seqs: int
    kv_capacity_tokens: int
    kv_free_tokens: int
    kv_cached_tokens: int
    kv_used_tokens: int
    kv_block_size: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_blocks_used: int
    kv_evictions: int
    prefix_caching: bool
    prefix_fed_tokens: int
    prefix_cached_tokens: int
    prefix_hit_rate: float


class WorkerHealth(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A worker's answer to Health: its stage, and its engine once ready (else its loading progress and
    message, or why loading failed)."""

    stage: str  # "loading" | "ready" | "failed"
    worker_id: str
    model: str
    device: str = ""
    progress: int = 0
    message: str = ""
    engine: EngineStats | None = None


class HealthReply(Msg, tag="health_reply"):
    """``facts``: the scheduler's; ``worker``: a worker's (other services leave both out)."""

    service: str
    ready: bool
    worker: WorkerHealth | None = None
    facts: ModelFacts | None = None
    incarnation: str = ""  # the answering process's life (common.incarnation)


class Alive(Msg, tag="alive"):
    """The answer to a heartbeat: which life of ``service`` answered (see :mod:`common.incarnation`).
    A peer hearing a new ``incarnation`` knows what it had in flight there is gone."""

    service: str
    incarnation: str
