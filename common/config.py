"""The one typed settings object every process reads.

Values come, highest priority first, from: keyword arguments, environment variables (``TILLER_*``,
nested fields with ``__``, e.g. ``TILLER_LIMITS__MAX_BATCH_SIZE=32``), the TOML file named by
``TILLER_CONFIG``, then the defaults below.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

DEFAULT_MODEL = "smollm2"


class Limits(BaseModel):
    """Admission, batching and input-size limits."""

    max_batch_size: int = Field(64, ge=1, description="sequences in one worker step")
    adaptive_batch: bool = Field(True, description="admit to each worker no more sequences than the batch past which "
                                 "its measured decode throughput stops growing (5% per doubling), max_batch_size "
                                 "staying the ceiling: a saturated CPU runs 64 sequences no faster than 16, only "
                                 "slower each (services/scheduler/batch_ceiling.py)")
    max_queued: int = Field(4096, ge=0, description="requests waiting for admission before memory_pressure (load "
                            "tools made for vLLM, which queues without a bound, send a thousand requests at once)")
    max_model_len: int = Field(2048, ge=16, description="context cap (clamped to the model's own)")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens of a request that names none (the WebSocket "
                                    "protocol, REST, AICI runs, Evergreen, Salience), capped by the room in the context")
    completions_default_max_tokens: int = Field(16, ge=1, description="the same for OpenAI /v1/completions (16: "
                                                "OpenAI's and vLLM's default)")
    chat_default_max_tokens: int | None = Field(None, ge=1, description="the same for OpenAI /v1/chat/completions; "
                                                "none: default_max_tokens (vLLM's default, the room left in the "
                                                "context, would reserve a whole context of KV for every choice)")
    max_tokens_cap: int = Field(4096, ge=1, description="the largest max_tokens a request may ask for; more is refused "
                                "naming the cap and the context")
    prefill_chunk_tokens: int = Field(512, ge=16, description="prompt tokens of one sequence per step")
    step_token_budget: int = Field(2048, ge=16, description="tokens fed to the model in one step")
    pipeline_depth: int = Field(2, ge=1, le=2, description="steps in flight per worker: 2 queues the next "
                                "decode step while one runs (a sequence's step feeds the worker's own last sample)")
    max_top_logprobs: int = Field(20, ge=0, description="most alternatives per token a request may ask logprobs for")
    max_stop_strings: int = Field(16, ge=0, description="stop strings one request may give")
    max_token_biases: int = Field(300, ge=0, description="entries of an OpenAI logit_bias, and stop_token_ids "
                                  "(each is work in every step of the request)")
    max_choices: int = Field(64, ge=1, description="choices one OpenAI request may ask for (prompts x n)")
    max_ws_message_bytes: int = Field(1 << 20, ge=1024, description="largest WebSocket frame accepted")
    max_http_body_bytes: int = Field(4 << 20, ge=1024, description="largest HTTP request body accepted")
    max_json_depth: int = Field(64, ge=2, le=512, description="deepest nesting of arrays and objects in a JSON "
                                "request body or WebSocket message; deeper ones are refused with invalid_request")
    request_timeout_s: float = Field(600.0, gt=0, description="a generation running longer ends with timeout")
    worker_absent_s: float = Field(30.0, gt=0, description="a request waiting for the model fails (retryable) once "
                                   "no worker has been connected for this long (a loading worker is waited for until "
                                   "request_timeout_s)")
    rate_limit_per_minute: int = Field(0, ge=0, description="requests per user when api_auth tokens name them, else "
                                       "per client address; 0 disables")
    worker_step_timeout_s: float = Field(60.0, gt=0, description="how long a step may take: the scheduler waits this "
                                         "long for a step's result, a worker as long for its masks")
    gateway_heartbeat_s: float = Field(1.0, gt=0, description="a gateway tells the scheduler (and the session store "
                                       "while it holds Salience leases or Evergreen sessions) it is alive this often")
    peer_suspect_grace_s: float = Field(0.5, gt=0, description="after the connection to a peer holding our work "
                                        "drops, how long it has to answer again before that work is failed")
    peer_silence_s: float = Field(5.0, gt=0, description="a peer holding our work that does not answer heartbeats "
                                  "this long is taken for dead and that work is failed")
    gateway_silence_s: float = Field(10.0, gt=0, description="the scheduler cancels the requests of a gateway "
                                     "that sent heartbeats and then stayed silent this long (it died)")
    kv_memory_fraction: float | None = Field(
        None, gt=0, le=1, description="share of the memory free after loading the model that the KV pool takes "
        "(default 0.85 on a GPU, 0.5 of available RAM on the CPU)"
    )
    kv_cpu_max_bytes: int = Field(
        1 << 30, ge=1 << 20, description="the most the KV pool takes on the CPU (1 GiB: 23,296 tokens of the "
        "default model in fp32, beside other programs on a laptop); the GPU pool is sized by kv_memory_fraction alone"
    )
    cuda_graphs: bool = Field(True, description="replay decode steps from CUDA graphs on a GPU")
    content_filter_patterns: list[str] = Field(
        default_factory=list, description="regexes; a prompt matching one is refused with content_filter"
    )


class Images(BaseModel):
    """Limits on images attached to Salience Generate calls (vision-language models only)."""

    max_image_bytes: int = Field(16 << 20, ge=1, description="largest encoded image accepted")
    max_image_pixels: int = Field(
        32_000_000, ge=1, description="largest image (width x height) decoded; larger ones are refused unread"
    )
    max_images_per_request: int = Field(16, ge=0, description="images one Salience Generate call may carry")


class Sessions(BaseModel):
    """Salience stateful sessions (salience.proto): lifetime, auth, KV kept between turns, readouts."""

    ttl_s: float = Field(1800.0, gt=0, description="a session idle this long is evicted (any call refreshes it)")
    auth_token: str = Field("", description="bearer token every Salience RPC must carry ('': no auth)")
    kv_tokens_per_session: int = Field(
        8192, ge=0, description="most KV tokens one idle session keeps on a worker between turns (0: none kept)"
    )
    kv_parked_fraction: float = Field(
        0.5, ge=0, le=1, description="share of a worker's KV pool idle sessions may hold; live requests evict them first"
    )
    responses_ttl_s: float = Field(
        30 * 24 * 3600.0, gt=0, description="how long a stored response of the OpenAI Responses API (store: true) is "
        "kept, for GET /v1/responses/{id} and previous_response_id (30 days, as OpenAI keeps them)"
    )
    busy_lease_s: float = Field(
        5.0, gt=0, description="a Generate's hold on its session, renewed by its gateway's heartbeats: a session "
        "whose gateway died is free again after this long"
    )
    readout_concepts: list[str] = Field(
        default_factory=lambda: ["yes", "no", "good", "bad", "happy", "sad", "true", "false"],
        description="logit-lens concepts: each word's first token's unembedding row",
    )
    readout_layers: list[int] = Field(
        default_factory=list, description="decoder layers read out (0-based; empty: four evenly spaced, the last included)"
    )
    concepts_file: Path | None = Field(
        None, description='JSON {"concepts": {name: [hidden_size floats]}} replacing readout_concepts'
    )


class Embeddings(BaseModel):
    """OpenAI's ``POST /v1/embeddings`` on the served model (see docs/openai-tools.md, 'Embeddings')."""

    pooling: Literal["last", "mean"] = Field(
        "last", description="how a prompt's final hidden states (after the final norm) become one vector: 'last' the "
        "last token's (in a causal model the one position that has read the whole input; what decoder embedding "
        "models such as e5-mistral use, and vLLM's default for them), 'mean' the average over every token",
    )
    normalize: bool = Field(True, description="scale each vector to length 1, as OpenAI's are (cosine similarity "
                            "is then a dot product)")
    max_inputs: int = Field(2048, ge=1, description="inputs one request may embed (OpenAI's limit); each runs as a "
                            "prefill-only request through the scheduler")


