"""Chat templates, rendered as transformers' `apply_chat_template` renders them: `LLM.chat` and the server's
/v1/chat/completions turn a conversation into a prompt here (jinja2: `pip install gdn-jax[tokenizers]`).

    template = ChatTemplate.from_folder(folder)           # chat_template.jinja, else tokenizer_config.json's
    prompt = template.render([{"role": "user", "content": "Hi"}], chat_template_kwargs={"enable_thinking": False})
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from gdn_jax.config import folder_file, folder_json

CHAT_ROLES = ("system", "developer", "user", "assistant")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _template_and_file(folder: str | Path | None) -> tuple[str, Path] | None:
    """(the folder's chat template, the file it is in), or None (`load_chat_template`)."""
    if folder is None or not Path(folder).is_dir():
        return None
    path = Path(folder)
    jinja = folder_file(path, "chat_template.jinja")
    if jinja is not None:
        try:
            return jinja.read_text(encoding="utf-8"), jinja
        except UnicodeDecodeError as e:
            raise ValueError(f"{jinja} is not UTF-8 text ({e})") from None
    config = path / "tokenizer_config.json"
    tpl = folder_json(path, config.name).get("chat_template")
    if isinstance(tpl, list):  # named templates: [{"name": ..., "template": ...}, ...]
        if not all(isinstance(t, dict) for t in tpl):
            raise ValueError(f"{config}: chat_template must be a string or a list of {{\"name\", \"template\"}} "
                             f"objects, got {tpl!r:.200}")
        tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
    return (tpl, config) if isinstance(tpl, str) else None


def load_chat_template(folder: str | Path | None) -> str | None:
    """`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string, or the `default` entry)."""
    found = _template_and_file(folder)
    return None if found is None else found[0]


def load_special_tokens(folder: str | Path | None) -> dict[str, str]:
    """The special tokens transformers gives a chat template (`bos_token`, `eos_token`, ...): those
    `tokenizer_config.json` sets, as a string or an added-token object's `content`; one unset or null is left out
    (undefined in the template)."""
    data = folder_json(folder, "tokenizer_config.json")
    tokens = {}
    for name in SPECIAL_TOKENS:
        value = data.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def compile_chat_template(source: str):
    """A chat template compiled as transformers' `apply_chat_template` compiles it: a sandboxed environment with
    `trim_blocks` and `lstrip_blocks`, jinja's loop controls (`{% break %}`, `{% continue %}`), the `{% generation %}`
    tag (it marks assistant text for training masks; rendered as its body), `raise_exception(message)` (a
    `TemplateError` with the template's message), `strftime_now(format)`, and a `tojson` that keeps non-ASCII text,
    neither escapes HTML characters nor sorts keys, and takes `indent`, `separators` and `sort_keys`."""
    try:
        from jinja2 import TemplateError, TemplateSyntaxError, nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ImportError(f"chat templates need jinja2: pip install 'gdn-jax[tokenizers]' ({e})") from None

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateSyntaxError as e:  # one line naming where, not a traceback (the CLI reports ValueErrors)
        raise ValueError(f"the chat template does not parse (line {e.lineno}): {e.message}") from None


def chat_message(i: int, m: Any) -> dict:
    """Message `i` of a conversation as the chat template reads it: a dict with a known role and text content (text
    parts joined by newlines), and a `name` if it has one. An assistant message's content may be null (the reasoning
    parser's replies have it when they hold no text after the think block): empty text, as vLLM reads it. Anything
    else is a ValueError naming the message."""
    if not isinstance(m, dict):
        raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
    role = m.get("role")
    if m.get("tool_calls"):  # a prompt without them would not be the conversation that was sent
        raise ValueError(f"messages[{i}].tool_calls: tool calls are not supported")
    if role not in CHAT_ROLES:
        raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)} (tools are not supported), "
                         f"got {role!r}")
    content = m.get("content")
    content = "" if content is None and role == "assistant" else content
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ValueError(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                             f"supported")
        content = "\n".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ValueError(f"messages[{i}].content must be a string or a list of text parts, got "
                         f"{json.dumps(content, default=str)[:80]}")
    name = m.get("name")
    return {"role": role, "content": content, **({"name": name} if name is not None else {})}


