"""The router's compiled chat template renders exactly what the tokenizer's `apply_chat_template` does:
the default model's template on random chats, and templates that use what transformers gives them
(raise_exception, strftime_now, namespace, tojson, loop controls); a template this environment cannot
compile (`{% generation %}`) or renders differently is left to the tokenizer, and so are chats with tools
or continuing their final message."""

from __future__ import annotations

import copy
import random

import pytest
from transformers import AutoTokenizer

from kvpilot.default_model import ensure_default_model
from kvpilot.router.routing.chat_template import ChatTemplate

PIECES = [
    "Hi",
    " ",
    "\n",
    "\n\n",
    "{{ x }}",
    "{% if %}",
    "<b>",
    "&",
    '"',
    "café",
    "日本",
    "<|im_start|>",
    "  ",
    "\t",
]

RICH = (
    "{%- set ns = namespace(sys=none) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' %}{% set ns.sys = m['content'] %}{% continue %}{% endif -%}"
    "{%- if m['role'] not in ['user', 'assistant', 'tool'] %}{{ raise_exception('bad role') }}{% endif -%}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] | tojson }}<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if ns.sys %}<|im_start|>system\n{{ ns.sys }} {{ strftime_now('%Y') }}<|im_end|>\n{% endif -%}"
    "{%- if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def smollm():
    return AutoTokenizer.from_pretrained(ensure_default_model())


def with_template(tok, source: str):  # noqa: ANN001, ANN201
    t = copy.deepcopy(tok)
    t.chat_template = source
    return t


def random_chat(rng: random.Random) -> list[dict[str, str]]:
    roles = ["user", "assistant"] * rng.randrange(1, 4)
    if rng.random() < 0.6:
        roles = ["system", *roles]
    if rng.random() < 0.3:
        roles = roles[:-1] or ["user"]
    return [
        {"role": r, "content": "".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 30)))}
        for r in roles
    ]


@pytest.mark.parametrize("source", [None, RICH])
def test_compiled_renders_as_apply_chat_template(smollm, source) -> None:  # noqa: ANN001
    tok = smollm if source is None else with_template(smollm, source)
    t = ChatTemplate(tok)
    assert t.compiled
    rng = random.Random(3)
    for i in range(300):
        chat = random_chat(rng)
        gen = bool(i % 2)
        assert t.render(chat, gen) == tok.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=gen
        ), chat


def test_a_bad_role_raises_both_ways(smollm) -> None:  # noqa: ANN001
    tok = with_template(smollm, RICH)
    t = ChatTemplate(tok)
    with pytest.raises(Exception, match="bad role"):
        tok.apply_chat_template([{"role": "nobody", "content": "x"}], tokenize=False)
    with pytest.raises(Exception, match="bad role"):
        t.render([{"role": "nobody", "content": "x"}], True)


def test_what_is_not_compiled_goes_to_the_tokenizer(smollm) -> None:  # noqa: ANN001
    generation = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    tok = with_template(smollm, generation)
    t = ChatTemplate(tok)
    assert not t.compiled
    chat = [{"role": "user", "content": "Hi"}]
    assert t.render(chat, True) == tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


class Differs:
    """A tokenizer whose own render is not the template's (as one that post-processes it would be)."""

    def __init__(self, tok) -> None:  # noqa: ANN001
        self.tok = tok
        self.special_tokens_map = tok.special_tokens_map

    def get_chat_template(self) -> str:
        return self.tok.get_chat_template()

    def apply_chat_template(self, chat, **kw) -> str:  # noqa: ANN001, ANN003
        return self.tok.apply_chat_template(chat, **kw).rstrip("\n")


def test_a_template_that_renders_differently_goes_to_the_tokenizer(smollm) -> None:  # noqa: ANN001
    tok = Differs(smollm)
    t = ChatTemplate(tok)
    assert not t.compiled
    chat = [{"role": "user", "content": "Hi"}]
    assert t.render(chat, False) == tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)


def test_tools_and_continuing_go_to_the_tokenizer(smollm) -> None:  # noqa: ANN001
    t = ChatTemplate(smollm)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    want = smollm.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert t.render(chat, False, continue_final_message=True) == want
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    want = smollm.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
    assert t.render(chat, True, tools=tools) == want
    extra = [{"role": "user", "content": "Hi", "name": "me"}]
    want = smollm.apply_chat_template(extra, tokenize=False, add_generation_prompt=True)
    assert t.render(extra, True) == want


def test_the_loops_attributes_read_as_transformers_sandbox_reads_them() -> None:
    """The router's sandbox reads a `for` loop's public attributes without the sandbox's checks: each
    renders as in jinja's own ImmutableSandboxedEnvironment (methods included); a name starting with `_`
    still goes through the checks, and is refused alike."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from kvpilot.router.routing.chat_template import _Sandbox

    source = (
        "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ loop.first }}{{ loop.last }}"
        "{{ loop.cycle('a', 'b') }}{{ loop.previtem }}{{ loop.nothing_such }}|{% endfor %}"
    )
    theirs, ours = ImmutableSandboxedEnvironment(), _Sandbox()
    messages = ["x", "y", "z"]
    assert ours.from_string(source).render(messages=messages) == theirs.from_string(source).render(
        messages=messages
    )
    for unsafe in (
        "{% for m in messages %}{{ loop._iterator }}{% endfor %}",
        "{% for m in messages %}{{ loop.__class__.__init__ }}{% endfor %}",
    ):
        outcomes = []
        for env in (theirs, ours):
            try:
                outcomes.append(env.from_string(unsafe).render(messages=messages))
            except jinja2.exceptions.SecurityError as exc:
                outcomes.append(type(exc).__name__)
        assert outcomes[0] == outcomes[1], outcomes