class Evergreen(BaseModel):
    """Limits and external-ref policy of the Evergreen gRPC service."""

    max_nesting_depth: int = Field(64, ge=1, description="longest parent-to-leaf path in a session's node graph")
    max_session_nodes: int = Field(100_000, ge=1, description="nodes one session may hold")
    max_session_bytes: int = Field(64 << 20, ge=1024, description="inline bytes one session may hold; also the largest file a ref may name")
    max_message_bytes: int = Field(16 << 20, ge=1024, description="largest SessionMessage accepted")
    abort_grace_s: float = Field(0.5, ge=0, description="how long an aborted session's status waits for a client "
                                 "still sending to close its side (see services/gateway/evergreen/session.py)")
    ref_root: Path | None = Field(
        None, description="directory that file:// refs may name (default: <run_dir>/evergreen_files)"
    )


class Controllers(BaseModel):
    """The controller runtime: per-call deadlines (AICI v0.0.x-like), Wasm limits, storage, native controllers."""

    init_deadline_ms: float = Field(1000.0, gt=0, description="instantiate: aici_init + aici_create + init_prompt")
    pre_deadline_ms: float = Field(10.0, gt=0, description="pre_process (plus the post_process of its ff_tokens)")
    mid_deadline_ms: float = Field(150.0, gt=0, description="mid_process, for all of one user's sequences in a step "
                                   "together (the step waits for their masks; once used up, each of the user's "
                                   "next ones in the step gets pre_deadline_ms)")
    post_deadline_ms: float = Field(10.0, gt=0, description="post_process")
    epoch_tick_ms: float = Field(1.0, gt=0, description="deadline resolution: the epoch ticker's period")
    max_memory_bytes: int = Field(64 << 20, ge=1 << 17, description="linear memory of one controller instance")
    max_wasm_stack_bytes: int = Field(512 << 10, ge=64 << 10, description="Wasm stack of one controller instance")
    max_forks: int = Field(16, ge=1, description="live sequences one request may fork into")
    max_ff_rounds: int = Field(10, ge=1, description="pre_process ff_tokens fed back to post_process per step")
    deadlock_steps: int = Field(3, ge=1, description="steps every sequence of a request may stay suspended before "
                                "they all end with finish reason 'deadlock' (as rLLM)")
    max_constraints: int = Field(64, ge=1, description="live host constraints one controller instance may hold")
    max_log_bytes: int = Field(64 << 10, ge=1024, description="captured stdout/stderr kept per call")
    max_module_bytes: int = Field(64 << 20, ge=1024, description="largest Wasm module mk_module accepts")
    max_storage_bytes: int = Field(16 << 20, ge=1024, description="variables (names and values) one request's "
                                   "controllers may hold, its forks together; a write past it fails that sequence")
    max_tokenize_bytes: int = Field(256 << 10, ge=1024, description="text one aici_host_tokenize call may take (it "
                                    "runs on the runtime's thread, which every controlled step waits for)")
    pending_ttl_s: float = Field(600.0, gt=0, description="an instantiated controller never bound to a sequence is dropped after this")
    user_cpu_share: float = Field(0.5, ge=0, description="controller CPU seconds per second one user's controllers may "
                                  "take on average (every call is charged to its user, deadline overruns included; "
                                  "0: no limit)")
    user_cpu_burst_s: float = Field(5.0, gt=0, description="controller CPU seconds one user may take in a burst")
    max_controlled_per_user: int = Field(64, ge=1, description="controlled requests one user may have live at once")
    nice: int = Field(0, ge=0, le=19, description="the runtime's CPU priority (Unix nice, applied at start; 0: as "
                      "started): above 0 controller code yields the CPU to the worker's forward pass, and every "
                      "controlled step waits longer for its calls on a busy host (see docs/controllers.md)")
    module_dir: Path | None = Field(None, description="modules, compiled cache and tags (default: <run_dir>/controllers)")
    native: dict[str, str] = Field(
        default_factory=lambda: {"constrained": "controllers.native.constrained:ConstrainedController",
                                 "concept_guard": "controllers.native.concept_guard:ConceptGuard"},
        description="trusted Python controllers, name -> 'module:Class'; instantiate them as 'native:<name>'",
    )
    response_format: str = Field(
        "constrained", description="the native controller that enforces the OpenAI API's JSON response_format (given "
        "{'json_schema': ..., 'max_tokens': ...}); '' or a name not in 'native' refuses JSON response formats",
    )
    main_timeout_s: float = Field(5.0, gt=0, description="how long the scheduler waits for a main-channel reply")
    step_ahead: bool = Field(True, description="with no plain sequence running, a controlled step whose sequences' "
                             "controllers flag pre_process as the default goes out before post_pre_process, which "
                             "then runs with mid_process during the forward pass (the controllers see the same calls)")
    pipeline: bool = Field(True, description="with step_ahead: such a step goes out even before the result of the "
                           "step before it is back, as plain decoding steps do (follow), so the worker never waits "
                           "for the scheduler between controlled steps; a sequence that the token in flight ends, or "
                           "whose controller then asks for more than the default pre_process, is fed, not sampled")
    side_timeout_s: float = Field(30.0, gt=0, description="how long the gateway waits for a side-channel reply")


