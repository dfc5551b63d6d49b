"""LoRA adapters through a real `kvpilot serve` and the official openai client: a request names an adapter as
its model and gets peft's answer, `/v1/models` lists adapters as vLLM does (their paths to the admin only), an
adapter's prompts never hit the base model's cache, and a bad adapter stops the start with its reason."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.lora import peft_greedy
from support.servers import ADMIN_TOKEN, Server, start_server, stop_server

MAX_TOKENS = 10
SYSTEM = (
    "You are the assistant of a team that runs language models on Kubernetes. Every replica keeps a "
    "prefix cache of attention keys and values, and the team flushes those caches before benchmarks."
)


def _lora_flags(adapters: dict[str, Path]) -> list[str]:
    return ["--enable-lora", "--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]


@pytest.fixture(scope="module", params=[1, 2], ids=["one-engine", "two-ranks"])
def lora_server(request, tmp_path_factory, lora_adapters) -> Iterator[Server]:  # noqa: ANN001
    """The daemon in-process (one engine) and with two data-parallel ranks, each loading the adapters; the
    ranks hold one adapter's weights each (`--max-cpu-loras 1`), so they read the other again (on their
    inbox thread) whenever a request names it."""
    held = ["--max-loras", "1", "--max-cpu-loras", "1"] if request.param > 1 else []
    srv = start_server(
        tmp_path_factory.mktemp("lora-serve"),
        *_lora_flags(lora_adapters),
        *held,
        "--enable-pinned-prefix",
        "-dp",
        str(request.param),
        token=ADMIN_TOKEN,
    )
    yield srv
    stop_server(srv)
    assert "Traceback" not in srv.log(), srv.log()[-4000:]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:  # noqa: ANN001
    return list(tokenizer("The three laws of caching are", add_special_tokens=True)["input_ids"])


@pytest.fixture(scope="module")
def references(default_model_dir, lora_adapters, prompt_ids, tokenizer) -> dict[str | None, str]:  # noqa: ANN001
    """peft's greedy text for the prompt under each adapter (None: the base model)."""
    refs = {
        n: peft_greedy(default_model_dir, p, [prompt_ids], MAX_TOKENS)[0] for n, p in lora_adapters.items()
    }
    refs[None] = peft_greedy(default_model_dir, None, [prompt_ids], MAX_TOKENS)[0]
    return {n: tokenizer.decode(ids, skip_special_tokens=True) for n, ids in refs.items()}


def _client(server: Server):  # noqa: ANN202
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_an_adapter_named_as_the_model_answers_as_peft_does(lora_server, references, prompt_ids) -> None:  # noqa: ANN001
    client = _client(lora_server)
    base = client.models.list().data[0].id
    for name, expected in references.items():
        out = client.completions.create(
            model=name or base, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0
        )
        assert out.model == (name or base)
        assert out.choices[0].text == expected, name
    assert len(set(references.values())) == len(references)  # each adapter answers otherwise


def test_models_lists_the_adapters_with_the_base_as_parent(lora_server, lora_adapters) -> None:  # noqa: ANN001
    """As vLLM lists them, an adapter's root its path: to the admin only. Anyone else (every tenant, a
    router's client) reads its name there, never the host's filesystem."""
    for admin in (True, False):
        headers = lora_server.admin() if admin else None
        data = lora_server.request("GET", "/v1/models", headers=headers).json()["data"]
        base = data[0]
        assert base["parent"] is None
        listed = {m["id"]: m for m in data[1:]}
        assert set(listed) == set(lora_adapters)
        for name, path in lora_adapters.items():
            root = str(path) if admin else name
            assert listed[name]["parent"] == base["id"] and listed[name]["root"] == root, (admin, listed)


def test_an_adapters_prompts_never_hit_the_base_models_cache(lora_server) -> None:  # noqa: ANN001
    client = _client(lora_server)
    base = client.models.list().data[0].id
    lora_server.reset()

    def cached(model: str) -> int:
        out = client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}],
            max_tokens=1,
        )
        return out.usage.prompt_tokens_details.cached_tokens or 0

    assert cached(base) == 0
    assert cached("every-layer") == 0
    assert cached("attention-only") == 0
    assert cached("every-layer") >= 32
    assert cached(base) >= 32


