"""Tool calls read out of replies (whole, and streamed in pieces cut anywhere), the schema that forces a
call, and how tools and tool turns reach a chat template without a tools section."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest
from transformers import AutoTokenizer

from gateway.inference.prompt_tokens import INLINE_TOKENIZE_CHARS, TokenizePool, tokenize
from gateway.inference.tool_parsers import parse_reply, parser_for
from gateway.inference.tools import ToolMode, forcing_schema, template_input, tool_mode
from gateway.schemas.openai import ChatCompletionRequest

NAMES = frozenset({"get_weather", "get_time"})
AUTO = ToolMode("auto", NAMES)
REPLY = ('Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
         '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n')


def _stream(text: str, mode: ToolMode, cuts: list[int], strict: bool = False) -> tuple[str, list[tuple]]:
    """The content and the calls ``(id, name, arguments)`` of ``text`` streamed in pieces cut at ``cuts``;
    ``strict``: no content piece may hold markup."""
    parser, pieces, start = parser_for(mode), [], 0
    for cut in [*cuts, len(text)]:
        pieces += parser.feed(text[start:cut])
        start = cut
    pieces += parser.finish()
    content, calls = "", []
    for p in pieces:
        if p.content is not None:
            assert not strict or "<" not in p.content, p.content
            content += p.content
        elif p.call is not None:
            assert p.index == len(calls) and p.call.id.startswith("call_")
            calls.append([p.call.id, p.call.name, ""])
        else:
            calls[p.index][2] += p.arguments or ""
    return content, [tuple(c) for c in calls]


def test_whole_reply_with_text_and_two_calls():
    content, calls = parse_reply(REPLY, AUTO)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_time", {})]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("cut", range(0, len(REPLY), 3))
def test_streamed_pieces_cut_anywhere_give_the_same_calls(cut):
    for cuts in ([cut], [cut, min(cut + 1, len(REPLY))], list(range(1, len(REPLY)))[cut % 2::2]):
        content, calls = _stream(REPLY, AUTO, cuts, strict=True)
        assert content == "Let me look.\n"
        assert [(n, json.loads(a)) for _, n, a in calls] == [("get_weather", {"city": "Paris"}),
                                                             ("get_time", {})]


def test_what_is_no_call_stays_text():
    for text in ['<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "<tool_call>{bad</tool_call>",
                 "a < b and <tool_ is not a tag", '<tool_call>{"name": "get_time"']:
        assert parse_reply(text, AUTO) == (text, [])
        assert _stream(text, AUTO, list(range(1, len(text)))) == (text, [])


def test_an_unclosed_last_block_that_parses_is_a_call():
    content, calls = parse_reply('<tool_call>{"name": "get_time", "arguments": {}}', AUTO)
    assert content is None and [c.name for c in calls] == ["get_time"]


def test_parallel_tool_calls_false_keeps_the_first_call_alone():
    """In ``auto`` the model may write several blocks whatever the prompt says; with
    ``parallel_tool_calls: false`` the reply carries its first call only, whole and streamed."""
    single = ToolMode("auto", NAMES, parallel=False)
    content, calls = parse_reply(REPLY, single)
    assert content == "Let me look." and [c.name for c in calls] == ["get_weather"]
    assert [n for _, n, _ in _stream(REPLY, single, [5, 30, 90])[1]] == ["get_weather"]
    assert [c.name for c in parse_reply(REPLY, AUTO)[1]] == ["get_weather", "get_time"]


def test_a_strict_tools_call_whose_arguments_miss_its_schema_is_no_call_in_auto():
    """``strict: true`` promises arguments that match the tool's schema; in ``auto`` no grammar holds them,
    so a block whose arguments do not match stays text, as a block of bad JSON does; a tool that is not
    strict takes any object."""
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
            "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city, "strict": True}},
             {"type": "function", "function": {"name": "get_time", "parameters": city}}]
    mode = tool_mode(_req(tools=tools))
    good = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    bad = '<tool_call>{"name": "get_weather", "arguments": {"town": "Oslo"}}</tool_call>'
    loose = '<tool_call>{"name": "get_time", "arguments": {"town": "Oslo"}}</tool_call>'
    assert [c.name for c in parse_reply(good, mode)[1]] == ["get_weather"]
    assert parse_reply(bad, mode) == (bad, [])
    assert [n for _, n, _ in _stream(bad + good, mode, [20, 70])[1]] == ["get_weather"]
    assert [c.name for c in parse_reply(loose, mode)[1]] == ["get_time"]


def test_forced_replies():
    named = ToolMode("named", NAMES, "get_weather", parallel=False)
    content, [call] = parse_reply('{"city": "Oslo"}', named)
    assert content is None and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert _stream('{"city": "Oslo"}', named, [3, 7])[1][0][1:] == ("get_weather", '{"city": "Oslo"}')
    required = ToolMode("required", NAMES, parallel=True)
    text = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "A"}}]'
    assert [c.name for c in parse_reply(text, required)[1]] == ["get_time", "get_weather"]
    assert [n for _, n, _ in _stream(text, required, [5, 50])[1]] == ["get_time", "get_weather"]
    assert parse_reply('[{"name": "get_ti', required) == ('[{"name": "get_ti', [])  # cut by max_tokens


def test_a_forced_list_cut_short_keeps_the_calls_it_completed():
    """``tool_choice: required`` with ``max_tokens`` too small for the calls the model keeps appending: the
    complete ones are the reply's tool calls, the cut one is dropped (whole and streamed), and the finish
    reason stays ``length``."""
    from gateway.inference.openai_format import _message

    required = ToolMode("required", NAMES, parallel=True)
    text = ('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "A"}},\n'
            ' {"name": "get_weather", "arguments": {"ci')
    content, calls = parse_reply(text, required)
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "A"}
    assert [n for _, n, _ in _stream(text, required, [7, 60])[1]] == ["get_time", "get_weather"]
    message, reason = _message(text, "length", required)
    assert reason == "length" and message["content"] is None and len(message["tool_calls"]) == 2
    # a call of an undeclared function, even complete, makes the reply no call at all, as a whole one would
    bad = '[{"name": "get_time", "arguments": {}}, {"name": "rm_rf", "arguments": {}}, {"na'
    assert parse_reply(bad, required) == (bad, [])


def _req(**extra) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    return ChatCompletionRequest.model_validate(body)


ITEM = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
LISTING = {"type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
           "required": ["items"], "$defs": {"Item": ITEM}}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": LISTING}},
         {"type": "function", "function": {"name": "get_time"}}]


def test_forcing_schema_keeps_each_tools_references():
    req = _req(tools=TOOLS, tool_choice="required")
    schema = forcing_schema(req, tool_mode(req))
    ok = [{"name": "add", "arguments": {"items": [{"n": 1}]}}, {"name": "get_time", "arguments": {}}]
    assert jsonschema_rs.is_valid(schema, ok)
    assert not jsonschema_rs.is_valid(schema, [{"name": "add", "arguments": {"items": [{"n": "x"}]}}])
    assert not jsonschema_rs.is_valid(schema, [])
    req = _req(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert jsonschema_rs.is_valid(forcing_schema(req, tool_mode(req)), ok[1])
    req = _req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    assert forcing_schema(req, tool_mode(req)) == LISTING


def test_fallback_rendering_of_tools_and_tool_turns(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = _req()
    assert template_input(tokenizer, plain) == ([{"role": "user", "content": "hi"}], {})
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    req = _req(tools=TOOLS, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"}])
    messages, extra = template_input(tokenizer, req)
    assert extra == {} and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call functions.")
    assert '{"name":"add"' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>{"name":"get_time","arguments":{}}</tool_call>'
    assert messages[3]["content"] == '<tool_response>{"name":"get_time","content":"noon"}</tool_response>'
    none = _req(tools=TOOLS, tool_choice="none")
    assert template_input(tokenizer, none) == template_input(tokenizer, plain)


# A template with a tools section, in the shape of Hermes/Qwen templates: tools listed in the system
# turn, calls and results rendered from the messages' own fields.
NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}:{{ c.function.arguments.city }}"
    "</tool_call>{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_with_a_tools_section_renders_them_itself(tiny_model_dir):
    from gateway.inference.prompt_tokens import chat_token_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = NATIVE_TEMPLATE
    call = {"id": "call_9", "type": "function", "function": {"name": "add", "arguments": '{"city": "Rome"}'}}
    req = _req(tools=TOOLS, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_9", "content": "done"}])
    text = tokenizer.decode(chat_token_ids(tokenizer, req))
    assert text.startswith("<|im_start|>system\nadd;get_time;<|im_end|>")
    assert "<tool_call>add:Rome</tool_call>" in text and "done[call_9]" in text
    assert "You can call functions" not in text


class _CountingPool(TokenizePool):
    def __init__(self) -> None:
        super().__init__(1, 1)
        self.num_runs = 0

    async def run(self, fn):  # type: ignore[no-untyped-def]
        self.num_runs += 1
        return await super().run(fn)


async def test_long_tool_definitions_are_tokenized_off_the_event_loop(tiny_model_dir):
    """A short message with long tools was tokenized on the event loop: only the messages were counted."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    long = {"type": "function", "function": {"name": "f", "description": "d" * (INLINE_TOKENIZE_CHARS + 1)}}
    pool = _CountingPool()
    await tokenize(tokenizer, _req(), pool=pool)
    assert pool.num_runs == 0
    await tokenize(tokenizer, _req(tools=[long]), pool=pool)
    assert pool.num_runs == 1


