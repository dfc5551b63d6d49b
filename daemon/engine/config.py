"""Engine settings. Each field with `flag(...)` metadata is a `kvpilot serve` flag (kvpilot/cli/flags.py),
named as vLLM names it; its default here is the flag's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpilot.cli.flags import flag
from kvpilot.kv.block_keys import DEFAULT_HASH_ALGO, HASH_ALGOS

if TYPE_CHECKING:  # torch loads in the methods: `kvpilot --help` builds its flags from this class
    import torch

    from kvpilot.daemon.engine.compile.config import CompilationConfig
    from kvpilot.daemon.kv_transfer.config import KVTransferConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
EVICTION_POLICIES = ("lru", "lfu")  # --prefix-cache-eviction-policy (kv/block_pool.py)
ZMQ_ADDRESS = {"metavar": "tcp://HOST:PORT", "unset": "off"}  # the KV events sockets (kv/publisher.py)


@dataclass(slots=True)
class EngineConfig:
    model: str | None = field(
        default=None,
        metadata=flag("Hugging Face checkpoint directory", unset="the embedded SmolLM2-135M-Instruct"),
    )
    dtype: str = field(
        default="auto",
        metadata=flag("weights and KV dtype (auto: float32 on CPU, bfloat16 on GPU)", choices=DTYPES),
    )
    device: str = field(default="auto", metadata=flag("torch device (auto: cuda if available, else cpu)"))
    block_size: int = field(default=16, metadata=flag("tokens per KV cache block"))
    num_kv_blocks: int | None = field(
        default=None,
        metadata=flag(
            "number of KV cache blocks", name="--num-gpu-blocks-override", unset="derived from memory"
        ),
    )
    kv_cache_memory_bytes: int = field(default=1 << 30, metadata=flag("KV cache budget on the CPU in bytes"))
    gpu_memory_utilization: float = 0.85  # share of free GPU memory the KV cache may take
    max_num_seqs: int = field(default=64, metadata=flag("most requests in one batch"))
    max_num_batched_tokens: int = field(
        default=2048, metadata=flag("token budget of one step, prefill chunks included")
    )
    max_model_len: int | None = field(default=None, metadata=flag("context length", unset="the model's"))
    enable_prefix_caching: bool = field(default=True, metadata=flag("reuse the KV of shared prompt prefixes"))
    prefix_caching_hash_algo: str = field(
        default=DEFAULT_HASH_ALGO,
        metadata=flag(
            "how block keys are hashed: sha256_cbor and sha256 as vLLM 0.32 hashes them (seeded by "
            "PYTHONHASHSEED, as vLLM is), kvpilot for kvpilot's earlier keys (docs/router.md)",
            choices=HASH_ALGOS,
        ),
    )
    max_queued_requests: int | None = field(
        default=1024,
        metadata=flag("requests waiting for the engine beyond which new ones get 503 with Retry-After"),
    )
    cpu_threads: int | None = field(
        default=None,
        metadata=flag(
            "torch threads on the CPU",
            unset="the CPUs this process may use, from its affinity and cgroup CPU quota, but one, "
            "which serves HTTP",
        ),
    )
    kernel_backend: str | None = None  # None: triton on CUDA, torch elsewhere ($KVPILOT_KERNELS)
    compilation_config: str | None = field(
        default=None,
        metadata=flag(
            "how the step runs, as vLLM takes it: a level (-O0 eager; -O1 torch.compile; -O2, -O3 also CUDA "
            'graphs on CUDA) or JSON {"level": 2, "cudagraph_capture_sizes": [1, 2, 4, 8], '
            '"max_cudagraph_capture_size": 64, "cache_dir": DIR} (docs/engine.md)',
            aliases=["-O"],
            metavar="LEVEL|JSON",
            unset="2 on CUDA, 0 on the CPU (docs/performance.md says why)",
        ),
    )
    enforce_eager: bool = field(
        default=False, metadata=flag("run every step eagerly: no torch.compile, no CUDA graphs (-O0)")
    )
    packed_linears: bool | None = field(
        default=None,
        metadata=flag(
            "eager on the CPU: the linear weights laid out for a faster kernel than F.linear. Where the "
            "project's AVX2 panels run (one torch thread, float32) they replace the weights, at no memory "
            "cost; --packed-linears also takes oneDNN's where they do not, a second copy of each weight used at "
            "the batch sizes it was timed faster at when the engine started; --no-packed-linears: F.linear",
            unset="the panels where they run",
        ),
    )
    kv_events_endpoint: str | None = field(
        default=None, metadata=flag("publish KV cache events (vLLM's format, ZeroMQ PUB) here", **ZMQ_ADDRESS)
    )
    kv_events_replay_endpoint: str | None = field(
        default=None,
        metadata=flag(
            "serve missed KV events again here (ZeroMQ ROUTER); needs --kv-events-endpoint", **ZMQ_ADDRESS
        ),
    )
    kv_events_token_ids: bool = field(
        default=False,
        metadata=flag(
            "put each stored block's token ids in the KV events (they are the prompts' text: only for "
            "consumers that need them; kvpilot's router does not)"
        ),
    )
    kv_events_curve_dir: str | None = field(
        default=None,
        metadata=flag(
            "encrypt and authenticate the KV event sockets with ZeroMQ CURVE: DIR holds this daemon's key "
            "pair (server.key_secret) and the public keys of the clients it lets in (NAME.key), in "
            "pyzmq's zmq.auth key-file format",
            metavar="DIR",
            unset="off: any peer that reaches the ports reads the events",
        ),
    )
    kv_offloading_size: float | None = field(
        default=None,
        metadata=flag(
            "host memory in GiB that keeps KV blocks evicted from the KV cache, so a prefix found there is "
            "copied back instead of computed again (split among data-parallel ranks)",
            metavar="GiB",
            unset="off",
        ),
    )
    kv_offloading_dir: str | None = field(
        default=None,
        metadata=flag(
            "directory that keeps KV blocks evicted from host memory (or from the KV cache, without "
            "--kv-offloading-size); kept across restarts of the same checkpoint, emptied by every reset",
            metavar="DIR",
            unset="off",
        ),
    )
    kv_offloading_dir_size: float = field(
        default=16.0, metadata=flag("most GiB the --kv-offloading-dir tier may take", metavar="GiB")
    )
    enable_pinned_prefix: bool = field(
        default=False,
        metadata=flag(
            "let a request pin its prompt's full blocks (pin_prefix: true): pinned blocks are never "
            "evicted until POST /unpin_all_pinned_prefixes or a reset"
        ),
    )
    pinned_prefix_cap_ratio: float = field(
        default=0.2,
        metadata=flag(
            "share of the KV blocks that may be pinned; a pin past it is refused (the request is served, "
            "its reply says so)",
            metavar="RATIO",
        ),
    )
    prefix_cache_eviction_policy: str = field(
        default="lru",
        metadata=flag(
            "which cached block a new one evicts: lru (least recently used) or lfu (least often hit, "
            "least recently used among equals)",
            choices=list(EVICTION_POLICIES),
        ),
    )
    data_parallel_size: int = field(
        default=1,
        metadata=flag(
            "engine-core processes behind this server, each with its own KV cache and scheduler, its "
            "share of the CPUs or its own GPU (1: the engine runs in the server's process)",
            aliases=["-dp"],
        ),
    )
    engine_process: bool = field(
        default=False,
        metadata=flag(
            "run the engine in a process of its own, as vLLM's V1 engine core runs, not in a thread of the "
            "server's: the two no longer take turns on one interpreter lock (docs/engine.md has the figures); "
            "data parallel ranks always do",
        ),
    )
    weight_version: str | None = field(
        default=None,
        metadata=flag(
            "the loaded weights' version (system_fingerprint, /weight_info; part of every block key)",
            unset="initial, not in the keys",
        ),
    )
    weight_transfer_config: str | None = field(
        default=None,
        metadata=flag(
            'how weight updates arrive, as vLLM\'s JSON: {"backend": "checkpoint"} (a Hugging Face '
            'checkpoint directory per update), {"backend": "gloo"} (a trainer\'s torch.distributed group) '
            'or {"backend": "nccl"} (the same on CUDA tensors)',
            unset='{"backend": "checkpoint"}',
        ),
    )
    weight_staging_memory_bytes: int | None = field(
        default=None,
        metadata=flag(
            "host memory one rank's staging copy of a weight update may take, in bytes (the parameters "
            "an update touches, copied whole); beyond it /update_weights answers 507 and nothing changes",
            unset="what the host and its cgroup have free",
        ),
    )
    enable_lora: bool = field(
        default=False, metadata=flag("serve LoRA adapters (peft directories) on the base model")
    )
    lora_modules: list[str] = field(
        default_factory=list,
        metadata=flag(
            'adapters to serve, as vLLM takes them: name=path, or JSON {"name": ..., "path": ...}; a '
            "request names one as its model; needs --enable-lora",
            metavar="NAME=PATH",
            unset="none",
        ),
    )
    max_loras: int = field(default=4, metadata=flag("most distinct adapters in one step"))
    max_lora_rank: int = field(default=16, metadata=flag("highest LoRA rank an adapter may have"))
    max_cpu_loras: int | None = field(
        default=None,
        metadata=flag(
            "most adapters whose weights are kept in memory; the others are read again from their "
            "directory when a request names one (least recently used out first)",
            unset="all of them",
        ),
    )
    kv_transfer_config: str | None = field(
        default=None,
        metadata=flag(
            'prefill/decode disaggregation, as vLLM\'s JSON: {"kv_connector": "KvpilotConnector", "kv_role": '
            '"kv_producer" | "kv_consumer" | "kv_both", "kv_connector_extra_config": {"port": 14579, ...}} '
            "(docs/disaggregation.md)",
            unset="off: every request is prefilled and decoded here",
        ),
    )
    data_parallel_rank: int = 0  # which rank this engine is (set per rank process by dp_engine.py)
    tensor_parallel_size: int = field(
        default=1,
        metadata=flag(
            "processes the model is sharded over by attention head (gloo on the CPU, NCCL on "
            "CUDA; it must divide the model's head counts)",
            aliases=["-tp"],
        ),
    )

    def validate(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError("block_size must be a power of two between 1 and 128")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError("max_queued_requests must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be positive")
        if self.max_model_len is not None and self.max_model_len < 1:  # else every request is refused
            raise ValueError("max_model_len must be positive")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("a KV events replay endpoint needs a KV events endpoint")
        if self.kv_events_curve_dir:
            from kvpilot.kv.sockets import load_server_keys

            load_server_keys(self.kv_events_curve_dir)  # a missing or unreadable key is a startup error
        if self.dtype not in DTYPES:
            raise ValueError("dtype must be auto, float32, bfloat16 or float16")
        if self.data_parallel_size < 1 or self.tensor_parallel_size < 1:
            raise ValueError("data_parallel_size and tensor_parallel_size must be at least 1")
        if self.data_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ValueError("data_parallel_size and tensor_parallel_size cannot be combined yet")
        if self.engine_process and self.tensor_parallel_size > 1:
            raise ValueError("engine_process and tensor_parallel_size > 1 cannot be combined yet")
        if self.kv_offloading_size is not None and not self.kv_offloading_size > 0:
            raise ValueError("kv_offloading_size must be a positive number of GiB")
        if not self.kv_offloading_dir_size > 0:
            raise ValueError("kv_offloading_dir_size must be a positive number of GiB")
        if self.offloads_kv:
            if not self.enable_prefix_caching:
                raise ValueError("KV offloading keeps prefix-cache blocks: it needs --enable-prefix-caching")
            if self.tensor_parallel_size > 1:
                raise ValueError("KV offloading and tensor_parallel_size > 1 cannot be combined yet")
        if self.weight_version is not None:
            from kvpilot.daemon.engine.weights.ops import RESERVED_VERSIONS

            if not self.weight_version or self.weight_version in RESERVED_VERSIONS:
                raise ValueError(
                    f"weight_version {self.weight_version!r} is reserved (the daemon reports 'initial' for "
                    "weights loaded unnamed, 'mixed' for ranks that differ): name the weights otherwise"
                )
        if not 0.0 < self.pinned_prefix_cap_ratio < 1.0:
            raise ValueError("pinned_prefix_cap_ratio must be in (0, 1): requests need unpinned blocks")
        if self.prefix_cache_eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"prefix_cache_eviction_policy must be one of {', '.join(EVICTION_POLICIES)}")
        if self.enable_pinned_prefix and not self.enable_prefix_caching:
            raise ValueError(
                "enable_pinned_prefix pins prefix-cache blocks: it needs --enable-prefix-caching"
            )
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        if self.enable_lora:
            from kvpilot.daemon.engine.weights.lora import parse_lora_modules

            parse_lora_modules(self.lora_modules)
            if self.max_loras < 1 or self.max_lora_rank < 1:
                raise ValueError("max_loras and max_lora_rank must be positive")
            if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
                raise ValueError("max_cpu_loras must be at least max_loras: a step's adapters are all held")
            if self.tensor_parallel_size > 1:
                raise ValueError("LoRA adapters and tensor_parallel_size > 1 cannot be combined yet")
        if self.weight_staging_memory_bytes is not None and self.weight_staging_memory_bytes < 1:
            raise ValueError("weight_staging_memory_bytes must be positive")
        if self.weight_transfer_config is not None:
            from kvpilot.daemon.engine.weights.stage import transfer_backend

            transfer_backend(self.weight_transfer_config, str(self.torch_device()))
        self.compilation(self.torch_device().type)  # a malformed level or JSON is a startup error
        if (transfer := self.kv_transfer) is not None:
            if self.data_parallel_size > 1 or self.tensor_parallel_size > 1:
                raise ValueError(
                    "kv_transfer_config and data_parallel_size or tensor_parallel_size > 1 cannot be combined yet"
                )
            if self.engine_process:
                raise ValueError("kv_transfer_config and engine_process cannot be combined yet")
            if not self.enable_prefix_caching:
                raise ValueError(
                    f"a {transfer.role} moves blocks by their prefix-cache keys: it needs --enable-prefix-caching"
                )
        if self.data_parallel_size > 1 and self.kv_events_replay_endpoint:
            _check_rank_ports(
                self.kv_events_endpoint, self.kv_events_replay_endpoint, self.data_parallel_size
            )

    def compilation(self, device_type: str) -> CompilationConfig:
        """--compilation-config and --enforce-eager read for this device; ValueError when malformed."""
        from kvpilot.daemon.engine.compile.config import parse_compilation_config

        return parse_compilation_config(
            self.compilation_config,
            self.enforce_eager,
            device_type,
            self.max_num_seqs,
            self.tensor_parallel_size,
        )

    @property
    def kv_transfer(self) -> KVTransferConfig | None:
        """--kv-transfer-config parsed (None: off); ValueError when it is malformed."""
        from kvpilot.daemon.kv_transfer.config import parse_kv_transfer_config

        return parse_kv_transfer_config(self.kv_transfer_config)

    @property
    def pin_ratio(self) -> float | None:
        """The share of blocks pins may hold; None when pinning is off (`--enable-pinned-prefix`)."""
        return self.pinned_prefix_cap_ratio if self.enable_pinned_prefix else None

    @property
    def offloads_kv(self) -> bool:
        return self.kv_offloading_size is not None or self.kv_offloading_dir is not None

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        # one of DTYPES (checked in __post_init__): the name of a torch.dtype
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype


def _check_rank_ports(events: str | None, replay: str, size: int) -> None:
    """Rank r publishes on each configured port + r (kv_events.rank_endpoint): the two ranges must not
    overlap, or two ranks' sockets would fight over one port."""
    ports = [e.rpartition(":")[2] for e in (events or "", replay)]
    if not all(p.isdigit() and int(p) for p in ports):
        return  # any free port (0), or not TCP: nothing to collide
    a, b = sorted(int(p) for p in ports)
    if b < a + size:
        raise ValueError(
            f"with data_parallel_size {size} the KV events use ports {ports[0]}..{int(ports[0]) + size - 1} and "
            f"the replay ports {ports[1]}..{int(ports[1]) + size - 1}: they overlap; move one"
        )
