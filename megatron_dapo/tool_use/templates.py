"""Tool-call templates: where a policy turn's Python call ends, and the text its sandbox output comes back as.

One rollout with tools is one token sequence the engine extends turn by turn:

    prompt | policy turn ending in a call | output_ids(output) | policy turn ... | final answer <eos>

A policy turn is generated until a stop string (`ToolTemplate.stop`) or stop token (`stop_token_ids`) ends it; the
token that completes the stop is kept as the turn's last token (SGLang's rule). `find_call` reads the code off the
turn's decoded text; the caller runs it and appends `output_ids(tokenizer, output)`: `render_output(output)` tokenized
once, on its own. Those ids are the tool's, masked out of the loss; every other response token is the policy's. The
conversation is never re-tokenized, so the policy is trained on exactly the ids it sampled (tokenizing the whole text
again may merge tokens across a turn's boundary; docs/TOOL_TEMPLATES.md).

Templates, chosen by name (`tool_template`; docs/TOOL_TEMPLATES.md):
  code_fence  ```python fences inside one assistant message, ```output blocks appended (ReTool, ToRL); any tokenizer
              that can write a backtick.
  qwen        Qwen2.5 / Qwen3's <tool_call> JSON </tool_call>; the output is a `tool` message as the tokenizer's own
              chat template renders it (a user turn of <tool_response>).
  smollm2     SmolLM2-Instruct, which has no tool format: ```python fences, the output a `tool` message of its ChatML
              template.
The chat-template text around the output is derived from the tokenizer's own template when the template is built
(`output_frame`), never written by hand, and checked to extend the generation prompt.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_dapo.dotted_path import Registry
from megatron_dapo.errors import UserError

TOOL_TEMPLATE_SIGNATURE = "fn(tokenizer) -> ToolTemplate"
TEMPLATES = Registry("--tool-template", TOOL_TEMPLATE_SIGNATURE, "megatron_dapo.tool_use")
"""The tool templates by name: each of megatron_dapo/tool_use/ registered with `@TEMPLATES.register`. Its `flag` is
the one place the flag that chooses them is named (messages read it from there)."""

CODE_OPEN = "```python\n"
"""Opens a fenced call. A call is only a ```python fence: a bare ``` fence in an answer is text."""
CODE_CLOSE = "\n```\n"
"""Closes a fenced call, and is its stop string. The newline after the fence is part of it: "\\n```" alone is a prefix
of the opening "\\n```python", and a stop string fires on the opening fence as soon as its "```" is decoded, before
the engine has seen "python" (a stop cannot look ahead)."""
OUTPUT_OPEN = "```output\n"
"""Opens the output block of `code_fence` (ToRL's format: the block follows the closing fence's newline)."""
TOOL_ROLE = "tool"
"""The message role the output is rendered as through a chat template (Qwen's template turns it into a user turn)."""
_SENTINEL = "TOOLOUTPUTSENTINEL"
"""Stands for the output when a chat template is rendered to find the text around it (one word: survives |trim)."""


@dataclass(frozen=True, kw_only=True)
class ToolTemplate:
    """How one chat format writes a Python tool call and takes the output back (module docstring)."""

    name: str
    """The registered name (`TEMPLATES`)."""
    stop: tuple[str, ...]
    """Stop strings (SGLang's `stop`): generation ends once the decoded turn contains one; the token that completes it
    is the turn's last. Each closes a call: `find_call` looks for the call that the last of them ends."""
    stop_token_ids: tuple[int, ...] = ()
    """Single tokens that end a call (Qwen's </tool_call>), kept as the turn's last token; may be empty."""
    call_open: str
    """The text that opens a call ("```python\\n", "<tool_call>"); the call's body lies between it and the stop."""
    output_prefix: str
    """Appended before the output: closes the policy's turn and opens the tool's, as the chat format needs."""
    output_suffix: str
    """Appended after the output: closes the tool's turn and reopens the policy's (the generation prompt)."""
    parse_call: Callable[[str], str | None]
    """The call's body (between `call_open` and the stop) -> its Python code, or None when malformed."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not self.stop or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"ToolTemplate {self.name!r}: stop must be non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"ToolTemplate {self.name!r}: stop_token_ids must be non-negative ints, "
                             f"got {self.stop_token_ids!r}")
        if not self.call_open:
            raise ValueError(f"ToolTemplate {self.name!r}: call_open must be a non-empty string")

    def find_call(self, turn_text: str) -> str | None:
        """The code of the call that ends `turn_text` (a turn's decoded text), or None: no stop in it, text after the
        last stop (the turn was an answer), no `call_open` before it, or a body `parse_call` rejects. Of two calls,
        the last. A scan with str.rfind, no regular expression: linear in len(turn_text) on any input."""
        end, close = -1, ""
        for stop in self.stop:
            at = turn_text.rfind(stop)
            if at > end:
                end, close = at, stop
        # The stop's token may carry trailing whitespace ("`\n\n"); byte-level BPE never puts a newline and a
        # non-space in one token, so anything else after the stop means the model went on: not a call.
        if end < 0 or turn_text[end + len(close):].strip():
            return None
        start = turn_text.rfind(self.call_open, 0, end)
        if start < 0:
            return None
        body = turn_text[start + len(self.call_open):end]
        if any(stop in body for stop in self.stop):  # an earlier close: the last stop closes no call of its own
            return None
        return self.parse_call(body)

    def render_output(self, output: str) -> str:
        """The exact text appended after a call: `output_prefix` + output + `output_suffix`. `output` is the sandbox's
        text for the policy (stdout or the error), truncated by the caller."""
        if not isinstance(output, str):
            raise TypeError(f"ToolTemplate {self.name!r}: output must be a str, got {type(output).__name__}")
        return self.output_prefix + output + self.output_suffix

    def output_ids(self, tokenizer: Any, output: str) -> list[int]:
        """`render_output(output)` tokenized once, without BOS/EOS: the ids appended after the call's last token, all
        the tool's (masked out of the loss). Special-token text is parsed as that token, as the chat template's
        `apply_chat_template(tokenize=True)` does (an output printing "<|im_end|>" gets the real token)."""
        return list(tokenizer.encode(self.render_output(output), add_special_tokens=False))


def tool_template(name: str, tokenizer: Any) -> ToolTemplate:
    """The tool template `name` (a registered name or a dotted path to fn(tokenizer) -> ToolTemplate) built for
    `tokenizer`; UserError (a ValueError) naming the valid names for an unknown one."""
    template = TEMPLATES.resolve(name)(tokenizer)
    if not isinstance(template, ToolTemplate):
        raise UserError(f"{TEMPLATES.flag} {name!r} returned a {type(template).__name__}, not a ToolTemplate "
                        f"({TOOL_TEMPLATE_SIGNATURE})")
    return template


def fenced_code(body: str) -> str:
    """A ```python fence's body is its code, as written."""
    return body


def python_tool_call(body: str) -> str | None:
    """arguments.code of a Qwen tool call's JSON body {"name": "python", "arguments": {"code": "..."}}, or None for
    bad JSON (parsed strictly by json.loads, never evaluated), another tool's name, or arguments without a string
    code."""
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: a body of 100 k '[' nests past the parser's stack
        return None
    if not isinstance(call, dict) or call.get("name") != "python":
        return None
    arguments = call.get("arguments")
    if not isinstance(arguments, dict) or not isinstance(arguments.get("code"), str):
        return None
    return arguments["code"]


def _check_writes(tokenizer: Any, text: str, name: str) -> None:
    """UserError unless `tokenizer` encodes and decodes `text` back unchanged (a char tokenizer without '`' cannot)."""
    back = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))
    if back != text:
        raise UserError(f"{TEMPLATES.flag} {name}: the tokenizer cannot write {text!r} (it decodes back as {back!r}): "
                        "it needs '`' (the demo's char tokenizer has none)")