def test_a_reset_of_one_adapter_or_salt_leaves_the_rest_of_the_cache_warm(lora_server) -> None:  # noqa: ANN001
    """POST /reset_prefix_cache?lora_name=... (vLLM's query style) or {"cache_salt": ...} (a JSON body): that
    scope's prompts miss afterwards on every rank, every other adapter's, salt's and the base model's hit."""
    client = _client(lora_server)
    base = client.models.list().data[0].id
    lora_server.reset()

    def cached(model: str, salt: str | None = None) -> int:
        out = client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}],
            max_tokens=1,
            extra_body={"cache_salt": salt} if salt else None,
        )
        return out.usage.prompt_tokens_details.cached_tokens or 0

    scopes = [(base, None), ("every-layer", None), ("attention-only", None), (base, "tenant-a")]
    for model, salt in scopes:
        cached(model, salt)
    assert all(cached(model, salt) >= 32 for model, salt in scopes)  # all warm

    reply = _admin_post(lora_server, "/reset_prefix_cache?lora_name=every-layer", {})
    assert reply.status == 200, reply.body
    assert reply.json()["scope"] == {"lora_name": "every-layer"} and reply.json()["evicted_blocks"] >= 2
    assert all(r["scope"] == {"lora_name": "every-layer"} for r in reply.json()["ranks"])
    assert cached("every-layer") == 0
    assert all(cached(model, salt) >= 32 for model, salt in scopes if model != "every-layer")

    reply = _admin_post(lora_server, "/reset_prefix_cache", {"cache_salt": "tenant-a"})
    assert reply.status == 200 and reply.json()["scope"] == {"cache_salt": "tenant-a"}, reply.body
    assert cached(base, "tenant-a") == 0 and cached(base) >= 32 and cached("attention-only") >= 32

    for body in ({"lora_name": 5}, {"cache_salt": ""}, {"weight_version": "v" * 5000}):
        bad = _admin_post(lora_server, "/reset_prefix_cache", body)
        assert bad.status == 400 and bad.json()["error"]["param"] == next(iter(body)), bad.body
    assert cached(base) >= 32  # a refused reset cleared nothing


def test_requests_and_cache_hits_are_counted_per_adapter(lora_server) -> None:  # noqa: ANN001
    client = _client(lora_server)
    before = lora_server.metrics()

    def grew(name: str, adapter: str) -> float:
        key = f'kvpilot_lora_{name}_total{{adapter="{adapter}"}}'
        return lora_server.metrics().get(key, 0.0) - before.get(key, 0.0)

    sent = [client.completions.create(model="attention-only", prompt=SYSTEM, max_tokens=1) for _ in range(2)]
    assert grew("requests", "attention-only") == 2
    assert grew("prompt_tokens", "attention-only") == sum(out.usage.prompt_tokens for out in sent)
    assert grew("prompt_tokens_cached", "attention-only") >= 16  # the second one hit the first one's blocks
    assert grew("requests", "every-layer") == 0  # the base model's and other adapters' requests are not its


