"""Each family's tool calls read out of replies as its models write them: whole, and streamed cut at
every character; what is not a call stays content; the bound on calls holds; and the family read from
chat templates modeled on each family's published one."""

from __future__ import annotations

import json

import pytest

from gateway.inference.tool_parsers import Piece, parse_reply, parser_for, template_family
from gateway.inference.tool_parsers.sections import HEAD_CHARS, Scanner
from gateway.inference.tools import ToolMode

NAMES = frozenset({"get_weather", "get_time"})


def _auto(family: str, **kw) -> ToolMode:
    return ToolMode("auto", NAMES, family=family, **kw)  # type: ignore[arg-type]


def _fold(pieces: list[Piece]) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = "", []
    for p in pieces:
        if p.content is not None:
            content += p.content
        elif p.call is not None:
            assert p.index == len(calls)
            calls.append([p.call.name, ""])
        else:
            calls[p.index][1] += p.arguments or ""
    return content, [(n, json.loads(a)) for n, a in calls]


def _read(text: str, mode: ToolMode, cuts: list[int]) -> tuple[str, list[tuple[str, dict]]]:
    parser, pieces, start = parser_for(mode), [], 0
    for cut in [*cuts, len(text)]:
        pieces += parser.feed(text[start:cut])
        start = cut
    return _fold(pieces + parser.finish())


def assert_streams_as_whole(text: str, mode: ToolMode) -> tuple[str, list[tuple[str, dict]]]:
    """``text`` read whole, then cut in two at every character and streamed a character at a time:
    the same content and calls each way."""
    whole = _read(text, mode, [])
    for cut in range(len(text) + 1):
        assert _read(text, mode, [cut]) == whole, cut
    assert _read(text, mode, list(range(1, len(text)))) == whole
    return whole


PARIS = ("get_weather", {"city": "Paris"})
TRICKY = ("get_weather", {"city": 'Pa}ri]s; "FR" \\ {'})  # brackets, quotes, escapes in a string
NOW = ("get_time", {})

CALLED = [
    # Qwen 2.5 / Hermes 2 Pro
    ("hermes", 'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '</tool_call>', "I will check.\n", [PARIS]),
    # Llama 3.1: the reply is the call; with the python tag kept; two separated by ";"
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
    ("llama3_json", ' {"type": "function", "name": "get_weather", "parameters": {"city": "Pa}ri]s; '
                    '\\"FR\\" \\\\ {"}}; {"name": "get_time", "parameters": {}}', "", [TRICKY, NOW]),
    # Mistral: text, then [TOOL_CALLS] and the list
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [PARIS]),
    ("mistral", 'Let me see.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa}ri]s; \\"FR\\" '
                '\\\\ {"}}, {"name": "get_time", "arguments": {}}]', "Let me see.", [TRICKY, NOW]),
    # Pythonic: a Python list of calls with literal arguments
    ("pythonic", '[get_weather(city="Paris")]', "", [PARIS]),
    ("pythonic", "[get_weather(city='Pa}ri]s; \"FR\" \\\\ {'), get_time()]", "", [TRICKY, NOW]),
    ("pythonic", '[get_weather(city="Oslo", days=[1, 2], units={"t": "C"}, exact=True, note=None)]', "",
     [("get_weather", {"city": "Oslo", "days": [1, 2], "units": {"t": "C"}, "exact": True, "note": None})]),
]


@pytest.mark.parametrize(("family", "text", "content", "calls"), CALLED)
def test_each_family_reads_its_calls_whole_and_streamed(family, text, content, calls):
    assert assert_streams_as_whole(text, _auto(family)) == (content, calls)
    whole_content, whole_calls = parse_reply(text, _auto(family))
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == calls
    assert whole_content == (content.strip() or None)


NOT_CALLS = [
    ("llama3_json", 'The weather: {"name": "get_weather", "parameters": {}}'),  # a call starts the reply
    ("llama3_json", '{"name": "get_wether", "parameters": {"city": "Paris"}}'),  # no such function
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Pa'),  # cut short
    ("llama3_json", "{not json} then text"),
    ("llama3_json", '{"name": "get_weather", "parameters": ["Paris"]}'),  # arguments no object
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {}}, {"name": "rm", "arguments": {}}]'),
    ("mistral", "[TOOL_CALLS] sorry, no tool fits."),
    ("mistral", '[{"name": "get_weather", "arguments": {}}]'),  # no marker
    ("pythonic", "[1, 2, 3] are numbers; [a] is a list"),
    ("pythonic", '[os.system("rm -rf /")]'),  # a dotted name
    ("pythonic", '[get_weather(city=open("/etc/passwd").read())]'),  # no literal
    ("pythonic", '[get_weather("Paris")]'),  # positional
    ("pythonic", '[get_weather(**{"city": "Paris"})]'),
    ("pythonic", '[get_weather(city={1, 2})]'),  # a set: no JSON
    ("pythonic", "[get_weather(city=" + "[" * 300 + "]" * 300 + ")]"),  # nested past the parser's limit
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "nope"}</tool_call>'),
]


@pytest.mark.parametrize(("family", "text"), NOT_CALLS)
def test_what_is_no_call_stays_content(family, text):
    assert assert_streams_as_whole(text, _auto(family)) == (text, [])
    assert parse_reply(text, _auto(family)) == (text, [])