class Steering(BaseModel):
    """Steering vectors (docs/steering.md): added to the residual stream after chosen decoder layers, per request."""

    max_vector_bytes: int = Field(64 << 20, ge=1024, description="largest vector file (GGUF, safetensors or "
                                  "JSON) an upload may carry")
    max_vectors_per_request: int = Field(8, ge=0, description="vectors one request's steering may name (0: "
                                         "steering refused)")
    max_layers_per_request: int = Field(256, ge=1, description="(vector, layer) pairs one request's steering may "
                                        "add up")
    max_scale: float = Field(1000.0, gt=0, description="the largest |scale| a steering term may give")
    max_vectors_per_user: int = Field(0, ge=0, description="vectors one user may store (0: no limit)")
    max_build_pairs: int = Field(256, ge=1, description="positive/negative pairs one vectors:build may take")
    max_build_tokens: int = Field(512, ge=1, description="tokens of one text of a vectors:build pair")


class ApiAuth(BaseModel):
    """Who calls the controller API (``/v1/controllers``, ``/v1/run``, a ``controller`` on any surface):
    the user name and admin flag sent as ``$auth`` on the side channel (tag ownership, logs)."""

    tokens: dict[str, str] = Field(
        default_factory=dict,
        description="bearer token -> user name; when any is set, controller calls need 'Authorization: Bearer <token>'",
    )
    user_header: str = Field("x-user-id", description="without tokens: the header naming the user (set by a front proxy)")
    role_header: str = Field(
        "x-user-role", description="without tokens: a header that, when present, makes the user admin iff it is 'admin' (rLLM)"
    )
    key_header: str = Field("api-key", description="with tokens: also accepted instead of 'Authorization: Bearer' (pyaici)")
    everywhere: bool = Field(
        False, description="with tokens: every HTTP route and WebSocket but /health and /metrics needs one (vLLM's "
        "--api-key); without this, only the controller API does",
    )
    default_user: str = Field("localhost", description="the user when no token is configured and the header is absent")
    admins: list[str] = Field(default_factory=lambda: ["localhost"], description="users who may set any tag and "
                              "reach every user's sessions, request records and tags")


