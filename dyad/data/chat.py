"""A checkpoint's chat template, rendered as transformers renders it, and where the assistant
turns lie in the rendered text.

The template is read from the directory of `data.tokenizer`: `chat_template.jinja` there, else
`tokenizer_config.json`'s `chat_template` (a string, or a list of named templates: "default").
It is rendered with jinja2 in the environment `transformers.PreTrainedTokenizerBase.
apply_chat_template` builds (a sandbox with `trim_blocks` and `lstrip_blocks`, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that does not escape HTML), with the tokenizer
config's named special tokens (`bos_token`, `eos_token`, ...) as variables, so the text is the one
`apply_chat_template(messages, tokenize=False)` returns.

Messages reach the template with string content; an image is dyad's `<image>` placeholder inside
that string (a special token of dyad's tokenizer), never a template's own image markup: dyad's
LLM checkpoints are text models, whose templates render text only, and the encoder's rows take the
placeholder's place however the template would have marked an image.

An assistant turn's targets start where the conversation before it, rendered with
`add_generation_prompt`, ends (so a template's own output before the content, such as Qwen3's empty
`<think>` block, is learned too), and end after the content and, past whitespace, the special token
that follows it (`<|im_end|>`, `<|eot_id|>`, `</s>`): the model learns to end its turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# transformers' `SPECIAL_TOKENS_ATTRIBUTES`: the variables a template sees besides the messages.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask blocks): the body."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """transformers' namespace: no underscore-prefixed attributes."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot store {name!r} on a namespace")


class _Dict:
    """transformers' `dict` for templates: a call and `fromkeys`, no attribute access to the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # a serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # the template's jinja text
    variables: dict[str, str]  # the named special tokens
    end_tokens: tuple[str, ...]  # special tokens that may close an assistant turn, longest first

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = False) -> str:
        return _compiled(self.source).render(messages=list(messages), tools=None, documents=None,
                                             add_generation_prompt=add_generation_prompt, **self.variables)

    def assistant_spans(self, messages: Sequence[dict], text: str) -> list[tuple[int, int]]:
        """The character spans [start, end) of `text` (the rendered `messages`) that are the
        assistant turns' targets; a ValueError where a turn cannot be located."""
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:k], add_generation_prompt=True)
            if not text.startswith(prompt):
                raise ValueError(f"the chat template renders the conversation before message {k + 1} (an assistant "
                                 "turn), with its generation prompt, as other than the start of the whole "
                                 "conversation, so the turn cannot be located")
            content = message["content"].strip()
            found = text.find(content, len(prompt))
            if found < 0:
                raise ValueError(f"the chat template does not render message {k + 1}'s content (an assistant turn) "
                                 "verbatim, so its tokens cannot be located")
            end = found + len(content)
            after = len(text) - len(text[end:].lstrip())
            closing = next((t for t in self.end_tokens if text.startswith(t, after)), None)
            spans.append((len(prompt), after + len(closing) if closing else end))
        return spans


_COMPILED: dict[str, jinja2.Template] = {}


def _compiled(source: str) -> jinja2.Template:
    if source not in _COMPILED:
        _COMPILED[source] = _environment().from_string(source)
    return _COMPILED[source]


def load_chat_template(tokenizer_path: str | Path, special_tokens: Sequence[str]) -> ChatTemplate:
    """The chat template beside `tokenizer_path` (`data.tokenizer`); `special_tokens`: the
    tokenizer's, of which those in the template's output may close a turn."""
    directory = Path(tokenizer_path).parent
    config_path = directory / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"data.tokenizer: cannot read {config_path}: {e}") from None
    jinja_path = directory / "chat_template.jinja"
    source = jinja_path.read_text(encoding="utf-8") if jinja_path.is_file() else config.get("chat_template")
    if isinstance(source, list):
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str) or not source:
        raise ValueError(f"data.tokenizer: no chat template in {directory} (chat_template.jinja, or "
                         "tokenizer_config.json's chat_template), which data.name 'conversations' renders with")
    try:
        _compiled(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"data.tokenizer: the chat template in {directory} does not parse: {e}") from None
    variables = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name)))}
    end_tokens = tuple(sorted((t for t in special_tokens if t in source or t in variables.values()),
                              key=len, reverse=True))
    return ChatTemplate(source=source, variables=variables, end_tokens=end_tokens)
