"""Forced tool calls in every tool-call format mlx-lm's parsers read, on tokenizers whose markers are
single added tokens as in real ones: a random model, held by the grammar at temperature 1, writes
calls that mlx-lm's own parser reads back with arguments valid under each tool's schema."""

import json
import pkgutil

import jsonschema
import mlx_lm.tool_parsers
import pytest

from mlxkv import LLM, SamplingParams
from mlxkv.entrypoints.tool_calls import ToolCall, ToolCallStream, tool_grammar
from mlxkv.entrypoints.tool_calls.grammar import LAYOUTS
from mlxkv.models.random_model import make_checkpoint

# Each format's markers, added to its tokenizer as single tokens (as its models' tokenizers have them).
FORMATS = {
    "json_tools": ("<tool_call>", "</tool_call>"),
    "qwen3_coder": ("<tool_call>", "</tool_call>"),
    "glm47": ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    "laguna": ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    "longcat": (
        "<longcat_tool_call>",
        "</longcat_tool_call>",
        "<longcat_arg_key>",
        "</longcat_arg_key>",
        "<longcat_arg_value>",
        "</longcat_arg_value>",
    ),
    "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>"),
    "minicpm5": (),  # its markers are text
    "muse_spark": ("<atem:function_calls>", "</atem:function_calls>"),
    "gemma4": ("<|tool_call>", "<tool_call|>", '<|"|>'),
    "function_gemma": ("<start_function_call>", "<end_function_call>", "<escape>"),
    "pythonic": ("<|tool_call_start|>", "<|tool_call_end|>"),
    "mistral": ("[TOOL_CALLS]", "[ARGS]"),
    "kimi_k2": (
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ),
    "kimi_k3": ("<|open|>", "<|close|>", "<|sep|>"),
}


def tool(name, properties, required):
    parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [
    tool(
        "get_weather",
        {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        ["city", "days"],
    ),
    tool("get_time", {"zone": {"enum": ["UTC", "CET"]}}, ["zone"]),
    tool(
        "search",
        {
            "query": {"type": "string", "minLength": 2, "maxLength": 20},
            "limit": {"type": "integer", "maximum": 50},
            "exact": {"type": "boolean"},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "code": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"},
        },
        ["query"],
    ),
    tool("ping", {}, []),
]
NESTED = tool(  # arguments that are themselves JSON: arrays and objects
    "book",
    {
        "guests": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "room": {
            "type": "object",
            "properties": {"beds": {"type": "integer", "maximum": 4}},
            "required": ["beds"],
            "additionalProperties": False,
        },
    },
    ["guests", "room"],
)
SEEDS = 16


def test_every_format_of_mlx_lm_is_covered():
    parsers = {module.name for module in pkgutil.iter_modules(mlx_lm.tool_parsers.__path__)}
    assert set(LAYOUTS) == set(FORMATS) == parsers


@pytest.fixture(scope="module")
def llm_of(tmp_path_factory):
    built = {}

    def get(kind):
        if kind not in built:
            path = make_checkpoint(
                tmp_path_factory.mktemp(kind), markers=FORMATS[kind], tokenizer_config={"tool_parser_type": kind}
            )
            built[kind] = LLM(str(path), max_num_seqs=SEEDS)
        return built[kind]

    return get


def calls_of(llm, tools, text):
    stream = ToolCallStream(llm.tokenizer, tools)
    pieces = stream.feed(text) + stream.close()
    return [p for p in pieces if isinstance(p, ToolCall)], "".join(p for p in pieces if isinstance(p, str))


@pytest.mark.parametrize("kind", list(FORMATS))
def test_forced_calls_parse_back_valid_for_16_seeds_at_temperature_1(llm_of, kind):
    llm = llm_of(kind)
    tools = TOOLS + ([NESTED] if kind != "function_gemma" else [])
    grammar = tool_grammar(llm.tokenizer, tools, parallel=False)
    for marker in FORMATS[kind]:  # every marker the grammar writes is the model's own token
        assert json.dumps(marker) not in grammar
    params = [SamplingParams(max_tokens=400, temperature=1.0, seed=seed, grammar=grammar) for seed in range(SEEDS)]
    names = set()
    for completion in llm.generate([[seed + 1, 2, 3] for seed in range(SEEDS)], params):
        assert completion.finish_reason == "stop", completion.text
        calls, content = calls_of(llm, tools, completion.text)
        assert (len(calls), content.strip()) == (1, ""), completion.text
        schema = next(t for t in tools if t["function"]["name"] == calls[0].name)["function"]["parameters"]
        jsonschema.validate(json.loads(calls[0].arguments), schema)
        names.add(calls[0].name)
    assert len(names) >= 3  # the seeds call several tools, not one


@pytest.mark.parametrize("kind", ["qwen3_coder", "gemma4", "kimi_k2", "mistral", "pythonic"])
def test_parallel_calls_are_each_valid(llm_of, kind):
    """Several calls in one reply: every call read back is valid (a reply cut by max_tokens loses
    only its last call)."""
    llm = llm_of(kind)
    grammar = tool_grammar(llm.tokenizer, TOOLS, parallel=True)
    params = [SamplingParams(max_tokens=300, temperature=1.0, seed=seed, grammar=grammar) for seed in range(16)]
    counts = []
    for completion in llm.generate([[seed + 1, 2, 3] for seed in range(16)], params):
        calls, _ = calls_of(llm, TOOLS, completion.text)
        for call in calls:
            schema = next(t for t in TOOLS if t["function"]["name"] == call.name)["function"]["parameters"]
            jsonschema.validate(json.loads(call.arguments), schema)
        counts.append(len(calls))
    assert max(counts) >= 2


def test_a_format_that_cannot_hold_an_argument_is_refused_by_name(llm_of):
    with pytest.raises(ValueError, match="argument 'guests' of 'book' is not a string, number or boolean"):
        tool_grammar(llm_of("function_gemma").tokenizer, [NESTED], parallel=False)


def test_a_model_without_a_tool_call_format_is_refused(llm_of, tmp_path):
    llm = LLM(str(make_checkpoint(tmp_path / "plain")))
    with pytest.raises(ValueError, match="cannot enforce"):
        tool_grammar(llm.tokenizer, TOOLS, parallel=False)
