"""A request's prompt token ids, exactly as the daemon will see them (same tokenizer, same template).

Validation stays with the daemon: the router reads of a body only the fields its prompts are made of, with
the daemon's own field types and validators (`chat_prompt`, `completion_prompts`), and where those do not
parse, routes without a prediction and lets the pod answer the 4xx. A body the pod then refuses for another
field (a sampling value out of range, an option it does not support) is predicted all the same, and its
blocks are expected on the pod it went to until the pod's events say otherwise or EXPECTED_TTL_S passes
(index.py): what a bad request costs the index is what a good one would, for that prompt.

What a client's body costs happens once: JSON parsing, templating, tokenizing and the block keys the
policy compares with the index (once per hash scheme, block size and weight version, among the pods). A
chat of at most INLINE_BYTES is read on the event loop, its keys computed as the policy first asks for
them; anything else off it, keys and all, in a small pool of threads with a bounded queue (the daemon's
TextPool).
Keys are computed for at most the model's context of each prompt: a longer prompt is refused by every
pod, so hashing a million tokens of it would only stall the router. When the pool's queue is full
the request is routed without a prediction, by load.

A body bigger than `parse_limit` is not read at all (routed by load, its weight-version pin not read
either): the threads share the interpreter's lock, and parsing a few MiB of JSON holds it for tens of
milliseconds at a time, which is what stalled every other request (/health too) while clients sent huge
bodies. 16 bytes per token of the model's context are more than one prompt that fits takes (a token id is
at most 8 bytes of JSON, a token of text a few characters of up to 6), so such a body is a prompt no pod
accepts, or a batch of many prompts: routing it by load costs it only its cache affinity, and, where it
pins a weight version in a fleet of two, perhaps a 409 from a pod of the other.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from kvpilot.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from kvpilot.kv.block_keys import BlockHash, KeyScheme, LoRAKey
from kvpilot.protocol.errors import ApiError
from kvpilot.protocol.requests import chat_prompt, completion_prompts
from kvpilot.router.kv.index import index_keys
from kvpilot.router.routing.chat_template import ChatTemplate
from kvpilot.router.routing.segment_tokenizer import SegmentTokenizer
from kvpilot.serving.text_pool import Busy, TextPool

log = logging.getLogger(__name__)

# How a pod rank hashes a request's blocks: (block size, weight version, key scheme, the LoRA adapter the
# request names as that pod knows it, or None).
Scheme = tuple[int, str | None, KeyScheme, LoRAKey | None]

# The context assumed for a tokenizer directory whose config.json names none.
FALLBACK_CONTEXT = 131072
PARSE_BYTES_PER_TOKEN = 16
# A chat this small is read on the event loop, not in a prompt thread: handing it to a thread and back
# wakes two threads and the loop, which on a busy machine cost more CPU than the work (bench/router_compare.py).
# Its worst case, 4 KiB of text never seen before, is about 2 ms of tokenizing: under /health's 100 ms. A
# completion of one prompt too (its JSON parsed first, on the loop: ~3 us), but not one of several: its 4 KiB
# may be a thousand one-character prompts, each tokenized and keyed on its own.
INLINE_BYTES = 4096
MIN_PARSE_LIMIT = 1 << 20  # bytes: the bound for a router that reads no prompts (its weight-version pin)


@dataclass(frozen=True, slots=True)
class Prompts:
    token_ids: list[list[int]]  # one list per prompt of the request
    cache_salt: str | None
    max_tokens: int | None = None  # tokens of a prompt that are hashed at most (None: all)
    model: str | None = None  # the body's `model`: the base model's name or a LoRA adapter's
    _keys: dict[Scheme, list[list[BlockHash]]] = field(default_factory=dict, compare=False, repr=False)
    _index_keys: dict[Scheme, list[list[int]]] = field(default_factory=dict, compare=False, repr=False)

    def block_keys(self, scheme: Scheme) -> list[list[BlockHash]]:
        """Each prompt's keys of the full blocks a pod rank hashing with `scheme` could serve from its
        cache: the engine always computes the last prompt token, so at most len-1 tokens' worth, and at
        most `max_tokens`."""
        keys = self._keys.get(scheme)
        if keys is None:
            keys = self._keys[scheme] = [self._keys_of(ids, *scheme) for ids in self.token_ids]
        return keys

    def index_keys(self, scheme: Scheme) -> list[list[int]]:
        """`block_keys` as the prefix index keys them (index.index_keys), made once for all the ranks a
        request is looked up in."""
        keys = self._index_keys.get(scheme)
        if keys is None:
            keys = self._index_keys[scheme] = [index_keys(k) for k in self.block_keys(scheme)]
        return keys

    def _keys_of(
        self,
        ids: list[int],
        block_size: int,
        weight_version: str | None,
        keys: KeyScheme,
        lora: LoRAKey | None,
    ) -> list[BlockHash]:
        usable = len(ids) - 1 if self.max_tokens is None else min(len(ids) - 1, self.max_tokens)
        n = max(usable, 0) // block_size * block_size
        return keys.prompt_hashes(ids[:n], block_size, self.cache_salt, weight_version, lora)


def tokenizer_dir(model: str | None) -> Path:
    """`--model` as `kvpilot serve` reads it: a checkpoint directory, or the embedded default model."""
    if model is None or model == DEFAULT_MODEL_NAME:
        return ensure_default_model()
    path = Path(model).expanduser()
    if not (path / "tokenizer_config.json").is_file() and not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"--model {model!r}: no tokenizer in this directory")
    return path


def model_context(path: Path) -> int:
    """The longest prompt any pod serving the model at `path` accepts: its config's
    max_position_embeddings, which bounds every daemon's --max-model-len."""
    try:
        value = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        value = None
    return value if isinstance(value, int) and value > 0 else FALLBACK_CONTEXT


