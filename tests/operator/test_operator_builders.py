"""Pure builders and conditions: manifests as functions of an InferenceDeployment's spec."""

from __future__ import annotations

from kvpilot.operator.fleets import builders, inference_pool, router_objects
from kvpilot.operator.fleets.router import deployment_state
from kvpilot.operator.kube.conditions import fleet_conditions, get_condition, set_condition
from kvpilot.operator.specs import FleetSpec

SPEC = {
    "replicas": 3,
    "placement": "Deployment",
    "image": "img:1",
    "port": 8123,
    "engine": {"blockSize": 16, "maxNumSeqs": 8, "kvCacheBlocks": 256, "enablePrefixCaching": False},
    "adminTokenSecretRef": {"name": "admin", "key": "tok"},
    "nodeSelector": {"gpu": "yes"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
    "resources": {"limits": {"nvidia.com/gpu": 1}},
}


def test_deployment_runs_kvpilot_serve_with_engine_flags_probe_token_and_scrape_annotations() -> None:
    d = builders.workload("llama", FleetSpec.parse(SPEC))
    assert d["kind"] == "Deployment" and d["spec"]["replicas"] == 3
    assert d["spec"]["selector"] == {"matchLabels": {"kvpilot.io/inference-deployment": "llama"}}
    tpl = d["spec"]["template"]
    assert tpl["metadata"]["labels"]["kvpilot.io/inference-deployment"] == "llama"
    # a new pod serves until fenced; the label is not in the selector (a fenced pod stays its ReplicaSet's)
    assert tpl["metadata"]["labels"]["kvpilot.io/serving"] == "true"
    assert tpl["metadata"]["annotations"]["prometheus.io/port"] == "8123"
    c = tpl["spec"]["containers"][0]
    assert c["command"] == ["kvpilot"]
    args = c["args"]
    assert args[:5] == ["serve", "--host", "$(POD_IP)", "--port", "8123"]
    for flag, value in [
        ("--block-size", "16"),
        ("--max-num-seqs", "8"),
        ("--num-gpu-blocks-override", "256"),
    ]:
        assert args[args.index(flag) + 1] == value
    assert "--no-enable-prefix-caching" in args and "--model" not in args
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    tok = next(e for e in c["env"] if e["name"] == "KVPILOT_ADMIN_TOKEN")
    assert tok["valueFrom"]["secretKeyRef"] == {"name": "admin", "key": "tok"}
    assert c["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert (
        tpl["spec"]["nodeSelector"] == {"gpu": "yes"}
        and tpl["spec"]["tolerations"][0]["operator"] == "Exists"
    )


def test_lora_adapters_become_the_daemons_flags_as_its_own_parser_reads_them() -> None:
    from kvpilot.daemon.engine.weights.lora import parse_lora_modules

    modules = [{"name": "sql=v2", "path": "/adapters/sql v2"}, {"name": "chat", "path": "/adapters/chat"}]
    lora = {"modules": modules, "maxLoras": 2, "maxLoraRank": 64}
    args = builders.serve_args(FleetSpec.parse({"engine": {"lora": lora}}))
    at = args.index("--lora-modules")
    assert args[at - 1] == "--enable-lora"
    assert parse_lora_modules(args[at + 1 : at + 3]) == {
        "sql=v2": "/adapters/sql v2",
        "chat": "/adapters/chat",
    }
    assert args[args.index("--max-loras") + 1] == "2" and args[args.index("--max-lora-rank") + 1] == "64"
    assert "--enable-lora" not in builders.serve_args(FleetSpec.parse({}))
    assert builders.serve_args(FleetSpec.parse({"engine": {"lora": {}}})).count("--enable-lora") == 1


def test_daemonset_placement_has_no_replicas_and_model_is_passed() -> None:
    d = builders.workload("x", FleetSpec.parse({"placement": "DaemonSet", "model": "/models/q"}))
    assert d["kind"] == "DaemonSet" and "replicas" not in d["spec"]
    args = d["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/q" and "--port" in args
    env = d["spec"]["template"]["spec"]["containers"][0]["env"]
    assert (
        next(e for e in env if e["name"] == "KVPILOT_ADMIN_TOKEN")["valueFrom"]["secretKeyRef"]["name"]
        == "x-admin-token"
    )


def test_service_selects_the_fleets_serving_pods_on_its_port() -> None:
    s = builders.service("llama", FleetSpec.parse(SPEC))
    assert s["spec"]["selector"] == {"kvpilot.io/inference-deployment": "llama", "kvpilot.io/serving": "true"}
    assert (
        s["spec"]["ports"][0]["port"] == 8123
        and builders.selector_string("llama") == "kvpilot.io/inference-deployment=llama"
    )


def test_generated_admin_token_unless_a_secret_is_named_or_the_spec_opts_out() -> None:
    env = lambda spec: builders.container("f", FleetSpec.parse(spec))["env"]  # noqa: E731
    tok = next(e for e in env({}) if e["name"] == "KVPILOT_ADMIN_TOKEN")
    assert tok["valueFrom"]["secretKeyRef"] == {"name": "f-admin-token", "key": "token"}
    assert not any(e["name"] == "KVPILOT_ADMIN_TOKEN" for e in env({"disableAdminToken": True}))
    secret = builders.generated_token_secret("f", "abc")
    assert secret["metadata"]["name"] == "f-admin-token" and secret["stringData"] == {"token": "abc"}
    # the generated Secret is not offered to selector resets
    assert builders.ADMIN_TOKEN_LABEL not in secret["metadata"]["labels"]


def test_gpu_node_fields_reach_the_pod_and_cpu_limit_sets_threads() -> None:
    spec = {
        "serviceAccountName": "reader",
        "affinity": {"nodeAffinity": {}},
        "imagePullSecrets": [{"name": "reg"}],
        "volumes": [{"name": "models", "hostPath": {"path": "/m"}}],
        "volumeMounts": [{"name": "models", "mountPath": "/models"}],
        "securityContext": {"runAsNonRoot": True},
        "podSecurityContext": {"fsGroup": 1000},
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}},
        "resources": {"limits": {"cpu": "2500m", "nvidia.com/gpu": 1}},
    }
    pod = builders.workload("g", FleetSpec.parse(spec))["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert pod["serviceAccountName"] == "reader" and pod["automountServiceAccountToken"] is True
    assert pod["imagePullSecrets"] == [{"name": "reg"}] and pod["volumes"][0]["name"] == "models"
    assert pod["affinity"] == {"nodeAffinity": {}} and pod["securityContext"] == {"fsGroup": 1000}
    assert c["volumeMounts"][0]["mountPath"] == "/models" and c["securityContext"]["runAsNonRoot"]
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert c["args"][c["args"].index("--cpu-threads") + 1] == "3"
    assert builders.cpu_threads(FleetSpec.parse({"resources": {"limits": {"cpu": "0.5"}}})) == 1
    assert builders.cpu_threads(FleetSpec.parse({})) is None and "--cpu-threads" not in builders.serve_args(
        FleetSpec.parse({})
    )


def test_label_selector_strings() -> None:
    sel = {
        "matchLabels": {"b": "2", "a": "1"},
        "matchExpressions": [
            {"key": "tier", "operator": "In", "values": ["x", "y"]},
            {"key": "gpu", "operator": "Exists"},
            {"key": "old", "operator": "DoesNotExist"},
            {"key": "z", "operator": "NotIn", "values": ["q"]},
        ],
    }
    assert builders.label_selector(sel) == "a=1,b=2,tier in (x,y),gpu,!old,z notin (q)"


def test_reset_for_token_is_deterministic_per_token() -> None:
    a = builders.reset_for_token("llama", "t1")
    assert a == builders.reset_for_token("llama", "t1")
    assert a["metadata"]["name"] != builders.reset_for_token("llama", "t2")["metadata"]["name"]
    assert a["spec"] == {"targetRef": {"name": "llama"}, "ttlSecondsAfterFinished": 86400}


def test_conditions_keep_transition_time_until_status_changes() -> None:
    c = set_condition(None, "Available", False, "Down", "m", 1, now="2026-01-01T00:00:00Z")
    c = set_condition(c, "Available", False, "Down", "m2", 2, now="2026-01-02T00:00:00Z")
    assert get_condition(c, "Available")["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    c = set_condition(c, "Available", True, "Up", "m3", 3, now="2026-01-03T00:00:00Z")
    cond = get_condition(c, "Available")
    assert cond["lastTransitionTime"] == "2026-01-03T00:00:00Z" and cond["observedGeneration"] == 3
    conds = fleet_conditions(None, desired=3, ready=3, updated=3, generation=1, workload_seen=True)
    assert {x["type"]: x["status"] for x in conds} == {
        "Available": "True",
        "Progressing": "False",
        "Degraded": "False",
        "Ready": "True",
    }
    for x in conds:  # every metav1.Condition field
        assert set(x) == {"type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"}
    conds = fleet_conditions(
        conds, desired=3, ready=1, updated=3, generation=1, workload_seen=True, stalled=True
    )
    assert {x["type"]: x["status"] for x in conds} == {
        "Available": "True",  # one pod serves
        "Progressing": "True",
        "Degraded": "True",
        "Ready": "False",
    }


def test_router_objects_find_the_fleet_and_the_daemons_publish_kv_events() -> None:
    spec = {
        **SPEC,
        "model": "/models/q",
        "env": [{"name": "HF_HOME", "value": "/cache"}],
        "volumes": [{"name": "m", "hostPath": {"path": "/models"}}],
        "volumeMounts": [{"name": "m", "mountPath": "/models"}],
        "affinity": {
            "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []},
        },
        "router": {"enabled": True, "replicas": 2, "policy": "prefix-aware"},
    }
    sa, binding, dep, svc = router_objects.objects("llama", "team-a", FleetSpec.parse(spec), "rel-router")
    assert [o["kind"] for o in (sa, binding, dep, svc)] == [
        "ServiceAccount",
        "RoleBinding",
        "Deployment",
        "Service",
    ]
    assert {o["metadata"]["name"] for o in (sa, binding, dep, svc)} == {"llama-router"}
    # No Role of its own: a binding, in the fleet's namespace, to the routers' ClusterRole the chart ships.
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "rel-router",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-router", "namespace": "team-a"}]
    pod = dep["spec"]["template"]
    # Router pods never carry the fleet's label: the fleet Service and resets must not take them for daemons.
    assert builders.FLEET_LABEL not in pod["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"] == {"kvpilot.io/router": "llama"}
    assert dep["spec"]["replicas"] == 2 and pod["spec"]["serviceAccountName"] == "llama-router"
    c = pod["spec"]["containers"][0]
    assert c["args"][:9] == [
        "router",
        "--fleet",
        "llama",
        "--namespace",
        "$(POD_NAMESPACE)",
        "--policy",
        "prefix-aware",
        "--host",
        "$(POD_IP)",
    ]
    assert c["args"][c["args"].index("--model") + 1] == "/models/q"  # the daemons' tokenizer
    tok = next(e for e in c["env"] if e["name"] == "KVPILOT_ADMIN_TOKEN")
    assert tok["valueFrom"]["secretKeyRef"] == {"name": "admin", "key": "tok"}
    assert {"name": "HF_HOME", "value": "/cache"} in c["env"] and c["volumeMounts"][:1] == spec[
        "volumeMounts"
    ]
    # The router goes where the fleet's volumes are: the daemons' nodes, not their pod (anti-)affinity.
    assert pod["spec"]["nodeSelector"] == {"gpu": "yes"} and pod["spec"]["tolerations"] == SPEC["tolerations"]
    assert (
        pod["spec"]["affinity"] == {"nodeAffinity": spec["affinity"]["nodeAffinity"]} and "resources" not in c
    )
    assert svc["spec"]["ports"][0]["port"] == 8080
    args = builders.workload("llama", FleetSpec.parse(spec))["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert args[args.index("--kv-events-endpoint") + 1] == "tcp://$(POD_IP):5557"
    assert args[args.index("--kv-events-replay-endpoint") + 1] == "tcp://$(POD_IP):5558"
    assert (
        router_objects.endpoint("llama", "team-a", FleetSpec.parse(spec))
        == "http://llama-router.team-a.svc:8080"
    )


def test_each_rank_of_a_data_parallel_daemon_gets_its_kv_event_ports() -> None:
    spec = {**SPEC, "engine": {"dataParallelSize": 3}, "router": {"enabled": True}}
    c = builders.workload("llama", FleetSpec.parse(spec))["spec"]["template"]["spec"]["containers"][0]
    # Rank r publishes on 5557 + r; the replay sockets follow the events' range, so nothing collides.
    assert c["args"][c["args"].index("--kv-events-endpoint") + 1] == "tcp://$(POD_IP):5557"
    assert c["args"][c["args"].index("--kv-events-replay-endpoint") + 1] == "tcp://$(POD_IP):5560"
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [
        ("http", 8123),
        ("kv-events", 5557),
        ("kv-replay", 5560),
        ("kv-events-1", 5558),
        ("kv-replay-1", 5561),
        ("kv-events-2", 5559),
        ("kv-replay-2", 5562),
    ]


def test_without_a_prefix_aware_router_the_daemons_publish_nothing() -> None:
    for router in (None, {"enabled": False}, {"enabled": True, "policy": "least-load"}):
        spec = {**SPEC, **({"router": router} if router else {})}
        c = builders.workload("llama", FleetSpec.parse(spec))["spec"]["template"]["spec"]["containers"][0]
        assert "--kv-events-endpoint" not in c["args"] and [p["name"] for p in c["ports"]] == ["http"]
    assert router_objects.endpoint("llama", "ns", FleetSpec.parse(SPEC)) == "http://llama.ns.svc:8123"


def test_the_router_serves_as_endpoint_picker_and_the_pool_names_it() -> None:
    spec = FleetSpec.parse({**SPEC, "router": {"enabled": True, "endpointPicker": {"enabled": True}}})
    _, _, dep, svc = router_objects.objects("llama", "team-a", spec)
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][c["args"].index("--endpoint-picker-port") + 1] == "9002"  # GAIE's usual EPP port
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("http", 8080), ("grpc-epp", 9002)]
    assert svc["spec"]["ports"][1] == {
        "name": "grpc-epp",
        "port": 9002,
        "targetPort": "grpc-epp",
        "protocol": "TCP",
        "appProtocol": "kubernetes.io/h2c",  # gRPC: HTTP/2 without TLS
    }
    pool = inference_pool.inference_pool("llama", spec)
    assert (pool["apiVersion"], pool["kind"], pool["metadata"]["name"]) == (
        "inference.networking.k8s.io/v1",
        "InferencePool",
        "llama",
    )
    # The pods the fleet's Service selects (fenced ones left out), on the daemons' port; never router pods.
    fleet_svc = builders.service("llama", spec)
    assert pool["spec"]["selector"] == {"matchLabels": fleet_svc["spec"]["selector"]}
    assert "kvpilot.io/router" not in pool["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["targetPorts"] == [{"number": 8123}]
    # A Service reference names the Service port, which is the picker's.
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": svc["metadata"]["name"],
        "port": {"number": 9002},
    }
    assert pool["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kvpilot-operator"

    moved = FleetSpec.parse(
        {**SPEC, "router": {"enabled": True, "endpointPicker": {"enabled": True, "port": 9100}}}
    )
    _, _, dep, svc = router_objects.objects("llama", "team-a", moved)
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert (
        args[args.index("--endpoint-picker-port") + 1] == "9100" and svc["spec"]["ports"][1]["port"] == 9100
    )
    assert inference_pool.inference_pool("llama", moved)["spec"]["endpointPickerRef"]["port"] == {
        "number": 9100
    }


def test_no_endpoint_picker_without_the_router_or_the_option() -> None:
    for router in (
        {"enabled": True},
        {"enabled": True, "endpointPicker": {"enabled": False}},
        {"enabled": False, "endpointPicker": {"enabled": True}},  # the picker is the router: off with it
    ):
        spec = FleetSpec.parse({**SPEC, "router": router})
        assert inference_pool.endpoint_picker(spec) is None, router
        if router["enabled"]:
            _, _, dep, svc = router_objects.objects("llama", "ns", spec)
            c = dep["spec"]["template"]["spec"]["containers"][0]
            assert "--endpoint-picker-port" not in c["args"] and [p["name"] for p in c["ports"]] == ["http"]
            assert [p["name"] for p in svc["spec"]["ports"]] == ["http"]


def test_ready_waits_for_the_router_unless_no_pod_is_wanted() -> None:
    conds = fleet_conditions(None, 2, 2, 2, 1, True, router_problem=("RouterNotReady", "router 0/1 ready"))
    ready = get_condition(conds, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "RouterNotReady") and "router 0/1" in ready[
        "message"
    ]
    assert get_condition(fleet_conditions(conds, 2, 2, 2, 1, True), "Ready")["status"] == "True"
    # No pod wanted: the router cannot be ready (nothing to route to), and the fleet is as wanted.
    zero = fleet_conditions(None, 0, 0, 0, 1, True, router_problem=("RouterNotReady", "router 0/1 ready"))
    assert get_condition(zero, "Ready")["status"] == "True"


def test_router_state_follows_the_deployment_rollout() -> None:
    def dep(gen: int, observed: int, ready: int, updated: int) -> dict:
        return {
            "metadata": {"generation": gen},
            "status": {
                "observedGeneration": observed,
                "replicas": 2,
                "readyReplicas": ready,
                "updatedReplicas": updated,
            },
        }

    assert deployment_state("llm", 2, dep(3, 3, 2, 2)).ready
    assert deployment_state("llm", 2, dep(3, 3, 2, 2)).status == {
        "replicas": 2,
        "readyReplicas": 2,
        "updatedReplicas": 2,
        "service": "llm-router",
    }
    for rolling in (dep(4, 3, 2, 2), dep(3, 3, 2, 1), dep(3, 3, 1, 2)):  # not seen yet, old pods, unready
        st = deployment_state("llm", 2, rolling)
        assert not st.ready and st.reason == "RouterNotReady", rolling


def test_crds_have_no_stray_keys() -> None:
    """A comma in an unquoted flow-mapping description makes extra null keys; the API server drops them on
    create and refuses the next `kubectl apply -f crds/`."""
    import pathlib

    import yaml

    def walk(node: object, path: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                assert v is not None, f"{path}.{k} is null"
                walk(v, f"{path}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")

    for f in sorted((pathlib.Path(__file__).parents[2] / "crds").glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            walk(doc, f.name)


def test_offload_tiers_reach_kvpilot_serve_as_its_own_flags() -> None:
    """engine.kvOffloading*: the daemon's offload tiers (docs/engine.md), parsed by `kvpilot serve` itself."""
    from kvpilot.cli.flags import from_flags
    from kvpilot.cli.main import build_parser
    from kvpilot.daemon.engine.config import EngineConfig

    engine = {"kvOffloadingSize": 2.5, "kvOffloadingDir": "/kv", "kvOffloadingDirSize": 40}
    d = builders.workload("llama", FleetSpec.parse({"engine": engine}))
    args = d["spec"]["template"]["spec"]["containers"][0]["args"]
    parsed = build_parser().parse_args([a.replace("$(POD_IP)", "127.0.0.1") for a in args])
    config = from_flags(EngineConfig, parsed)
    assert (config.kv_offloading_size, config.kv_offloading_dir, config.kv_offloading_dir_size) == (
        2.5,
        "/kv",
        40.0,
    )
    config.validate()