class Tenants(BaseModel):
    """Users apart (see docs/tenants.md): which users share prefix-cached KV, and what each user may hold. A quota
    of 0 is no limit; a call past one is refused (HTTP 429 rate_limited, gRPC RESOURCE_EXHAUSTED) naming it."""

    cache_isolation: Literal["user", "groups", "none"] = Field(
        "user", description="who shares prefix-cached KV: 'user' each user alone once api_auth.tokens name more "
        "than one user (else everyone, the one user and anonymous callers); 'groups' the users of one cache_groups "
        "entry together, any other user alone; 'none' everyone (a request's cache_salt still splits its domain)",
    )
    cache_groups: dict[str, list[str]] = Field(
        default_factory=dict, description="with cache_isolation 'groups': group name -> its users, who share KV",
    )
    max_sessions_per_user: int = Field(0, ge=0, description="live Salience sessions one user may hold (opened or "
                                       "forked, not yet closed or expired)")
    max_session_tokens_per_user: int = Field(0, ge=0, description="tokens one user's live Salience sessions may "
                                             "hold together (a turn that would take them past it is refused)")
    max_generations_per_user: int = Field(0, ge=0, description="generations one user may have running or queued "
                                          "at once, every surface together (the scheduler counts them)")
    max_modules_per_user: int = Field(0, ge=0, description="controller modules one user may upload (a module "
                                      "counts for every user who uploaded it)")
    max_module_bytes_per_user: int = Field(0, ge=0, description="Wasm bytes of the modules one user uploaded, "
                                           "together")