def test_ranks_read_a_let_go_adapter_again_and_answer_as_peft_does(
    lora_server, references, prompt_ids
) -> None:  # noqa: ANN001
    """Two adapters taking turns on one rank: with --max-cpu-loras 1 each turn reads the adapter again
    (counted), and every answer is still its adapter's; without the flag nothing is read again."""

    def reloads() -> float:  # over the ranks
        return sum(v for k, v in lora_server.metrics().items() if k.startswith("kvpilot_lora_reloads_total"))

    before = reloads()
    names = ["attention-only", "every-layer"] * 2
    for name in names:
        resp = lora_server.request(
            "POST",
            "/v1/completions",
            {"model": name, "prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0},
            headers={"X-data-parallel-rank": "0"},
        )
        assert resp.status == 200, resp.body
        assert resp.json()["choices"][0]["text"] == references[name], name
    read_again = reloads() - before
    # the first turn may name the adapter the rank still holds
    if "--max-cpu-loras" in lora_server.proc.args:
        assert len(names) - 1 <= read_again <= len(names), read_again
    else:
        assert read_again == 0


def test_an_unknown_model_is_a_404(lora_server) -> None:  # noqa: ANN001
    import openai

    with pytest.raises(openai.NotFoundError) as exc:
        _client(lora_server).completions.create(model="no-such-bot", prompt="hi", max_tokens=1)
    assert exc.value.body["code"] == "model_not_found"


def test_a_bad_adapter_stops_the_start_with_its_reason(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "use_dora": true}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    argv = [sys.executable, "-m", "kvpilot", "serve", "--port", "0", "--enable-lora"]
    done = subprocess.run(
        [*argv, "--lora-modules", f"dora={tmp_path}"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert "adapter 'dora': use_dora not supported" in done.stderr


def _admin_post(server: Server, path: str, body: dict, token: bool = True):  # noqa: ANN202
    return server.request("POST", path, body, headers=server.admin() if token else None)


def test_an_adapters_pins_go_when_it_is_unloaded(lora_server, lora_adapters) -> None:  # noqa: ANN001
    """Its identity keyed the pinned blocks: unloaded (or loaded again in place) no request can hit them, so
    they would hold their share of the pin cap for nothing."""
    lora_server.reset()
    path = str(lora_adapters["attention-only"])
    assert (
        _admin_post(lora_server, "/v1/load_lora_adapter", {"lora_name": "pinner", "lora_path": path}).status
        == 200
    )
    body = {"model": "pinner", "prompt": SYSTEM, "max_tokens": 1, "pin_prefix": True}
    pin = lora_server.request("POST", "/v1/completions", body, headers={"X-data-parallel-rank": "0"}).json()
    assert pin["pin_prefix"]["pinned"] is True, pin
    assert lora_server.cache()["pinned_blocks"] == pin["pin_prefix"]["blocks"] > 0
    reload = {"lora_name": "pinner", "lora_path": path, "load_inplace": True}
    assert _admin_post(lora_server, "/v1/load_lora_adapter", reload).status == 200
    assert lora_server.cache()["pinned_blocks"] == 0
    lora_server.request("POST", "/v1/completions", body, headers={"X-data-parallel-rank": "0"})
    assert lora_server.cache()["pinned_blocks"] > 0
    assert _admin_post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "pinner"}).status == 200
    assert lora_server.cache()["pinned_blocks"] == 0


def test_an_adapter_loaded_reloaded_in_place_and_unloaded_at_run_time(
    lora_server, lora_adapters, references, prompt_ids
) -> None:  # noqa: ANN001
    """vLLM's runtime routes, as an RL loop drives them: every answer after a reload comes from the new
    weights, and the cache the old ones filled is never served."""
    client = _client(lora_server)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}]

    def answer() -> str:
        out = client.completions.create(
            model="policy", prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0
        )
        return out.choices[0].text

    def cached() -> int:
        out = client.chat.completions.create(model="policy", messages=messages, max_tokens=1)
        return out.usage.prompt_tokens_details.cached_tokens or 0

    loaded = _admin_post(
        lora_server,
        "/v1/load_lora_adapter",
        {"lora_name": "policy", "lora_path": str(lora_adapters["every-layer"])},
    )
    assert loaded.status == 200, loaded.body
    assert loaded.json()["message"] == "Success: LoRA adapter 'policy' added successfully."
    assert "policy" in {m.id for m in client.models.list().data}
    health = lora_server.request("GET", "/health").json()["lora_adapters"]  # what routers key it by
    assert health["policy"] == loaded.json()["digest"] and set(health) == {
        "every-layer",
        "attention-only",
        "policy",
    }
    assert answer() == references["every-layer"]
    cached()
    assert cached() >= 32  # warm under the first weights

    again = _admin_post(
        lora_server,
        "/v1/load_lora_adapter",
        {"lora_name": "policy", "lora_path": str(lora_adapters["attention-only"])},
    )
    assert again.status == 400 and "already been loaded" in again.json()["error"]["message"]
    reloaded = _admin_post(
        lora_server,
        "/v1/load_lora_adapter",
        {"lora_name": "policy", "lora_path": str(lora_adapters["attention-only"]), "load_inplace": True},
    )
    assert reloaded.status == 200, reloaded.body
    assert reloaded.json()["digest"] != loaded.json()["digest"]
    assert cached() == 0  # a new identity: nothing the old weights computed is served
    assert answer() == references["attention-only"]

    assert any('adapter="policy"' in k for k in lora_server.metrics())
    gone = _admin_post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "policy"})
    assert gone.status == 200, gone.body
    assert not any('adapter="policy"' in k for k in lora_server.metrics())  # its series went with it
    assert "policy" not in {m.id for m in client.models.list().data}
    assert "policy" not in lora_server.request("GET", "/health").json()["lora_adapters"]
    missing = _admin_post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "policy"})
    assert missing.status == 404 and missing.json()["error"]["code"] == "lora_not_found"
    done = lora_server.request(
        "POST", "/v1/completions", {"model": "policy", "prompt": "hi", "max_tokens": 1}
    )
    assert done.status == 404 and done.json()["error"]["code"] == "model_not_found"


