"""LoRA adapters on the real default model: the engine's greedy tokens equal peft's (fp32) for each adapter,
alone and mixed with the base model and each other in one batch; an adapter's KV is its own; bad adapters
are refused with their reason."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvpilot.daemon.engine.admission import RequestRejected
from kvpilot.daemon.engine.client import EngineRequest
from kvpilot.daemon.engine.engine_loop import EngineLoop
from kvpilot.daemon.engine.outputs import RequestOutput
from kvpilot.daemon.engine.request import SamplingParams
from kvpilot.daemon.engine.weights.control import WeightControl
from kvpilot.daemon.engine.weights.lora import LoRAError
from kvpilot.daemon.engine.weights.ops import (
    LoadLoRA,
    UnloadLoRA,
    WeightError,
    WeightErrorKind,
    next_lora_order,
)
from kvpilot.kv.block_keys import HASH_ALGOS, KeyScheme
from kvpilot.kv.events import BlockStored, decode_batch
from support.kv_events import BS, kv_events_engine, wait_replayed
from support.lora import make_adapter, peft_greedy

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def lora_engine(make_engine, lora_adapters):  # noqa: ANN001, ANN201
    return make_engine(enable_lora=True, lora_modules=[f"{n}={p}" for n, p in lora_adapters.items()])


@pytest.fixture(scope="module")
def references(default_model_dir, lora_adapters, chat_prompts) -> dict[str | None, list[list[int]]]:  # noqa: ANN001
    prompts = chat_prompts[:3]
    refs = {
        name: peft_greedy(default_model_dir, path, prompts, MAX_TOKENS)
        for name, path in lora_adapters.items()
    }
    refs[None] = peft_greedy(default_model_dir, None, prompts, MAX_TOKENS)
    return refs


def test_each_adapter_alone_matches_peft(lora_engine, references, chat_prompts) -> None:  # noqa: ANN001
    prompts = chat_prompts[:3]
    params = SamplingParams(max_tokens=MAX_TOKENS)
    for name, expected in references.items():
        assert lora_engine.generate(prompts, params, lora_names=[name] * len(prompts)) == expected, name
    # The adapters change the answers: equal outputs would make this test unable to fail.
    assert len({json.dumps(v) for v in references.values()}) == len(references)


def test_a_batch_mixing_base_and_adapters_matches_peft(lora_engine, references, chat_prompts) -> None:  # noqa: ANN001
    names = [None, "every-layer", "attention-only"]
    mixed = [(p, names[(i + j) % 3]) for i, p in enumerate(chat_prompts[:3]) for j in range(3)]
    got = lora_engine.generate(
        [p for p, _ in mixed], SamplingParams(max_tokens=MAX_TOKENS), lora_names=[n for _, n in mixed]
    )
    for k, ((prompt, name), out) in enumerate(zip(mixed, got)):
        assert out == references[name][chat_prompts.index(prompt)], (k, name)


def test_adapters_beyond_max_cpu_loras_are_read_again_when_named(
    make_engine, lora_adapters, references, chat_prompts, tmp_path
) -> None:  # noqa: ANN001
    """--max-cpu-loras 1: one adapter's weights held at a time, the other read again from its directory when a
    request names it, with peft's answers all the same; files changed on disk meanwhile are refused, not
    served under the identity (and the cached blocks) of the weights first loaded."""
    moved = tmp_path / "attention-only"
    shutil.copytree(lora_adapters["attention-only"], moved)
    eng = make_engine(
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=1,
        lora_modules=[f"every-layer={lora_adapters['every-layer']}", f"attention-only={moved}"],
    )
    assert eng.loras.held == ["attention-only"]  # the last loaded
    params = SamplingParams(max_tokens=MAX_TOKENS)
    prompt = chat_prompts[:1]
    for name in ("every-layer", "attention-only", "every-layer"):
        assert eng.generate(prompt, params, lora_names=[name]) == references[name][:1], name
        assert eng.loras.held == [name]
    assert eng.loras.reloads == 3
    running = eng.loras.get("every-layer")  # as a request still running it holds it
    eng.loras.get("attention-only")  # its weights take every-layer's place in the held set
    assert eng.loras.get("every-layer") is running and eng.loras.reloads == 4  # taken back, not read again
    for f in ("adapter_config.json", "adapter_model.safetensors"):  # another valid adapter, same directory
        shutil.copy(lora_adapters["every-layer"] / f, moved / f)
    with pytest.raises(RequestRejected, match="changed since it was loaded"):
        eng.add_request("changed", prompt[0], params, lora_name="attention-only")
    with pytest.raises(ValueError, match="max_cpu_loras must be at least max_loras"):
        make_engine(enable_lora=True, max_loras=2, max_cpu_loras=1)


def hold_reads(registry) -> tuple[threading.Event, threading.Event]:  # noqa: ANN001
    """Make the registry's adapter reads wait: the first event is set when a read starts, the second lets
    it go on."""
    reading, gate = threading.Event(), threading.Event()
    read = registry.read

    def held_read(name: str, path: str | Path):  # noqa: ANN202
        reading.set()
        assert gate.wait(60), "the test never let the read go on"
        return read(name, path)

    registry.read = held_read
    return reading, gate


def test_an_adapter_read_again_never_stalls_the_steps(make_engine, lora_adapters, chat_prompts) -> None:  # noqa: ANN001
    """--max-cpu-loras 1, two adapters taking turns: each is read, hashed and parsed again when named (a
    149 MiB adapter took ~0.5 s, inside the engine's thread: every stream stalled). The read runs off the
    engine's thread now: another stream gets its tokens while one is held, and the reload is counted
    (kvpilot:lora_reloads_total)."""
    eng = make_engine(
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=1,
        lora_modules=[f"{n}={lora_adapters[n]}" for n in ("every-layer", "attention-only")],
    )
    assert eng.loras.held == ["attention-only"]
    reading, gate = hold_reads(eng.loras)
    loop = EngineLoop(eng)

    async def tokens(sink: asyncio.Queue, want: int | None = None) -> int:
        """Tokens from the queue, `want` of them or until the request finishes."""
        got = 0
        while want is None or got < want:
            out = await sink.get()
            assert isinstance(out, RequestOutput), out
            got += len(out.new_token_ids)
            if out.finished:
                break
        return got

    async def main() -> None:
        loop.start()
        try:
            long = SamplingParams(max_tokens=400, ignore_eos=True)
            base = await loop.add(EngineRequest("base", chat_prompts[0], long))
            adapted = asyncio.create_task(
                loop.add(
                    EngineRequest(
                        "lora", chat_prompts[1], SamplingParams(max_tokens=4), lora_name="every-layer"
                    )
                )
            )
            assert await asyncio.to_thread(reading.wait, 30)
            while not base.empty():  # only tokens stepped while the read is held count
                base.get_nowait()
            async with asyncio.timeout(60):  # stalled, the old engine thread gave none until the gate opened
                assert await tokens(base, 8) >= 8 and not gate.is_set()
            gate.set()
            assert await asyncio.wait_for(tokens(await adapted), 60) == 4
            loop.abort("base")
        finally:
            gate.set()
            await loop.stop()

    asyncio.run(main())
    assert eng.stats().lora_reloads == 1 and eng.loras.held == ["every-layer"]


def test_a_load_the_server_gave_up_on_is_dropped_not_served(make_engine, lora_adapters) -> None:  # noqa: ANN001
    """A run-time load past the server's timeout goes on reading beside the steps; the server then undoes it
    (an unload, or the previous files in place). The late read must not land after that undo: the engine
    would serve an adapter the server does not list, and refuse the next load of its name."""
    eng = make_engine(enable_lora=True)
    read = eng.loras.read
    reading, gate = hold_reads(eng.loras)
    outcome: list[object] = []

    path = str(lora_adapters["attention-only"])

    def load() -> None:
        try:
            outcome.append(eng.loras.load("late", path, False, next_lora_order()))
        except LoRAError as exc:
            outcome.append(exc)

    loading = threading.Thread(target=load)
    loading.start()
    assert reading.wait(30)
    # the server's undo: nothing of that name is served yet
    assert not eng.loras.remove("late", next_lora_order())
    gate.set()
    loading.join(60)
    assert isinstance(outcome[0], LoRAError) and "came first" in str(outcome[0]), outcome
    assert "late" not in eng.loras.served
    eng.loras.read = read
    assert eng.loras.load("late", path, False, next_lora_order()).name == "late"


def test_a_load_still_queued_when_the_server_undid_it_never_lands(make_engine, lora_adapters) -> None:  # noqa: ANN001
    """The server numbers its loads and unloads as it makes them: a load that waited on a rank (behind
    another adapter's read) until after the server's undo of it ran there is dropped unread, and a late
    unload never takes away a load made after it."""
    eng = make_engine(enable_lora=True)
    control = WeightControl(eng)
    read, reads = eng.loras.read, []
    eng.loras.read = lambda name, path: reads.append(name) or read(name, path)
    path = str(lora_adapters["attention-only"])
    queued, undo = LoadLoRA("late", path, False), UnloadLoRA("late")
    assert queued.order < undo.order
    assert control.run(undo, lambda reply: None)[1].kind is WeightErrorKind.NOT_FOUND
    reply = control.run_beside_steps(queued)
    assert isinstance(reply, WeightError) and "came first" in str(reply), reply
    assert "late" not in eng.loras.served and reads == []

    stale_unload, load = UnloadLoRA("late"), LoadLoRA("late", path, False)
    assert control.run_beside_steps(load)["lora_name"] == "late"
    assert control.run(stale_unload, lambda reply: None)[1].kind is WeightErrorKind.NOT_FOUND
    assert "late" in eng.loras.served and reads == ["late"]


def test_one_adapter_a_step_still_serves_a_mixed_batch(
    make_engine, lora_adapters, references, chat_prompts
) -> None:  # noqa: ANN001
    """--max-loras 1: no step runs two adapters; a request of another adapter waits without holding up
    the base model's requests behind it; every answer is still its adapter's."""
    eng = make_engine(
        enable_lora=True, max_loras=1, lora_modules=[f"{n}={p}" for n, p in lora_adapters.items()]
    )
    names = ["every-layer", "attention-only", None, "every-layer"]
    params = SamplingParams(max_tokens=MAX_TOKENS)
    seqs = [
        eng.add_request(f"m{i}", chat_prompts[i % 3], params, lora_name=n)[0] for i, n in enumerate(names)
    ]
    first = True
    while eng.has_unfinished_requests():
        eng.step()
        running = eng.scheduler.running
        assert len({r.lora.identity for r in running if r.lora is not None}) <= 1
        if first:  # the base request was admitted past the waiting adapter
            assert seqs[2].status.value == "running" or seqs[2].output_token_ids, running
            assert seqs[1].num_computed_tokens == 0
            first = False
    assert [s.output_token_ids for s in seqs] == [references[n][i % 3] for i, n in enumerate(names)]


def test_an_adapters_kv_is_never_served_to_the_base_or_another_adapter(
    lora_engine, shared_prefix_prompts
) -> None:  # noqa: ANN001
    prompt = shared_prefix_prompts[0]
    params = SamplingParams(max_tokens=1)
    lora_engine.reset_prefix_cache()

    def cached(name: str | None, rid: str) -> int:
        [seq] = lora_engine.add_request(rid, prompt, params, lora_name=name)
        while lora_engine.has_unfinished_requests():
            lora_engine.step()
        return seq.num_cached_tokens

    assert cached("every-layer", "a1") == 0
    assert cached(None, "base1") == 0  # the base model computes its own
    assert cached("attention-only", "b1") == 0
    assert cached("every-layer", "a2") >= len(prompt) - 16  # each finds its own again
    assert cached(None, "base2") >= len(prompt) - 16


def test_an_adapter_loaded_again_with_new_weights_shares_no_block(
    make_engine, lora_adapters, tmp_path, default_model_dir, shared_prefix_prompts
) -> None:  # noqa: ANN001
    """The same name over other weights (an RL step's adapter) is another identity: its first block's key,
    so every key, differs."""
    newer = make_adapter(default_model_dir, tmp_path / "newer", seed=3)
    old = make_engine(enable_lora=True, lora_modules=[f"policy={lora_adapters['every-layer']}"])
    new = make_engine(enable_lora=True, lora_modules=[f"policy={newer}"])
    old_id, new_id = old.loras.get("policy").identity, new.loras.get("policy").identity
    assert old_id.name == new_id.name and old_id.digest != new_id.digest
    prompt = shared_prefix_prompts[0]
    keys = [e.keys.prompt_hashes(prompt, 16, lora=e.loras.get("policy").identity) for e in (old, new)]
    assert not set(keys[0]) & set(keys[1])
    assert old.keys.prompt_hashes(prompt, 16) != keys[0]  # and none with the base model's
    # An adapter's name is tagged apart from a tenant's salt: a salt equal to it, or spelling its key
    # (as kvpilot's older byte scheme once could), keys other blocks, in every scheme.
    identity = old.loras.get("policy").identity
    for algo in HASH_ALGOS:
        scheme = KeyScheme(algo)
        adapter_keys = scheme.prompt_hashes(prompt, 16, lora=identity)
        for salt in ("policy", f"\x00lora\x00policy\x00{identity.digest}", f"lora{identity.digest}"):
            assert scheme.prompt_hashes(prompt, 16, cache_salt=salt) != adapter_keys, (algo, salt)


def test_bad_adapters_are_refused_with_their_reason(
    make_engine, lora_adapters, tmp_path, tiny_model_dir
) -> None:  # noqa: ANN001
    good = lora_adapters["attention-only"]

    def refused(path: Path, **overrides) -> str:  # noqa: ANN003
        with pytest.raises(LoRAError) as exc:
            make_engine(enable_lora=True, lora_modules=[f"bad={path}"], **overrides)
        return str(exc.value)

    assert "not a peft LoRA directory" in refused(tmp_path / "missing")
    assert "above --max-lora-rank 2" in refused(good, max_lora_rank=2)

    dora = tmp_path / "dora"
    shutil.copytree(good, dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    assert "use_dora not supported" in refused(dora)

    other = make_adapter(tiny_model_dir, tmp_path / "other-model", seed=4, r=4, targets=["q_proj"])
    assert "an adapter of another model?" in refused(other)

    integers = tmp_path / "integers"  # refused before anything is converted (uint8 as float32: 4x)
    shutil.copytree(good, integers)
    weights = integers / "adapter_model.safetensors"
    save_file({k: v.to(torch.uint8) for k, v in load_file(weights).items()}, weights)
    assert "torch.uint8, not a floating-point tensor" in refused(integers)

    torn = tmp_path / "torn"
    shutil.copytree(good, torn)
    (torn / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    assert "cannot be read" in refused(torn)

    with pytest.raises(ValueError, match="needs enable_lora"):
        make_engine(lora_modules=[f"x={good}"])
    with pytest.raises(LoRAError, match="expected name=path"):
        make_engine(enable_lora=True, lora_modules=[str(good)])


def test_a_request_for_an_unknown_adapter_is_refused(lora_engine, chat_prompts) -> None:  # noqa: ANN001
    from kvpilot.daemon.engine.admission import RequestRejected

    with pytest.raises(RequestRejected, match="no LoRA adapter 'nope'"):
        lora_engine.add_request("u1", chat_prompts[0], SamplingParams(max_tokens=1), lora_name="nope")


def test_kv_events_name_the_adapter_of_each_stored_chain(default_model_dir, lora_adapters) -> None:  # noqa: ANN001
    """BlockStored carries `lora_name` (vLLM's field) and the adapter's keys, so a router can tell an
    adapter's prefixes from the base model's."""
    eng = kv_events_engine(
        default_model_dir, enable_lora=True, lora_modules=[f"sql={lora_adapters['attention-only']}"]
    )
    try:
        prompt = list(range(100, 140))  # 2 full blocks
        eng.generate([prompt, prompt], SamplingParams(max_tokens=1), lora_names=["sql", None])
        stored = [
            e
            for _, payload in wait_replayed(eng.kv_events.replay_endpoint, 1)
            for e in decode_batch(payload).events
            if isinstance(e, BlockStored)
        ]
        by_name = {e.lora_name: e.block_hashes for e in stored}
        assert set(by_name) == {"sql", None}, stored
        identity = eng.loras.get("sql").identity
        assert by_name["sql"] == eng.keys.prompt_hashes(prompt, BS, lora=identity)
        assert by_name[None] == eng.keys.prompt_hashes(prompt, BS)
    finally:
        eng.close()


def test_a_reload_in_place_leaves_running_requests_on_the_weights_they_started_with(
    make_engine, lora_adapters, references, chat_prompts
) -> None:  # noqa: ANN001
    eng = make_engine(enable_lora=True, lora_modules=[f"policy={lora_adapters['every-layer']}"])
    params = SamplingParams(max_tokens=MAX_TOKENS)
    [old] = eng.add_request("old", chat_prompts[0], params, lora_name="policy")
    eng.step()  # its prompt is computed under the first weights
    with pytest.raises(LoRAError, match="already loaded"):
        eng.load_lora("policy", str(lora_adapters["attention-only"]), inplace=False)
    eng.load_lora("policy", str(lora_adapters["attention-only"]), inplace=True)
    [new] = eng.add_request("new", chat_prompts[0], params, lora_name="policy")
    while eng.has_unfinished_requests():
        eng.step()
    assert old.output_token_ids == references["every-layer"][0]
    assert new.output_token_ids == references["attention-only"][0]
    assert new.num_cached_tokens == 0  # the old weights' blocks are another adapter's
    assert eng.unload_lora("policy") and not eng.unload_lora("policy")
    with pytest.raises(LoRAError, match="start the daemon with --enable-lora"):
        make_engine().load_lora("x", str(lora_adapters["every-layer"]), inplace=False)


def test_a_weight_swap_restarts_a_request_under_its_adapter_even_once_unloaded(
    make_engine, lora_adapters, references, chat_prompts
) -> None:  # noqa: ANN001
    """A swap starts unsent requests again from their prompt: one whose adapter was unloaded meanwhile
    keeps that adapter (it was admitted under it), and the swap does not fail."""
    eng = make_engine(enable_lora=True, lora_modules=[f"policy={lora_adapters['every-layer']}"])
    params = SamplingParams(max_tokens=MAX_TOKENS)
    eng.add_request("a", chat_prompts[0], params, restartable=True, lora_name="policy")
    eng.add_request("b", chat_prompts[1], params, restartable=True)
    eng.step()
    assert eng.unload_lora("policy")
    eng.swap_weights("v2", lambda: None)  # the same weights under a new version: the answers stay
    outputs: dict[str, list[int]] = {"a": [], "b": []}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outputs[o.request_id].extend(o.new_token_ids)
    assert outputs == {"a": references["every-layer"][0], "b": references[None][1]}
