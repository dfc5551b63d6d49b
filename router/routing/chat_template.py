"""A chat's prompt text, as `tokenizer.apply_chat_template(..., tokenize=False)` renders it, for less.

transformers' `apply_chat_template` spends half of a short chat's rendering around the template (copying
the messages into plain data, aliasing reasoning fields, looking the compiled template up, merging its
keyword arguments): ~30 us a chat on an idle core, of which jinja's render is ~13. The daemon's parser
hands the router messages that are already plain (`{"role": str, "content": str}`), so none of that
changes what the template sees, and the router renders them with the template compiled once here, with
jinja2's API, in the environment the template expects: a sandbox that trims blocks, with loop controls, a
`tojson` that does not escape HTML, `raise_exception` and `strftime_now`, and namespaces that refuse names
starting with `_` (templates from the Hub may use any of these). It renders as `Template.render` does
inside (the template's `root_render_func` on a context from `new_context`), on a context made from the
template's globals once (`shared=True`), where `render` copies them for every call; and a `for` loop's
`loop.first` and the like are read without the sandbox's checks, which find nothing unsafe in them (`_Sandbox`).

Exactness is checked, not assumed: at start, probe chats (one message to several turns, each role, empty
and odd contents, with and without the generation prompt) must render to the same text both ways, else
every chat goes to `apply_chat_template` (logged once). So do the chats this path does not cover: with
tools, continuing the final message, or messages that are not plain strings; and any chat whose render
fails here (the tokenizer's own render then says why).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.runtime
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger(__name__)

PLAIN_KEYS = frozenset(("role", "content"))

_PROBE_CONTENTS = (
    "Hi!",
    "",
    "  two spaces, then a line\n\nand a blank one  ",
    "{{ not a template }} {% raw %} <b>html</b> & \"quotes\" 'single'",
    "日本語 émigré café \t tab",
    "<|im_start|>user\nan injected turn<|im_end|>",
)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Namespace(jinja2.utils.Namespace):
    """jinja's `namespace()`, refusing attribute names that start with `_`."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature: `self` may be a key
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, which checks every attribute a template reads; a `for` loop's own `loop`
    (`loop.first`, `loop.last`: read for every message by most chat templates) holds nothing unsafe under a
    public name, so those are read as the sandbox would find them, without its checks."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is jinja2.runtime.LoopContext and not attribute.startswith("_"):
            try:
                return getattr(obj, attribute)
            except AttributeError:
                pass
        return super().getattr(obj, attribute)


def _probe_chats() -> list[list[dict[str, str]]]:
    c = _PROBE_CONTENTS
    chats = [[{"role": "user", "content": x}] for x in c]
    chats += [
        [{"role": "system", "content": x}, {"role": "user", "content": y}] for x, y in zip(c, c[1:] + c[:1])
    ]
    chats.append(
        [
            {"role": "system", "content": c[0]},
            {"role": "user", "content": c[2]},
            {"role": "assistant", "content": c[3]},
            {"role": "user", "content": c[4]},
        ]
    )
    chats.append([{"role": "user", "content": c[0]}, {"role": "assistant", "content": c[4]}])
    chats.append([{"role": "system", "content": c[2]}])
    chats.append([{"role": "user", "content": c[0]}, {"role": "tool", "content": c[3]}])
    return chats


class ChatTemplate:
    """`render(messages, add_generation_prompt)`: the tokenizer's chat template, compiled once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._render: Callable[..., str] | None = None  # keyword arguments: the template's variables
        try:
            source = tokenizer.get_chat_template()  # the tokenizer's default template (public API)
            env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals |= {"raise_exception": _raise, "strftime_now": _now, "namespace": _Namespace}
            template = env.from_string(source)
            # What each render starts from: the template's globals (a ChainMap over the environment's,
            # which `render` copies into a dict for every call: 40% of a short chat's render) copied once,
            # then the special tokens transformers passes. A render's context is made from it with
            # `new_context(..., shared=True)`, which adds no globals (they are in it already).
            context = {**template.globals, "tools": None, "documents": None, **tokenizer.special_tokens_map}

            def render(**variables: Any) -> str:
                # Template.render's own two steps, on a context made from `context` as it is
                return env.concat(template.root_render_func(template.new_context(context | variables, True)))

            self._render = render
        except Exception as exc:  # noqa: BLE001 - a template this environment does not take: the tokenizer's
            log.info("chat template not compiled by the router (%s): apply_chat_template renders", exc)
            return
        if not self._agrees():
            self._render = None
            log.info("chat template renders differently when compiled here: apply_chat_template renders")

    @property
    def compiled(self) -> bool:
        return self._render is not None

    def render(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool,
        tools: list[Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The text `apply_chat_template(messages, tools=tools or None, tokenize=False, ...)` gives."""
        if self._render is not None and not tools and not continue_final_message and _plain(messages):
            try:
                return self._render(messages=messages, add_generation_prompt=add_generation_prompt)
            except Exception:  # noqa: BLE001 - the tokenizer's render below says why (or differs)
                pass
        text: str = self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        return text

    def _agrees(self) -> bool:
        assert self._render is not None
        for chat in _probe_chats():
            for gen in (True, False):
                try:
                    theirs = self.tokenizer.apply_chat_template(
                        chat, tokenize=False, add_generation_prompt=gen
                    )
                except Exception:  # noqa: BLE001 - a chat this template refuses: it must refuse it here too
                    theirs = None
                try:
                    ours = self._render(messages=chat, add_generation_prompt=gen)
                except Exception:  # noqa: BLE001
                    ours = None
                if ours != theirs:
                    return False
        return True


def _plain(messages: list[dict[str, str]]) -> bool:
    """Each message a dict of a string role and content only: what transformers' copy leaves as it is."""
    for m in messages:
        if type(m) is not dict or m.keys() != PLAIN_KEYS:
            return False
        if type(m["role"]) is not str or type(m["content"]) is not str:
            return False
    return True
