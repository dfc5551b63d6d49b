"""Server-set tenancy through a real `kvpilot serve --tenant-tokens-file` and the official openai client: each
tenant's cache is salted by the server, so no `cache_salt` a tenant sends reaches another's blocks; a request
without a tenant's token is a 401; the admin resets one tenant's cache by its salt, or all of a tenant's
partitions by its name; a bad file stops the start with its reason, and so does a tenant whose token is the
admin's."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.servers import ADMIN_TOKEN, Server, start_server, stop_server

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789ab"
SYSTEM = "You answer questions about prefix caches of language model servers, in one short sentence. " * 3


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:  # noqa: ANN001
    tmp = tmp_path_factory.mktemp("tenancy")
    tokens = tmp / "tenants"
    tokens.write_text(f"# tenant token\nalice {ALICE}\nbob {BOB}\n")
    srv = start_server(tmp, "--tenant-tokens-file", str(tokens), "--enable-pinned-prefix", token=ADMIN_TOKEN)
    yield srv
    stop_server(srv)
    assert "Traceback" not in srv.log(), srv.log()[-4000:]


def cached(server: Server, key: str, salt: str | None = None) -> int:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)
    out = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is one?"}],
        max_tokens=1,
        extra_body={"cache_salt": salt} if salt else None,
    )
    return out.usage.prompt_tokens_details.cached_tokens or 0


def test_a_request_without_a_tenants_token_is_a_401(server: Server) -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer not-a-tenant-token"}, {"Authorization": f"Basic {ALICE}"}):
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            r = server.request("POST", path, body, headers=headers)
            assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers, r.body)
    assert server.request("GET", "/v1/models").status == 200  # what a router or a probe reads stays open


def test_no_salt_a_tenant_sends_reaches_another_tenants_blocks(server: Server) -> None:
    server.reset()
    cached(server, ALICE)
    assert cached(server, ALICE) >= 32  # a tenant's own prompts hit
    assert cached(server, BOB) == 0  # the same prompt, another tenant: nothing shared
    for spelled in ("tenant:alice", "alice", ":alice"):
        assert cached(server, BOB, spelled) == 0, spelled  # not even by spelling alice's salt
    cached(server, BOB, "team-1")
    assert cached(server, BOB, "team-1") >= 32  # a tenant's own salts partition its own cache


def test_a_tenant_cannot_pin_only_the_admin_can(server: Server) -> None:
    """Pins share one cap per rank: a tenant's pins could hold all of it, and what they hold is kept from
    every other tenant. A tenant's pin_prefix is served unpinned, saying why; the admin (the operator's
    PrefixCacheWarmup) pins."""
    server.reset()
    body = {"messages": [{"role": "user", "content": SYSTEM}], "max_tokens": 1, "pin_prefix": True}
    alice = server.request("POST", "/v1/chat/completions", body, headers={"Authorization": f"Bearer {ALICE}"})
    assert alice.status == 200 and alice.json()["pin_prefix"] == {
        "pinned": False,
        "blocks": 0,
        "reason": "tenant",
    }
    assert server.cache()["pinned_blocks"] == 0
    admin = server.request("POST", "/v1/chat/completions", body, headers=server.admin())
    assert admin.status == 200 and admin.json()["pin_prefix"]["pinned"] is True, admin.body
    assert server.reset()["unpinned_blocks"] == admin.json()["pin_prefix"]["blocks"] > 0


def test_the_admin_resets_one_tenants_cache_by_its_salt(server: Server) -> None:
    server.reset()
    for key in (ALICE, BOB, ALICE, BOB):
        cached(server, key)
    reply = server.reset(cache_salt="tenant:alice")
    assert reply["scope"] == {"cache_salt": "tenant:alice"} and reply["evicted_blocks"] > 0, reply
    assert cached(server, ALICE) == 0 and cached(server, BOB) >= 32
    assert cached(server, ADMIN_TOKEN, "tenant:bob") >= 32  # the admin's requests keep the salt they name


def test_a_tenant_reset_clears_its_blocks_and_its_own_partitions_only(server: Server) -> None:
    server.reset()
    for key, salt in [(ALICE, None), (ALICE, "team-1"), (BOB, None), (BOB, "team-1")] * 2:
        cached(server, key, salt)
    reply = server.reset(tenant="alice")
    assert reply["scope"] == {"tenant": "alice"} and reply["evicted_blocks"] > 0, reply
    assert cached(server, ALICE) == 0 and cached(server, ALICE, "team-1") == 0  # her partitions too
    assert cached(server, BOB) >= 32 and cached(server, BOB, "team-1") >= 32
    for query in ("tenant=alice:team-1", "tenant=alice*", "tenant=alice&cache_salt=team-1"):
        r = server.request("POST", f"/reset_prefix_cache?{query}", headers=server.admin())
        assert r.status == 400 and r.json()["error"]["param"] == "tenant", (query, r.body)


def test_a_tenants_salt_stays_within_what_a_reset_can_name(server: Server) -> None:
    """The salt a tenant's request is keyed by is `tenant:<name>:<its salt>`: that whole must fit the
    scoped reset's bound, so the body's salt has that much less room."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=ALICE, max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model=client.models.list().data[0].id,
            prompt="hi",
            max_tokens=1,
            extra_body={"cache_salt": "s" * 4096},
        )
    assert "at most 4083 characters for tenant alice" in str(err.value), err.value


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "names no token"),
        ("alice short\n", "line 1: a token has at least 16 characters"),
        (f"alice {ALICE}\nbob {ALICE}\n", "line 2: this token is given twice"),
        (f"al:ice {ALICE}\n", "line 1: a tenant is 1 to 63 letters"),
        (f"alice {ALICE} extra\n", "line 1: expected 'TENANT TOKEN'"),
        (f"alice {ALICE}\n", "--tenant-tokens-file needs an admin token"),  # a good file, no admin token
    ],
)
def test_a_bad_tenant_file_stops_the_start_with_its_reason(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "tenants"
    path.write_text(content)
    argv = [sys.executable, "-m", "kvpilot", "serve", "--port", "0", "--tenant-tokens-file", str(path)]
    env = {k: v for k, v in os.environ.items() if k != "KVPILOT_ADMIN_TOKEN"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_a_tenant_token_equal_to_the_admin_token_stops_the_start(tmp_path: Path) -> None:
    """Such a tenant would hold the admin routes, and the admin's requests would be salted as that tenant."""
    path = tmp_path / "tenants"
    path.write_text(f"alice {ALICE}\nmallory {ADMIN_TOKEN}\n")
    argv = [sys.executable, "-m", "kvpilot", "serve", "--port", "0", "--tenant-tokens-file", str(path)]
    env = {**os.environ, "KVPILOT_ADMIN_TOKEN": ADMIN_TOKEN}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    message = "tenant mallory's token in --tenant-tokens-file is the admin token"
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