class PromptReader:
    def __init__(self, model: str | None, workers: int = 2, max_pending: int = 64) -> None:
        path = tokenizer_dir(model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.encoder = SegmentTokenizer(self.tokenizer)
        self.template = ChatTemplate(self.tokenizer)
        self.max_model_len = model_context(path)
        self.parse_limit = max(MIN_PARSE_LIMIT, PARSE_BYTES_PER_TOKEN * self.max_model_len)
        self._pool = TextPool(workers, max_pending)

    async def prompts(self, path: str, raw: bytes, schemes: Callable[[], set[Scheme]]) -> Prompts | None:
        """The request's prompts, tokenised once, from a worker thread with their keys for each of
        `schemes()` computed there too; a small body on the event loop, its keys left to be computed as the
        policy asks for them. None when the body does not parse, or the pool is too busy to predict."""
        job: Callable[[str, Any, set[Scheme]], Prompts | None] = self._prepare
        arg: Any = raw
        if len(raw) <= INLINE_BYTES:
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):  # not JSON (or nested past the parser): the pod answers
                return None
            if path.endswith("/chat/completions") or _one_prompt(body):
                return self.read(path, body)
            job, arg = self._prepare_body, body  # parsed once
        try:
            return await self._pool.prepare(job, path, arg, schemes())
        except Busy:
            log.debug("prompt pool busy: %s routed by load", path)
            return None

    def close(self) -> None:
        self._pool.shutdown()

    def _prepare(self, path: str, raw: bytes, schemes: set[Scheme]) -> Prompts | None:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON (or nested past the parser): the pod answers
            return None
        return self._prepare_body(path, body, schemes)

    def _prepare_body(self, path: str, body: Any, schemes: set[Scheme]) -> Prompts | None:
        return self._keyed(self.read(path, body), schemes)

    @staticmethod
    def _keyed(prompts: Prompts | None, schemes: set[Scheme]) -> Prompts | None:
        """`prompts` with their block keys computed for each of `schemes`."""
        if prompts is not None:
            for scheme in schemes:
                prompts.block_keys(scheme)
        return prompts

    def read(self, path: str, body: Any) -> Prompts | None:
        if not isinstance(body, dict):
            return None
        model = body.get("model") if isinstance(body.get("model"), str) else None
        try:
            if path.endswith("/chat/completions"):
                chat, salt = chat_prompt(body)
                # chat.render(tokenizer), the daemon's, rendered from the template compiled once (chat_template.py)
                text = self.template.render(
                    chat.messages, chat.add_generation_prompt, chat.tools, chat.continue_final_message
                )
                return Prompts([self.encoder.encode(text)], salt, self.max_model_len, model)
            read = completion_prompts(body)
            if read is None:
                # The daemon computes every prompt position for prompt logprobs, cache or not: no prefix to
                # route by, and predicting a hit would count as a stale prediction.
                return None
            prompts, salt = read
            # (inside the try: a text the tokenizer refuses, a lone surrogate, is the pod's to answer)
            ids = [
                p if isinstance(p, list) else self.encoder.encode(p, add_special_tokens=True) for p in prompts
            ]
        except (ApiError, ValueError, TypeError, KeyError):  # the pod will say what is wrong
            return None
        except Exception:  # noqa: BLE001 - a chat template error: the pod answers it as a 400
            return None
        return Prompts(ids, salt, self.max_model_len, model)


def _one_prompt(body: Any) -> bool:
    """A completion body naming one prompt (a string, a list of token ids, or a list of one string), which
    costs what a chat of its size does; anything else (several prompts, a malformed body) is not."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list):
        return False
    return len(prompt) == 1 and isinstance(prompt[0], str) or all(type(t) is int for t in prompt)
