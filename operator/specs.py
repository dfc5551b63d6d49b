"""The specs of kvpilot's custom resources as typed, frozen values: each is parsed once, where a handler first
holds the object (fleets.reconcile, resets.drive, weights.Run, the expiry), and the code after reads fields.

The defaults are the CRD schemas' (crds/*.yaml, openAPIV3Schema `default`): the API server fills them in on
every object it serves, and the same figures stand here for a spec built by hand (a test, a catch-up, the
CLI's help). The image and the wheel do not ship crds/, so they are written out here and
tests/operator/test_operator_specs.py proves them equal to the CRDs', field by field, both ways. A field the
CRD gives no default is None here when absent.

Fields the operator only copies into a pod (env, volumes, tolerations, ...) stay as the JSON they are: the
Kubernetes schema is theirs, and the CRD keeps their unknown fields.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class _Spec(BaseModel):
    # camelCase on the wire as in the CRD; fields the CRD does not know never reach us (the API server prunes
    # them), so an extra one is a newer CRD's and is ignored.
    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True, extra="ignore")

    @classmethod
    def parse(cls, spec: Any) -> Self:
        """The spec of an object as the API server serves it (a dict, or kopf's view of one)."""
        return cls.model_validate(dict(spec or {}))

    @classmethod
    def default(cls, field: str) -> Any:
        """The CRD's default of `field` (a snake_case name), for the CLI's help."""
        return cls.model_fields[field].get_default(call_default_factory=True)


class TargetRef(_Spec):
    name: str


class SecretKeyRef(_Spec):
    name: str
    key: str = "token"


# ---- InferenceDeployment ---------------------------------------------------------------------------------
class LoRAModule(_Spec):
    name: str
    path: str


class LoRASpec(_Spec):
    modules: list[LoRAModule] | None = None
    max_loras: int | None = None
    max_lora_rank: int | None = None


class EngineSpec(_Spec):
    block_size: int = 16
    max_num_seqs: int | None = None
    data_parallel_size: int | None = None
    tensor_parallel_size: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    lora: LoRASpec | None = None  # present: --enable-lora
    kv_cache_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    kv_offloading_size: float | None = None  # GiB
    kv_offloading_dir: str | None = None
    kv_offloading_dir_size: float | None = None  # GiB


class EndpointPickerSpec(_Spec):
    enabled: bool = False
    port: int = 9002  # the port GAIE's InferencePool takes for a picker when it names none


class RouterSpec(_Spec):
    enabled: bool = False
    replicas: int = 1
    policy: Literal["prefix-aware", "round-robin", "least-load"] = "prefix-aware"
    resources: dict[str, Any] | None = None
    endpoint_picker: EndpointPickerSpec = Field(default_factory=EndpointPickerSpec)


class NetworkPolicySpec(_Spec):
    enabled: bool = True
    allow_from_namespaces: list[str] | None = None


class RoleSpec(_Spec):
    replicas: int = 1


class DisaggregationSpec(_Spec):
    """Prefill/decode disaggregation (docs/disaggregation.md): a set of prefill pods and a set of decode pods
    in place of `replicas` colocated ones (the CRD requires both roles)."""

    prefill: RoleSpec
    decode: RoleSpec


class FleetSpec(_Spec):
    """InferenceDeployment spec (crds/inferencedeployments.yaml)."""

    model: str | None = None
    served_model_name: str | None = None
    replicas: int = 1
    placement: Literal["Deployment", "DaemonSet"] = "Deployment"
    image: str = "ghcr.io/kvpilot/kvpilot:latest"
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    port: int = 8000
    resources: dict[str, Any] | None = None
    env: list[dict[str, Any]] | None = None
    node_selector: dict[str, str] | None = None
    tolerations: list[dict[str, Any]] | None = None
    affinity: dict[str, Any] | None = None
    service_account_name: str | None = None
    priority_class_name: str | None = None
    image_pull_secrets: list[dict[str, Any]] | None = None
    volumes: list[dict[str, Any]] | None = None
    volume_mounts: list[dict[str, Any]] | None = None
    security_context: dict[str, Any] | None = None
    pod_security_context: dict[str, Any] | None = None
    startup_probe: dict[str, Any] | None = None
    engine: EngineSpec = Field(default_factory=EngineSpec)
    router: RouterSpec | None = None
    disaggregation: DisaggregationSpec | None = None
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    disable_admin_token: bool = False
    admin_token_secret_ref: SecretKeyRef | None = None


# ---- PrefixCacheReset ------------------------------------------------------------------------------------
class ScopeSpec(_Spec):
    """The part of each pod's cache a scoped reset clears (the CRD requires one field at least)."""

    lora_name: str | None = None
    cache_salt: str | None = None
    weight_version: str | None = None


class TargetedSpec(_Spec):
    """What a run over a fleet's pods aims at, as PrefixCacheReset and PrefixCacheWarmup spell it (their CRDs
    carry the same fields): exactly one of target_ref and selector (CEL), the engine the pods run, their
    port, and, for a selector, the Secret whose token goes to them. fleets.targets.resolve reads it."""

    target_ref: TargetRef | None = None
    selector: dict[str, Any] | None = None  # a label selector, as builders.label_selector reads it
    engine: Literal["kvpilot", "vllm", "sglang"] = "kvpilot"
    port: int | None = None
    timeout_seconds: int = 60
    wait_for_target: bool = False
    allow_no_targets: bool = False
    admin_token_secret_ref: SecretKeyRef | None = None


class ResetSpec(TargetedSpec):
    """PrefixCacheReset spec (crds/prefixcachereset.yaml): exactly one of target_ref and selector."""

    reset_running_requests: bool = False
    reset_external: bool = True
    scope: ScopeSpec | None = None
    verify: bool = True
    request_timeout_seconds: int | None = None
    max_concurrency: int = 64
    retries_per_pod: int = 3
    min_success_ratio: float = 1.0
    ttl_seconds_after_finished: int | None = None


# ---- PrefixCacheWarmup -----------------------------------------------------------------------------------
class ChatMessage(_Spec):
    role: Literal["system", "user", "assistant"]
    content: str


class WarmupPrompt(_Spec):
    """One prompt of a warm-up: a chat (`messages`, sent to /v1/chat/completions) or a plain `prompt` (sent to
    /v1/completions); exactly one of them (CEL, and warmups.prompts for a ConfigMap's)."""

    messages: list[ChatMessage] | None = None
    prompt: str | None = None


class ConfigMapKeyRef(_Spec):
    name: str
    key: str


class PromptsFrom(_Spec):
    config_map_key_ref: ConfigMapKeyRef


class WarmupSpec(TargetedSpec):
    """PrefixCacheWarmup spec (crds/prefixcachewarmup.yaml): the target as a reset's, exactly one of prompts
    and prompts_from."""

    mode: Literal["Once", "Continuous"] = "Once"
    gate_readiness: bool = False  # Continuous, targetRef: a pod Ready only once warm (continuous.py)
    prompts: list[WarmupPrompt] | None = None
    prompts_from: PromptsFrom | None = None
    pin: bool = False
    timeout_seconds: int = 300  # every prompt prefilled twice on every pod and rank: longer than a reset
    max_concurrency: int = 16
    ttl_seconds_after_finished: int | None = None


# ---- WeightUpdate ----------------------------------------------------------------------------------------
# Pods a Rolling update takes at a time without maxUnavailable: not a schema default, since the CRD refuses
# maxUnavailable on an Atomic update.
ROLLING_MAX_UNAVAILABLE = 1


class AdapterRef(_Spec):
    name: str
    path: str


class WeightUpdateSpec(_Spec):
    """WeightUpdate spec (crds/weightupdates.yaml): exactly one of model_path and adapter."""

    target_ref: TargetRef
    model_path: str | None = None
    adapter: AdapterRef | None = None
    version: str
    strategy: Literal["Atomic", "Rolling"] = "Atomic"
    pause_mode: Literal["abort", "wait", "keep"] = "wait"
    timeout_seconds: int = 600
    max_concurrency: int = 16
    max_unavailable: int | None = None
    ttl_seconds_after_finished: int | None = None