@pytest.mark.parametrize(("family", "prefix"), [("pythonic", "[1, 2"), ("llama3_json", "{hello"),
                                                ("mistral", "[TOOL_CALLS] [1")])
def test_a_value_that_cannot_be_a_call_is_content_as_soon_as_it_shows(family, prefix):
    parser = parser_for(_auto(family))
    assert "".join(p.content or "" for p in parser.feed(prefix)) == prefix


def test_only_a_possible_marker_is_held_back():
    parser = parser_for(_auto("mistral"))
    assert parser.feed("Hello [TOOL") == [Piece(content="Hello ")]
    assert parser.feed("S] x") == [Piece(content="[TOOLS] x")]
    # A call's head undecided after HEAD_CHARS characters is content too.
    parser = parser_for(_auto("pythonic"))
    assert parser.feed("[" + " " * (HEAD_CHARS - 2)) == []
    assert parser.feed("  get_weather()]")[0].content.startswith("[   ")


@pytest.mark.parametrize(("family", "one"), [
    ("llama3_json", '{"name": "get_time", "parameters": {"n": %d}}; '),
    ("pythonic", None),
    ("mistral", None),
])
def test_the_bound_on_calls_holds(family, one):
    if family == "llama3_json":
        text = "".join(one % i for i in range(3)).rstrip("; ")
    elif family == "pythonic":
        text = "[" + ", ".join(f"get_time(n={i})" for i in range(3)) + "]"
    else:
        text = "[TOOL_CALLS][" + ", ".join(f'{{"name": "get_time", "arguments": {{"n": {i}}}}}'
                                           for i in range(3)) + "]"
    content, calls = assert_streams_as_whole(text, _auto(family, max_calls=2))
    assert content == "" and calls == [("get_time", {"n": 0}), ("get_time", {"n": 1})]
    assert [a for _, a in _read(text, _auto(family, parallel=False), [])[1]] == [{"n": 0}]
    assert len(parse_reply(text, _auto(family))[1]) == 3


def test_a_strict_tool_s_arguments_must_match_its_schema():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    mode = _auto("pythonic", strict={"get_weather": schema})
    assert parse_reply('[get_weather(city="Rome")]', mode)[1][0].name == "get_weather"
    assert parse_reply("[get_weather(city=3)]", mode) == ("[get_weather(city=3)]", [])


def test_a_long_value_streamed_in_small_pieces_is_scanned_once():
    """Inside a value only the new text is scanned (the scanner keeps its state between pieces)."""
    parser = parser_for(_auto("mistral"))
    assert parser.feed('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "') == []
    for _ in range(5000):
        assert parser.feed('a\\"') == [] and parser._buf == ""
    pieces = parser.feed('"}}]') + parser.finish()
    assert json.loads(pieces[1].arguments) == {"city": 'a"' * 5000}


def test_the_scanner_carries_an_escape_across_pieces():
    scanner = Scanner("[]{}", '"')
    assert scanner.feed('{"a": "x\\') == -1
    assert scanner.feed('"}') == -1  # the escaped quote, then a brace inside the string
    assert scanner.feed('"} tail') == 2 and scanner.text() == '{"a": "x\\"}"}'


# Chat templates modeled on each family's published one, cut to what shows the format.
MISTRAL = (
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- if tools and loop.last %}"
    "{{- '[AVAILABLE_TOOLS] ' }}{{- tools | tojson }}{{- '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST] ' + message.content + '[/INST]' }}{%- elif message.tool_calls is defined %}"
    "{{- '[TOOL_CALLS] [' }}{%- for tool_call in message.tool_calls %}{{- tool_call.function | tojson }}"
    "{%- endfor %}{{- ']' + eos_token }}{%- endif %}{%- endfor %}"
)
QWEN = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\nYou may call one or more functions to assist "
    "with the user query.\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}"
    "{%- endfor %}{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags' }}{%- endif %}"
)
LLAMA31 = (
    "{%- if tools is not none %}{{- 'Given the following functions, please respond with a JSON for a "
    "function call with its proper arguments that best answers the given prompt.\\n\\n' }}"
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and "
    "its value}.' }}{%- endif %}{%- if builtin_tools is defined %}{{- '<|python_tag|>' }}{%- endif %}"
)
LLAMA32_PYTHONIC = (
    "{%- if tools %}{{- 'If you decide to invoke any of the function(s), you MUST put it in the format of "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]' }}"
    "{%- endif %}"
)
NO_FORMAT = ("{%- if tools %}{{ tools | tojson }}{%- endif %}"
             "{% for m in messages %}{{ m.content }}{% endfor %}")


@pytest.mark.parametrize(("template", "family"), [
    (MISTRAL, "mistral"), (QWEN, "hermes"), (LLAMA31, "llama3_json"), (LLAMA32_PYTHONIC, "pythonic"),
    (NO_FORMAT, "hermes"),
])
def test_the_family_is_read_from_the_template(template, family):
    assert template_family(template) == family


def test_a_template_without_tools_is_read_as_the_fallback_prompt_asks(tiny_model_dir):
    from transformers import AutoTokenizer

    from gateway.inference.tool_parsers import tool_family

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tool_family(tokenizer) == "hermes"  # the default model's template has no tools section
    tokenizer.chat_template = MISTRAL
    assert tool_family(tokenizer) == "mistral"
    tokenizer.chat_template = MISTRAL.replace("tools", "functions")  # no tools section: the fallback
    assert tool_family(tokenizer) == "hermes"