def output_frame(tokenizer: Any, call_message: dict, call_end: str, name: str) -> tuple[str, str]:
    """(output_prefix, output_suffix): the text the tokenizer's own chat template renders between the end of an
    assistant message with a call (`call_message`, whose rendering ends in `call_end`) and the output, and from the
    output to the next generation prompt, when a `tool` message follows. UserError when the tokenizer has no chat
    template, the template drops the call or the tool message, or the history does not extend the generation prompt
    (then prompt + the model's ids + output_ids would not be the template's rendering)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{TEMPLATES.flag} {name}: the tokenizer has no chat template to render the tool's turn with")
    user = {"role": "user", "content": "question"}
    prompt = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    text = tokenizer.apply_chat_template([user, call_message, {"role": TOOL_ROLE, "content": _SENTINEL}],
                                         tokenize=False, add_generation_prompt=True)
    where = f"{TEMPLATES.flag} {name}: the tokenizer's chat template"
    if text.count(_SENTINEL) != 1:
        raise UserError(f"{where} does not render a {TOOL_ROLE!r} message's content once")
    at = text.index(_SENTINEL)
    end = text.rfind(call_end, 0, at)
    if end < 0:
        raise UserError(f"{where} does not render the assistant's call (no {call_end!r} before the tool's output)")
    if not text.startswith(prompt):
        raise UserError(f"{where} renders the conversation's history differently from its generation prompt")
    return text[end + len(call_end):at], text[at + len(_SENTINEL):]


@TEMPLATES.register("code_fence", help="```python fences, ```output blocks appended (ToRL); any tokenizer")
def code_fence(tokenizer: Any) -> ToolTemplate:
    """```python\\n<code>\\n```\\n in the response, then ```output\\n<output>\\n```\\n appended: all inside one
    assistant message, no chat template needed. UserError when the tokenizer cannot write the fences."""
    _check_writes(tokenizer, CODE_OPEN + "print(1)" + CODE_CLOSE + OUTPUT_OPEN + "1" + CODE_CLOSE, "code_fence")
    return ToolTemplate(name="code_fence", stop=(CODE_CLOSE,), call_open=CODE_OPEN, output_prefix=OUTPUT_OPEN,
                        output_suffix=CODE_CLOSE, parse_call=fenced_code)


QWEN_CALL_OPEN, QWEN_CALL_CLOSE = "<tool_call>", "</tool_call>"


@TEMPLATES.register("qwen", help="Qwen2.5 / Qwen3 <tool_call> JSON, output as a <tool_response> turn")
def qwen(tokenizer: Any) -> ToolTemplate:
    """<tool_call>\\n{"name": "python", "arguments": {"code": "..."}}\\n</tool_call>, stopped by the </tool_call>
    token (151658 in Qwen2.5); the output is rendered as the tokenizer's chat template renders a `tool` message
    (Qwen2.5: <|im_end|>\\n<|im_start|>user\\n<tool_response>\\n<output>\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n). UserError when </tool_call> is not one token or the template renders no tool calls."""
    close_ids = tokenizer.encode(QWEN_CALL_CLOSE, add_special_tokens=False)
    if len(close_ids) != 1:
        raise UserError(f"{TEMPLATES.flag} qwen: {QWEN_CALL_CLOSE!r} is not one token of this tokenizer (it encodes as "
                        f"{close_ids}); Qwen2.5 and Qwen3 have it as 151658")
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": {"code": "pass"}}}]}
    prefix, suffix = output_frame(tokenizer, call, QWEN_CALL_CLOSE, "qwen")
    return ToolTemplate(name="qwen", stop=(QWEN_CALL_CLOSE,), stop_token_ids=(close_ids[0],),
                        call_open=QWEN_CALL_OPEN, output_prefix=prefix, output_suffix=suffix,
                        parse_call=python_tool_call)


@TEMPLATES.register("smollm2", help="SmolLM2-Instruct: ```python fences, output as a ChatML tool turn")
def smollm2(tokenizer: Any) -> ToolTemplate:
    """SmolLM2-Instruct has no tool format: the assistant writes ```python\\n<code>\\n```\\n and its turn ends there;
    the output comes back as a `tool` message of its ChatML template (<|im_end|>\\n<|im_start|>tool\\n<output>
    <|im_end|>\\n<|im_start|>assistant\\n). Derived from the tokenizer's template, so any template that renders a
    `tool` role works. UserError when the tokenizer cannot write the fences or has no chat template."""
    _check_writes(tokenizer, CODE_OPEN + "print(1)" + CODE_CLOSE, "smollm2")
    call = {"role": "assistant", "content": CODE_OPEN + "pass" + CODE_CLOSE}
    prefix, suffix = output_frame(tokenizer, call, CODE_CLOSE, "smollm2")
    return ToolTemplate(name="smollm2", stop=(CODE_CLOSE,), call_open=CODE_OPEN, output_prefix=prefix,
                        output_suffix=suffix, parse_call=fenced_code)


def tool_template_help() -> str:
    """--tool-template's help text: each registered template with its description, then the dotted path's contract."""
    return f"{TEMPLATES.describe()}, or a dotted path 'pkg.module:function' to {TOOL_TEMPLATE_SIGNATURE}"