class Distributed(BaseModel):
    """Processes of one stack: local workers and gateways, and a worker spread over several ranks (tensor
    parallel on torch.distributed)."""

    tensor_parallel: int = Field(1, ge=1, description="ranks of one worker, each holding a shard of every layer "
                                 "and of the KV cache (one per GPU; gloo on the CPU); rank 0 talks to the scheduler")
    port: int = Field(0, ge=0, le=65535, description="the ranks' rendezvous port on 127.0.0.1 (0: any free port)")
    local_workers: int = Field(1, ge=0, description="workers `tiller up` starts on this host (0: only workers "
                               "that join from elsewhere; on the CPU the cores are split between them)")
    gateways: int = Field(1, ge=1, description="gateway processes `tiller up` starts on this host (`--gateways "
                          "N`), all serving the same HTTP and gRPC ports (SO_REUSEPORT); with more than one the rate "
                          "limits are counted in the session store and /metrics sums the processes (docs/scale-out.md)")
    placement_balance: int = Field(8, ge=0, description="a new prompt goes to the worker caching its longest prefix "
                                   "(else the one its first block hashes to) only among workers running at most this "
                                   "many sequences beyond the least loaded")
    heartbeat_s: float = Field(1.0, gt=0, description="the scheduler and its workers ping each other's connection "
                               "this often (ZeroMQ heartbeats, answered even while a worker computes a step)")
    heartbeat_timeout_s: float = Field(5.0, gt=0, description="a worker connection silent this long is dropped: a "
                                       "host that vanished without closing its TCP connections is noticed")


class Curve(BaseModel):
    """CurveZMQ on every ``tcp://`` ZeroMQ socket (see docs/security.md): each host has one key pair
    (``tiller keys``); the host that binds (the scheduler's) accepts only the public keys it lists."""

    model_config = ConfigDict(frozen=True)  # hashable: the keys loaded from it are cached by it

    secret_key: Path | None = Field(None, description="this host's key pair, the NAME.key_secret file `tiller keys` "
                                    "writes (owner-only); set: every tcp:// socket is encrypted and authenticated "
                                    "and plaintext peers are refused; unset: tcp:// is plaintext (ipc:// is not "
                                    "affected either way)")
    server_key: Path | None = Field(None, description="the public key (NAME.key) of the host whose sockets this "
                                    "one connects to (the scheduler's host); unset: this host's own")
    authorized_keys: Path | None = Field(None, description="a directory of the public keys (*.key) of the hosts "
                                         "whose workers and gateways may connect to this host's sockets; this "
                                         "host's own key is always accepted; read again when an unknown key knocks")