def test_a_bad_runtime_load_is_refused_with_its_reason_and_changes_nothing(lora_server, tmp_path) -> None:  # noqa: ANN001
    before = lora_server.request("GET", "/v1/models").json()["data"]
    cases = [
        ({"lora_name": "x", "lora_path": str(tmp_path)}, 400, "is not a peft LoRA directory"),
        ({"lora_name": "x"}, 400, "lora_path must be a non-empty string"),
        (
            {"lora_name": "", "lora_path": str(tmp_path)},
            400,
            "lora_name: an adapter name must be a non-empty string",
        ),
        ({"lora_name": "x\nforged log line", "lora_path": str(tmp_path)}, 400, "an adapter name must be"),
        ({"lora_name": "x y", "lora_path": str(tmp_path)}, 400, "an adapter name must be"),
        ({"lora_name": "x", "lora_path": str(tmp_path), "load_inplace": "yes"}, 400, "load_inplace must be"),
        ({"lora_name": before[0]["id"], "lora_path": str(tmp_path)}, 400, "the base model's name"),
    ]
    for body, status, message in cases:
        r = _admin_post(lora_server, "/v1/load_lora_adapter", body)
        assert r.status == status and message in r.json()["error"]["message"], (body, r.body)
    assert r.json()["error"]["code"] is None  # the caller's body, checked before any rank
    first = _admin_post(lora_server, "/v1/load_lora_adapter", cases[0][0]).json()["error"]
    assert first["code"] == "invalid_lora_adapter", first  # a rank read the adapter and refused it
    no_token = _admin_post(lora_server, "/v1/load_lora_adapter", cases[0][0], token=False)
    assert no_token.status == 401
    assert lora_server.request("GET", "/v1/models").json()["data"] == before


def _lora_info(server: Server) -> dict[str, str]:
    from prometheus_client.parser import text_string_to_metric_families

    text = server.request("GET", "/metrics").body.decode()
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info"]
    [sample] = family.samples
    return sample.labels


def test_lora_requests_info_names_the_running_adapters_as_vllm_does(lora_server) -> None:  # noqa: ANN001
    """GAIE's pickers read vLLM's gauge for LoRA affinity."""
    args = lora_server.proc.args
    assert _lora_info(lora_server) == {
        "max_lora": args[args.index("--max-loras") + 1] if "--max-loras" in args else "4",
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    stream = _client(lora_server).completions.create(
        model="attention-only",
        prompt="Once upon a time",
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    try:
        next(iter(stream))  # decoding now
        assert _lora_info(lora_server)["running_lora_adapters"] == "attention-only"
    finally:
        stream.close()
