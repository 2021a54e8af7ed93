"""Tool calling through the real server with the real `openai` client: `required` and named
tool_choice enforced by the grammar (a random-weight model at temperature 1 returns parseable,
schema-valid calls every time, streamed and not), `auto` outputs read by each family's parser,
tools and tool turns through the chat template, and 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cluster.api import protocol as P
from cluster.api.tools import detect_parser, held_back, parse_tool_calls
from tests.test_server import MODEL, assert_error, oai, openai_client, post, served_with, stack  # noqa: F401

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "what's the weather in Oslo?"}]


def _check_call(name: str, arguments: str) -> None:
    assert name in SCHEMA_OF, name
    jsonschema.validate(json.loads(arguments), SCHEMA_OF[name])


@pytest.mark.parametrize("parallel", [False, True])
def test_required_returns_valid_calls_every_time(stack, oai, parallel):  # noqa: F811
    out = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", n=25,
                                      temperature=1.0, max_tokens=460, parallel_tool_calls=parallel)
    for c in out.choices:
        assert c.finish_reason == "tool_calls", c.message
        calls = c.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            _check_call(call.function.name, call.function.arguments)


def _streamed_calls(stream) -> tuple[list[dict[int, dict]], list[str | None], list[str]]:
    calls: list[dict[int, dict]] = [{} for _ in range(8)]
    reasons: list[str | None] = [None] * 8
    content = [""] * 8
    for chunk in stream:
        for ch in chunk.choices:
            reasons[ch.index] = ch.finish_reason or reasons[ch.index]
            content[ch.index] += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                slot = calls[ch.index].setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = slot["id"] or d.id
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
    return calls, reasons, content


def test_required_and_named_streamed(stack, oai):  # noqa: F811
    stream = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", n=5,
                                         temperature=1.0, max_tokens=460, stream=True)  # (up to 8 calls)
    calls, reasons, _ = _streamed_calls(stream)
    for i in range(5):
        assert reasons[i] == "tool_calls" and calls[i]
        for c in calls[i].values():
            assert c["id"]
            _check_call(c["name"], c["arguments"])
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, n=3,
                                         temperature=1.0, max_tokens=300, stream=True)
    calls, reasons, content = _streamed_calls(stream)
    for i in range(3):
        assert reasons[i] == "tool_calls" and list(calls[i]) == [0] and content[i] == ""
        assert calls[i][0]["name"] == "get_weather"
        _check_call("get_weather", calls[i][0]["arguments"])
    out = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=300)
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].message.content is None and call.function.name == "get_weather"
    _check_call("get_weather", call.function.arguments)


HERMES_CALL = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'


def test_auto_output_is_parsed_into_tool_calls(stack):  # noqa: F811
    # The same engine behind a server that reads `auto` outputs with the Hermes parser.
    with served_with(stack, tool_call_parser="hermes") as url:
        _check_hermes_auto(openai_client(url))


def _check_hermes_auto(client) -> None:
    # The random model is steered into Hermes' format by a regex; the server must find the call.
    pattern = r"Let me check\. " + HERMES_CALL
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, max_tokens=80,
                                         extra_body={"guided_regex": pattern})
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and msg.content == "Let me check."
    (call,) = msg.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, max_tokens=80,
                                            stream=True, extra_body={"guided_regex": pattern})
    calls, reasons, content = _streamed_calls(stream)
    # (streamed content went out before the call was seen: up to the marker, its space included)
    assert reasons[0] == "tool_calls" and content[0] == "Let me check. " and calls[0][0]["name"] == "get_time"
    # Plain text stays text.
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8,
                                         extra_body={"guided_regex": "no tools [a-z]{3}"})
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content.startswith("no tools")


def test_tool_turns_and_tools_reach_the_chat_template(stack, oai):  # noqa: F811
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    out = oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=4)
    assert out.choices[0].message.content is not None
    tok = stack["engine"].tokenizer
    req = P.ChatCompletionRequest.model_validate({"messages": history, "tools": TOOLS})
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:"
                "{{ m.content }}{% for c in m.tool_calls or [] %}({{ c.function.arguments.city }}){% endfor %}"
                "{% endfor %}")
    saved = tok.chat_template
    try:
        tok.chat_template = template
        text = tok.decode(P.render_chat(tok, req.chat_dicts(), req.template_tools()))
    finally:
        tok.chat_template = saved
    assert "[get_weather][get_time]" in text and "(Oslo)" in text and "tool:rain" in text


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id"),
])
def test_bad_tool_requests_name_the_field(stack, body, param):  # noqa: F811
    r = post(stack, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body})
    assert_error(r, 400, param)


# ---------------------------------------------------------------------------------------------
# The parsers, on each family's own format
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("parser,text,content", [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
               '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}</tool_call>', "Sure."),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, '
                '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}]', ""),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}', ""),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}', ""),
    ("deepseek_v3", 'ok<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n'
                    '{"zone": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n'
                    '```json\n{"city": "Oslo", "days": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "ok"),
])
def test_parsers_read_their_family_format(parser, text, content):
    got, calls = parse_tool_calls(parser, text)
    assert got == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "days": 1})]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("parser", ["hermes", "mistral", "llama3_json", "deepseek_v3"])
def test_malformed_calls_stay_text(parser):
    for text in ["just words", '<tool_call>{"name": "f", "arguments": {</tool_call>', '[TOOL_CALLS][{"nam": 1}]',
                 '{"name": 3}']:
        assert parse_tool_calls(parser, text) == (text, [])


def test_streaming_holds_back_a_possible_marker():
    assert held_back("hermes", "Hello <tool") == len("Hello ")
    assert held_back("hermes", "Hello <tool_call>{") == len("Hello ")
    assert held_back("hermes", "Hello there") == len("Hello there")
    assert held_back("llama3_json", ' {"name"') == 0
    assert held_back(None, "anything <tool_call>") == len("anything <tool_call>")


def test_parser_found_from_the_chat_template():
    assert detect_parser("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_parser("[TOOL_CALLS] {{ x }}") == "mistral"
    assert detect_parser("<|python_tag|>{{ m }}<|eot_id|>") == "llama3_json"
    assert detect_parser("<｜tool▁calls▁begin｜>") == "deepseek_v3"
    assert detect_parser("{{ bos_token }}{% for m in messages %}{% endfor %}") is None
    assert detect_parser(None) is None
