"""The router's settings. Each field with `flag(...)` metadata is a `kvpilot router` flag
(kvpilot/cli/flags.py); its default here is the flag's. Light on purpose: `kvpilot --help` imports it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.cli.flags import flag
from kvpilot.engines import ENGINE_NAMES, ENGINES
from kvpilot.serving.http_limits import ConnectionLimits

POLICIES = ("prefix-aware", "round-robin", "least-load")  # policy.py, where make_policy builds them
VLLM_HASH_ALGOS = ("sha256", "sha256_cbor")  # vLLM's cryptographic --prefix-caching-hash-algo names
# The engines whose pods speak vLLM's kv_transfer_params (docs/disaggregation.md); SGLang's P/D has its own.
PD_ENGINES = ("kvpilot", "vllm")


@dataclass(slots=True)
class RouterSettings:
    host: str = field(default="0.0.0.0", metadata=flag("address to listen on"))
    port: int = field(default=8080, metadata=flag("port to listen on"))
    engine: str = field(default="kvpilot", metadata=flag("the engine the pods run", choices=ENGINE_NAMES))
    # None (the flag not given) becomes the engine's default when the settings are made: prefix-aware
    # where the pods publish verifiable KV events, least-load elsewhere. An explicit prefix-aware for
    # other engines is kept, so validate() refuses it rather than routing blind.
    policy: str | None = field(
        default=None,
        metadata=flag(
            "how a pod is chosen",
            choices=POLICIES,
            unset="prefix-aware with --engine kvpilot, else least-load",
        ),
    )
    kv_events_block_size: int = field(
        default=16,
        metadata=flag(
            "the vLLM pods' --block-size (vLLM names it nowhere the router can read; 128 on the CPU)"
        ),
    )
    kv_events_hash_algo: str = field(
        default="sha256",
        metadata=flag("the vLLM pods' --prefix-caching-hash-algo", choices=VLLM_HASH_ALGOS),
    )
    kv_events_hash_seed: str | None = field(
        default=None,
        metadata=flag(
            "the vLLM pods' PYTHONHASHSEED, the seed of their block keys",
            unset="this router's PYTHONHASHSEED, else vLLM's default",
        ),
    )
    kv_event_source: list[str] | None = field(
        default=None,
        metadata=flag(
            "vLLM pods' KV event publishers, as URL=ENDPOINT (the pod's URL as --endpoints names it, its "
            "tcp://HOST:PORT), for pods whose GET /kv_event_sources the router cannot use (a publisher "
            "behind another address); such a pod is not asked",
            metavar="URL=ENDPOINT",
            unset="each vLLM pod's GET /kv_event_sources",
        ),
    )
    admin_token: str | None = None  # from --admin-token-file or $KVPILOT_ADMIN_TOKEN (admin_token.py)
    reset_timeout_s: float = field(
        default=60.0,
        metadata=flag(
            "seconds a fleet reset may take before unfinished pods count as failed", name="--reset-timeout"
        ),
    )
    kv_events_curve_dir: str | None = field(
        default=None,
        metadata=flag(
            "connect to the pods' KV event sockets with ZeroMQ CURVE: DIR holds this router's key pair "
            "(client.key_secret) and the pods' public key (server.key), in pyzmq's zmq.auth key-file format",
            metavar="DIR",
            unset="off (pods publishing with CURVE let this router in only with their keys)",
        ),
    )
    # After a pod's reset, how long catching up with its events (up to its AllBlocksCleared) may take
    # before the router empties that pod's entries itself (and ignores its events until the clear
    # arrives); within --reset-timeout in all.
    clear_wait_s: float = 5.0
    max_body_bytes: int = 4 << 20
    shutdown_timeout_s: float = field(
        # under Kubernetes' default terminationGracePeriodSeconds (30 s), so a rollout's SIGKILL never comes first
        default=25.0,
        metadata=flag(
            "seconds the requests and streams in flight get to finish after SIGTERM (no new ones are taken)",
            name="--shutdown-timeout",
        ),
    )
    proxy_timeout_s: float = field(
        default=600.0,
        metadata=flag(
            "seconds a pod may send nothing on a proxied request (before its reply, or between two chunks "
            "of a stream) before the router answers 504 or ends the stream with an error event",
            name="--proxy-timeout",
        ),
    )
    prefill_timeout_s: float = field(
        default=60.0,
        metadata=flag(
            "with --prefill and --decode (or a disaggregated --fleet): seconds a prefill pod's reply may take, "
            "connect to last byte; a slower prefill is given up and the decode pod computes the prompt itself",
            name="--prefill-timeout",
        ),
    )
    # --prefill and --decode given (cli.py): validate() refuses what P/D cannot run with. Whether a request is
    # prefilled on one pod and decoded on another follows the pods' roles (Fleet.disaggregated), which a
    # --fleet router learns from its InferenceDeployment.
    disaggregated: bool = False
    max_reply_bytes: int = field(
        default=64 << 20,
        metadata=flag("bytes of a pod's non-streamed reply the router passes on; a longer one is a 502"),
    )
    endpoint_picker_port: int | None = field(
        default=None,
        metadata=flag(
            "also serve Envoy's external processing gRPC service (ext_proc) on this port, as the Gateway API "
            "Inference Extension's endpoint picker: the gateway asks it which pod takes each request",
            metavar="PORT",
            unset="off",
        ),
    )
    endpoint_picker_timeout_s: float = field(
        default=30.0,
        metadata=flag(
            "seconds from a request's headers to its last body byte on the endpoint picker's stream; a "
            "slower request is answered 408 by the gateway",
            name="--endpoint-picker-timeout",
        ),
    )
    endpoint_picker_fallbacks: int = field(
        default=0,
        metadata=flag(
            "other pods the endpoint picker names after its pick (x-gateway-destination-endpoint "
            "IP:PORT,IP:PORT,...), least loaded first, for gateways that retry down the list"
        ),
    )
    endpoint_picker_max_streams: int = field(
        default=1024,
        metadata=flag(
            "endpoint picker streams open at once over all gateway connections (requests being picked or "
            "in flight); more are refused RESOURCE_EXHAUSTED"
        ),
    )
    endpoint_picker_buffer_bytes: int = field(
        default=64 << 20,
        metadata=flag(
            "request body bytes the endpoint picker holds over all its streams; a body that would pass it "
            "is answered 503 (picker_busy) by the gateway"
        ),
    )
    endpoint_picker_hold_s: float = field(
        default=600.0,
        metadata=flag(
            "seconds a picked request counts as in flight on its pod while the gateway keeps its stream "
            "open; then the picker closes the stream",
            name="--endpoint-picker-hold",
        ),
    )
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)  # flags of their own (http_limits)

    def __post_init__(self) -> None:
        if self.policy is None:
            known = ENGINES.get(self.engine)  # an unknown engine is validate()'s to refuse
            self.policy = "prefix-aware" if known is not None and known.prefix_aware_default else "least-load"

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be between 0 and 65535")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}")
        traits = ENGINES[self.engine]
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        if self.policy == "prefix-aware" and traits.kv_events_path is None:
            followed = " or ".join(e.name for e in ENGINES.values() if e.kv_events_path is not None)
            raise ValueError(
                f"--policy prefix-aware needs pods whose KV events the router can follow (--engine {followed}); "
                f"{self.engine} pods publish none it can: use --policy least-load or round-robin"
            )
        if not 1 <= self.kv_events_block_size <= 1 << 16:
            raise ValueError("kv_events_block_size must be between 1 and 65536")
        if self.kv_events_hash_algo not in VLLM_HASH_ALGOS:
            raise ValueError(f"kv_events_hash_algo must be one of {', '.join(VLLM_HASH_ALGOS)}")
        if self.kv_events_hash_seed is not None:
            from kvpilot.kv.block_keys import KeyScheme

            KeyScheme(self.kv_events_hash_algo, self.kv_events_hash_seed)  # its length and text checked
        if self.kv_event_source:
            if self.engine != "vllm":
                raise ValueError(
                    "--kv-event-source is for --engine vllm: a kvpilot daemon names its publishers (and "
                    "its block size and keys) at GET /kv_events"
                )
            from kvpilot.router.fleet.pods import parse_static_sources

            parse_static_sources(self.kv_event_source)
        if self.kv_events_curve_dir:
            from kvpilot.kv.sockets import load_client_keys

            load_client_keys(self.kv_events_curve_dir)  # a missing or unreadable key is a startup error
        if self.shutdown_timeout_s < 0:
            raise ValueError("shutdown_timeout_s must not be negative")
        if self.reset_timeout_s <= 0 or self.clear_wait_s < 0 or self.max_body_bytes < 1:
            raise ValueError("reset_timeout_s and max_body_bytes must be positive, clear_wait_s not negative")
        if self.endpoint_picker_port is not None and not 0 <= self.endpoint_picker_port <= 65535:
            raise ValueError("endpoint_picker_port must be between 0 and 65535")
        if self.endpoint_picker_timeout_s <= 0 or self.endpoint_picker_fallbacks < 0:
            raise ValueError(
                "endpoint_picker_timeout_s must be positive, endpoint_picker_fallbacks not negative"
            )
        if (
            self.endpoint_picker_max_streams < 1
            or self.endpoint_picker_buffer_bytes < 1
            or self.endpoint_picker_hold_s <= 0
        ):
            raise ValueError(
                "endpoint_picker_max_streams, endpoint_picker_buffer_bytes and endpoint_picker_hold_s must "
                "be positive"
            )
        if self.proxy_timeout_s <= 0 or self.max_reply_bytes < 1 or self.prefill_timeout_s <= 0:
            raise ValueError("proxy_timeout_s, prefill_timeout_s and max_reply_bytes must be positive")
        if self.disaggregated:
            if self.engine not in PD_ENGINES:
                raise ValueError(
                    f"--prefill and --decode hand vLLM's kv_transfer_params from one pod to the other: pods "
                    f"of --engine {' or '.join(PD_ENGINES)}; {self.engine} pods disaggregate another way"
                )
            if self.endpoint_picker_port is not None:
                raise ValueError(
                    "endpoint_picker_port picks one pod per request; with --prefill and --decode the router "
                    "sends each request to two: leave one of them out"
                )
        self.limits.validate()