def test_the_forced_list_holds_at_most_the_bound():
    """Without ``maxItems`` a small model appended calls until ``max_tokens``; the bound is the least of the
    server's, the policy's and the request's, and a bound of one is the single-call form."""
    from gateway.inference.tools import max_tool_calls

    req = _req(tools=TOOLS, tool_choice="required")
    schema = forcing_schema(req, tool_mode(req, 2))
    two = [{"name": "get_time", "arguments": {}}] * 2
    assert schema["maxItems"] == 2 and jsonschema_rs.is_valid(schema, two)
    assert not jsonschema_rs.is_valid(schema, [*two, two[0]])
    assert "maxItems" not in forcing_schema(req, tool_mode(req))  # a receipt from before the bound
    single = tool_mode(req, 1)
    assert not single.parallel and jsonschema_rs.is_valid(forcing_schema(req, single), two[0])
    assert max_tool_calls(req, 8, None) == 8 and max_tool_calls(req, 8, 3) == 3
    assert max_tool_calls(req) is None


def test_auto_keeps_at_most_the_bound_of_calls():
    three = REPLY + '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    mode = ToolMode("auto", NAMES, max_calls=2)
    content, calls = parse_reply(three, mode)
    assert content == "Let me look." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1].arguments) == {}
    for cuts in ([7], [40, 41, 120], list(range(1, len(three), 5))):
        assert [n for _, n, _ in _stream(three, mode, cuts)[1]] == ["get_weather", "get_time"]
    assert len(parse_reply(three, AUTO)[1]) == 3


def test_a_long_call_streamed_in_small_pieces_is_searched_once():
    """Each piece of a call's text is searched for the close with the few characters before it only, and
    kept in pieces joined once: a call of 800,000 characters streamed 4 at a time took 33.6 s when the
    whole buffer was appended to and searched at every piece, 0.26 s so (2026-12-01)."""
    from gateway.inference.tools import CALL_CLOSE

    parser = parser_for(AUTO)
    assert parser.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "') == []
    for _ in range(5000):
        assert parser.feed("ab") == []
        assert len(parser._buf) + len(parser._tail) < len(CALL_CLOSE)  # all a piece's search reads
    pieces = parser.feed('"}}</tool_')
    pieces += parser.feed("call>after") + parser.finish()
    assert [p.call.name for p in pieces if p.call] == ["get_weather"]
    assert json.loads(pieces[1].arguments) == {"city": "ab" * 5000} and pieces[-1].content == "after"