def _mode(kwargs: dict, name: str, default: bool) -> bool:
    """kwargs.pop(name, default), which must be a bool: a string such as "false" would read as true."""
    value = kwargs.pop(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def chat_modes(add_generation_prompt: bool, continue_final_message: bool, chat_template_kwargs: dict | None
               ) -> tuple[bool, bool, dict]:
    """(add_generation_prompt, continue_final_message, the other template variables): as vLLM does, the two modes
    given in `chat_template_kwargs` win over the arguments of the same name. Both true is a ValueError: the first
    opens a new assistant turn, the second continues the last message."""
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict of template variables, got {chat_template_kwargs!r}")
    kwargs = dict(chat_template_kwargs or {})
    if not all(isinstance(name, str) for name in kwargs):
        raise ValueError(f"chat_template_kwargs: the names of template variables must be strings, got "
                         f"{[name for name in kwargs if not isinstance(name, str)]!r}")
    add_generation_prompt = _mode(kwargs, "add_generation_prompt", add_generation_prompt)
    continue_final_message = _mode(kwargs, "continue_final_message", continue_final_message)
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true: the first opens a "
                         "new assistant turn, the second continues the last message")
    return add_generation_prompt, continue_final_message, kwargs


class ChatTemplate:
    """A compiled chat template and the special tokens it is given (`load_special_tokens`)."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = compile_chat_template(source)

    @classmethod
    def from_folder(cls, folder: str | Path | None, source: str | None = None) -> "ChatTemplate | None":
        """The folder's template (`source` instead, if given) with its special tokens; None if it has none."""
        if source is not None:
            return cls(source, load_special_tokens(folder))
        found = _template_and_file(folder)
        if found is None:
            return None
        try:
            return cls(found[0], load_special_tokens(folder))
        except ValueError as e:  # which file held it
            raise ValueError(f"{found[1]}: {e}") from None

    def render(self, messages: list, add_generation_prompt: bool = True, continue_final_message: bool = False,
               chat_template_kwargs: dict | None = None) -> str:
        """The prompt text of a conversation (a list of message dicts, `chat_message`). `add_generation_prompt`
        opens the assistant's turn; `continue_final_message` instead ends the text right after the last message's
        content, so that the model continues that message (its end-of-turn left out, as transformers does).
        `chat_template_kwargs` are more template variables (Qwen3.5's `enable_thinking`, ...); an
        `add_generation_prompt` or `continue_final_message` among them wins over the argument (`chat_modes`). A
        template's own error (`raise_exception`, an undefined operation) is a ValueError carrying its message."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of message dicts")
        messages = [chat_message(i, m) for i, m in enumerate(messages)]
        add_generation_prompt, continue_final_message, kwargs = chat_modes(
            add_generation_prompt, continue_final_message, chat_template_kwargs)
        variables = {"add_generation_prompt": add_generation_prompt, **self.special_tokens, **kwargs,
                     "messages": messages}
        try:
            text = self._template.render(variables)
        except Exception as e:  # noqa: BLE001 - a template error is the conversation's (or the template's) problem
            raise ValueError(f"the chat template failed on these messages: {e}") from None
        if continue_final_message:
            # transformers' cut: the last occurrence of the final message's stripped text (templates may strip it),
            # its trailing whitespace kept where the template kept it
            final = messages[-1]["content"]
            if not final.strip():
                raise ValueError("continue_final_message: the final message has no text to continue")
            at = text.rfind(final.strip())
            if at < 0:
                raise ValueError("continue_final_message: the rendered conversation does not contain the final "
                                 "message's text")
            kept = final.lstrip()
            return text[:at + (len(kept) if text.startswith(kept, at) else len(final.strip()))]
        return text


__all__ = ["CHAT_ROLES", "ChatTemplate", "chat_message", "chat_modes", "compile_chat_template",
           "load_chat_template", "load_special_tokens"]
