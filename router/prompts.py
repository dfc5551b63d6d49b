"""A request's prompt token ids, exactly as the daemon will see them (same tokenizer, same template).

Validation stays with the daemon: the router reads the body with the daemon's own parsers and, where a
body does not parse, routes without a prediction and lets the pod answer the 4xx.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from kvpilot.daemon.engine.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from kvpilot.daemon.server.protocol import ApiError, parse_chat, parse_completion


@dataclass(frozen=True, slots=True)
class Prompts:
    token_ids: list[list[int]]  # one list per prompt of the request
    cache_salt: str | None


def tokenizer_dir(model: str | None) -> Path:
    """`--model` as `kvpilot serve` reads it: a checkpoint directory, or the embedded default model."""
    if model is None or model == DEFAULT_MODEL_NAME:
        return ensure_default_model()
    path = Path(model).expanduser()
    if not (path / "tokenizer_config.json").is_file() and not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"--model {model!r}: no tokenizer in this directory")
    return path


class PromptReader:
    def __init__(self, model: str | None) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(model))

    def read(self, path: str, body: Any) -> Prompts | None:
        if not isinstance(body, dict):
            return None
        served = [body["model"]] if isinstance(body.get("model"), str) else []
        tok = self.tokenizer
        try:
            if path.endswith("/chat/completions"):
                chat = parse_chat(body, served)
                text = chat.render(tok)
                return Prompts([tok.encode(text, add_special_tokens=False)], chat.generate.cache_salt)
            req = parse_completion(body, served)
        except (ApiError, ValueError, TypeError, KeyError):  # the pod will say what is wrong
            return None
        except Exception:  # noqa: BLE001 - a chat template error: the pod answers it as a 400
            return None
        if req.params.prompt_logprobs is not None:
            # The daemon computes every prompt position for prompt logprobs, cache or not: no prefix to
            # route by, and predicting a hit would count as a stale prediction.
            return None
        ids = [p if isinstance(p, list) else tok.encode(p, add_special_tokens=True) for p in req.prompts]
        return Prompts(ids, req.cache_salt)
