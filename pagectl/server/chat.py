"""Chat requests: messages (text parts, assistant tool calls, tool results), the template
that renders them (sandboxed, see ``chat_template.py``) and the daemon's chat options.

Which template renders a request: its own ``chat_template`` (or
``chat_template_kwargs.chat_template``) when the daemon runs with
``--trust-request-chat-template`` (else 400), then the daemon's ``--chat-template``, then
the tokenizer's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagectl.server import chat_template
from pagectl.server.errors import bad_request
from pagectl.server.json_fields import get_bool

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 1024
# chat_template_kwargs a client may not set: the server fills them.
_RESERVED_KWARGS = ("messages", "tools", "documents", "add_generation_prompt")
# Arguments of transformers' ``apply_chat_template`` call: clients send them out of habit,
# and a template variable of that name would silently mean nothing, so they are refused.
_CALL_ARGUMENTS = frozenset(
    {
        "conversation",
        "tokenize",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)


@dataclass
class ChatSettings:
    """The daemon's chat options (vLLM's flag names)."""

    # --chat-template (its text); None: the tokenizer's own.
    chat_template: str | None = None
    # --trust-request-chat-template: a request may bring its own template.
    trust_request_chat_template: bool = False
    # --enable-auto-tool-choice and --tool-call-parser NAME.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # --reasoning-parser NAME (qwen3, deepseek_r1).
    reasoning_parser: str | None = None


def _text(content: Any, where: str) -> str | None:
    if content is None:
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(
                    f"{where}.content[{j}]: only text content parts are "
                    f"supported by pagectl, not {json.dumps(kind)}",
                    "messages",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{where}.content[{j}] needs a string `text`", "messages")
            parts.append(text)
        return "".join(parts)
    raise bad_request(f"{where}.content must be a string or a list of parts", "messages")


def _tool_calls(value: Any, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise bad_request(f"{where}.tool_calls must be a list", "messages")
    out = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(
                f"{where}.tool_calls[{j}] needs function.name and function.arguments", "messages"
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            # Templates index and iterate the arguments: give them the object.
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise bad_request(
                    f"{where}.tool_calls[{j}].function.arguments is not valid JSON", "messages"
                ) from None
        out.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return out


def parse_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list", "messages")
    if len(value) > MAX_MESSAGES:
        raise bad_request(f"at most {MAX_MESSAGES} messages per request", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(
                f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)}",
                "messages",
            )
        text = _text(m.get("content"), where)
        msg: dict[str, Any] = {"role": role, "content": text if text is not None else ""}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise bad_request(f"{where}: only assistant messages carry tool_calls", "messages")
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
            if text is None:
                msg["content"] = None
        if role == "tool":
            tid = m.get("tool_call_id")
            if tid is not None and not isinstance(tid, str):
                raise bad_request(f"{where}.tool_call_id must be a string", "messages")
            msg["tool_call_id"] = tid
        if isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        out.append(msg)
    return out


def _template_source(
    body: dict, kwargs: dict, settings: ChatSettings, tokenizer: Any, has_tools: bool
) -> str:
    own = body.get("chat_template")
    if own is None:
        own = kwargs.get("chat_template")
        param = "chat_template_kwargs"
    else:
        param = "chat_template"
    if own is not None:
        if not settings.trust_request_chat_template:
            raise bad_request(
                f"a per-request chat template (`{param}`) is refused: the daemon does not run "
                "with --trust-request-chat-template",
                param,
            )
        if not isinstance(own, str) or not own:
            raise bad_request("chat_template must be a non-empty string", param)
        return own
    if settings.chat_template is not None:
        return settings.chat_template
    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so chat is not available", "messages")
    source = chat_template.model_template(tokenizer, has_tools)
    if not source:
        raise bad_request(
            "this model's tokenizer has no chat template; start the daemon with "
            "--chat-template FILE",
            "messages",
        )
    return source


def render_messages(
    messages: list[dict],
    tokenizer: Any,
    body: dict,
    settings: ChatSettings,
    tools: list[dict] | None = None,
) -> tuple[list[int], str]:
    """Token ids and text of the rendered conversation (runs in a worker thread)."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    for key in _RESERVED_KWARGS:
        if key in kwargs:
            raise bad_request(
                f"chat_template_kwargs.{key} is set by the server; send it as a request field",
                "chat_template_kwargs",
            )
    call_args = sorted(_CALL_ARGUMENTS.intersection(kwargs))
    if call_args:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(call_args)} (arguments of the "
            "template call, not template variables)",
            "chat_template_kwargs",
        )
    add_gen = get_bool(body, "add_generation_prompt", True)
    cont = get_bool(body, "continue_final_message", False)
    if cont and add_gen and body.get("add_generation_prompt") is not None:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true",
            "continue_final_message",
        )
    if cont:
        add_gen = False
        if messages[-1]["role"] != "assistant":
            raise bad_request(
                "continue_final_message needs the last message to be the assistant's",
                "continue_final_message",
            )
    documents = body.get("documents")
    if documents is not None and not (
        isinstance(documents, list) and all(isinstance(d, dict) for d in documents)
    ):
        raise bad_request("documents must be a list of objects", "documents")
    source = _template_source(body, kwargs, settings, tokenizer, bool(tools))
    variables = chat_template.template_variables(tokenizer)
    variables.update({k: v for k, v in kwargs.items() if k != "chat_template"})
    variables.update(
        messages=messages,
        tools=tools or None,
        documents=documents,
        add_generation_prompt=add_gen,
    )
    try:
        text = chat_template.render(source, variables)
    except chat_template.TemplateError as e:
        raise bad_request(f"cannot apply the chat template: {e}", "messages") from None
    if cont:
        final = messages[-1].get("content") or ""
        end = text.rfind(final) if final else -1
        if final and end < 0:
            raise bad_request(
                "continue_final_message: the template does not show the final message as is",
                "continue_final_message",
            )
        if final:
            text = text[: end + len(final)]
    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so chat is not available", "messages")
    add_special = get_bool(body, "add_special_tokens", False)
    ids = list(tokenizer.encode(text, add_special_tokens=add_special))
    if not ids:
        raise bad_request("the rendered prompt is empty", "messages")
    return ids, text