class Tls(BaseModel):
    """TLS for clients (vLLM's --ssl-certfile/--ssl-keyfile): HTTPS and WSS on http_port, gRPC over TLS
    on grpc_port; unset: plaintext on both."""

    certfile: Path | None = Field(None, description="PEM certificate (chain) the gateway presents")
    keyfile: Path | None = Field(None, description="PEM private key of certfile")

    @model_validator(mode="after")
    def _both_or_neither(self) -> Tls:
        if (self.certfile is None) != (self.keyfile is None):
            raise ValueError("tls.certfile and tls.keyfile go together: set both (TLS) or neither (plaintext)")
        return self

    @property
    def enabled(self) -> bool:
        return self.certfile is not None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="TILLER_",
        env_nested_delimiter="__",
        extra="ignore",
    )

    run_dir: Path = Field(Path("run"), description="sockets, pid files, logs, SQLite")
    cache_dir: Path = Field(
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tiller",
        description="converted model weights, one directory per model per machine (`tiller cache`)",
        json_schema_extra={"doc_default": "$XDG_CACHE_HOME/tiller, else ~/.cache/tiller"},
    )
    model: str = Field(
        DEFAULT_MODEL,
        description="'smollm2' (embedded), a local Hugging Face model directory, or 'random:<config dir or name>'",
    )
    served_model_name: str = Field("SmolLM2-135M-Instruct", description="the model name clients see and send "
                                   "(OpenAI `model`, Salience OpenSession, /v1/models)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the worker runs the model: 'auto' CUDA "
                                                  "when a GPU is present, else the CPU")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="activations and KV: 'auto' bfloat16 on a GPU, float32 on the CPU")
    seed: int = Field(0, description="the seed of a random: model's weights")
    weights: Literal["auto", "fp32", "gguf", "gguf-bf16", "int8"] = Field(
        "auto", description="how the worker holds the projections: 'fp32' dense at `dtype` (what the model "
        "loads as); 'gguf' the GGUF's own 4/8-bit blocks exactly, on Tiller's CPU kernel (float32 activations; "
        "torch's packed kernel where it cannot be built) (the default model); 'gguf-bf16' the blocks on "
        "torch's packed kernel with their scales rounded to bfloat16; 'int8' weights rounded to int8 per "
        "output row (CPU, any model); 'auto' picks 'gguf' on the CPU when the model ships as a GGUF and "
        "Tiller's kernel builds, 'gguf-bf16' when it does not, else 'fp32' (see docs/models.md, 'Weights')",
    )
    gpu_kernels: Literal["torch", "triton"] = Field(
        "torch", description="the ops around the native forward's matmuls on a GPU: 'torch' torch's ops (attention "
        "over a gather of the KV blocks, rounding as transformers does); 'triton' Tiller's Triton kernels (norms, "
        "rotation with the KV write, paged attention reading the blocks in place, activation: five kernels a layer "
        "where torch's ops take some fifteen), checked so far in Triton's interpreter only (see docs/models.md, "
        "'On a GPU')",
    )
    worker_threads: int | None = Field(
        None, ge=1, description="CPU threads of the worker's matmuls (OpenMP); unset: the environment's "
        "OMP_NUM_THREADS if set, else the cores this process may use minus worker_reserved_cores (at least 1)",
    )
    worker_reserved_cores: float = Field(
        0.0, ge=0, description="cores left to the other four processes when worker_threads is unset (they idle "
        "between requests: see docs/models.md, 'CPU threads')",
    )
    worker_wait_policy: Literal["PASSIVE", "ACTIVE", ""] = Field(
        "", description="OMP_WAIT_POLICY of the worker's threads: '' OpenMP's default (spin a few ms, then "
        "sleep; fast alone, and worker_threads_interval_s yields cores to other load), PASSIVE sleeps at once "
        "(every kernel then pays a wake-up), ACTIVE spins (see docs/models.md, 'CPU threads')",
    )
    worker_spin_count: int | None = Field(
        None, ge=0, description="rounds a waiting worker thread spins before it sleeps (GOMP_SPINCOUNT; tens "
        "of ns each); unset: what worker_wait_policy implies",
    )
    worker_threads_interval_s: float = Field(
        0.25, ge=0, description="how often (s) the worker compares the CPU other processes take on its cores "
        "with its threads, and runs fewer threads while they would take a core from it; 0: never",
    )

    http_host: str = Field("127.0.0.1", description="the address the gateway's HTTP and gRPC servers bind")
    http_port: int = Field(8080, description="HTTP: WebSocket, REST, OpenAI API, AICI REST, /health, /metrics")
    grpc_port: int = Field(50051, description="gRPC: Evergreen and Salience")
    shutdown_grace_s: float = Field(2.0, ge=0, description="on SIGTERM the gateway lets its HTTP streams run this "
                                    "long, then ends them (then its gRPC streams get as long): well within "
                                    "supervisord's 10 s before SIGKILL")

    # ZeroMQ endpoints; empty means an ipc:// socket in run_dir.
    scheduler_endpoint: str = Field("", description="the scheduler's frontend for gateways (ZeroMQ endpoint; '': "
                                    "ipc:// in run_dir)")
    worker_endpoint: str = Field("", description="the scheduler's socket workers connect to (tcp://HOST:PORT for "
                                 "workers on other hosts; '': ipc:// in run_dir)")
    controller_main_endpoint: str = Field("", description="the controller runtime's main channel, used by the "
                                          "scheduler ('': ipc:// in run_dir)")
    controller_side_endpoint: str = Field("", description="the controller runtime's side channel, used by gateways "
                                          "('': ipc:// in run_dir)")
    session_store_endpoint: str = Field("", description="the session store ('': ipc:// in run_dir)")

    limits: Limits = Field(default_factory=Limits)
    evergreen: Evergreen = Field(default_factory=Evergreen)
    images: Images = Field(default_factory=Images)
    sessions: Sessions = Field(default_factory=Sessions)
    embeddings: Embeddings = Field(default_factory=Embeddings)
    controllers: Controllers = Field(default_factory=Controllers)
    api_auth: ApiAuth = Field(default_factory=ApiAuth)
    tenants: Tenants = Field(default_factory=Tenants)
    steering: Steering = Field(default_factory=Steering)
    distributed: Distributed = Field(default_factory=Distributed)
    curve: Curve = Field(default_factory=Curve)
    tls: Tls = Field(default_factory=Tls)
    log_level: str = Field("info", description="every service's log level (structlog JSON lines in run_dir/logs)")
    gc_young_threshold: int = Field(
        50_000, ge=1, description="allocations (less deallocations) of tracked objects between two collections of "
        "the cyclic garbage collector's youngest generation in the scheduler (Python's default is 700: a "
        "scheduler stepping hundreds of sequences then spends a third of its time collecting; at 10,000 one "
        "with thousands of live requests still collected every few steps, walking their prompts each time; the "
        "objects alive after start-up are frozen out of its reach anyway; see docs/benchmarks.md, 'The collector, "
        "again')",
    )
    ready_timeout_s: float = Field(600.0, description="how long `tiller up` waits for every service")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = os.environ.get("TILLER_CONFIG")
        if config_file:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(config_file)))
        return tuple(sources)

    def endpoint(self, name: Literal["scheduler", "worker", "controller_main", "controller_side", "session_store"]) -> str:
        """The configured endpoint for a socket, or its ipc:// default in the run directory."""
        configured: str = getattr(self, f"{name}_endpoint")
        if configured:
            return configured
        return f"ipc://{self.run_dir.resolve()}/{name}.sock"

    @property
    def db_path(self) -> Path:
        return self.run_dir / "tiller.sqlite3"

    @property
    def controller_module_dir(self) -> Path:
        """Uploaded Wasm modules, their compiled artifacts and tags."""
        return (self.controllers.module_dir or self.run_dir / "controllers").resolve()

    @property
    def evergreen_ref_root(self) -> Path:
        """The only directory Evergreen ``file://`` refs may point into."""
        return (self.evergreen.ref_root or self.run_dir / "evergreen_files").resolve()


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
