"""Scripted checkpoints: under transformers' greedy generate they emit exactly their scripts, then EOS."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from radixserve.kernels.demo import SCRIPT_PRIORITY, SCRIPTS, TOOL_RESULT_TRIGGER, build_scripted_checkpoint, special_token_ids
from radixserve.scheduler.detokenizer import IncrementalDetokenizer
from radixserve.scheduler.tokenizer import Tokenizer

TOOL_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
CHAINS = dict(SCRIPTS, weather=TOOL_CALL)
IM_END = special_token_ids(2048)["<|im_end|>"]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    path = build_scripted_checkpoint(str(tmp_path_factory.mktemp("scripted")), CHAINS, priority=SCRIPT_PRIORITY)
    return path, AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()


def _generate(model, prompt_ids, max_new_tokens=64, **kwargs):
    ids = torch.tensor([prompt_ids])  # [1, prompt_len]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize(
    "trigger, prompt",
    [("weather", "What is the weather in Paris?"), ("story", "Tell me a story, please."),
     ("emoji", "emoji"), ("hello", "Say hello to everyone")],
)
def test_generate_emits_script_then_eos(scripted, trigger, prompt):
    _, tok, model = scripted
    expected = tok.encode(CHAINS[trigger], add_special_tokens=False) + [IM_END]
    assert _generate(model, tok.encode(prompt)) == expected


def test_chat_prompt_with_tools_gets_the_tool_call(scripted):
    _, tok, model = scripted
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}]
    prompt = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)["input_ids"]
    out = _generate(model, prompt)
    assert out[-1] == IM_END and tok.decode(out[:-1]) == TOOL_CALL


def test_tool_result_wins_over_the_question_that_called_the_tool(scripted):
    """The agent round trip: the question calls the tool; once its result is in the prompt, the final answer."""
    _, tok, model = scripted
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'}]
    prompt = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)["input_ids"]
    out = _generate(model, prompt)
    assert out[-1] == IM_END and tok.decode(out[:-1]) == SCRIPTS[TOOL_RESULT_TRIGGER]
    # ... and the other way round: a priority trigger before the ordinary one still wins.
    prompt = tok.encode(TOOL_RESULT_TRIGGER + " ok then weather")
    assert tok.decode(_generate(model, prompt)[:-1]) == SCRIPTS[TOOL_RESULT_TRIGGER]


def test_no_trigger_means_eos_and_ignore_eos_repeats(scripted):
    _, tok, model = scripted
    assert _generate(model, tok.encode("Nothing to see here."), max_new_tokens=4) == [IM_END]
    script = tok.encode(SCRIPTS["hello"], add_special_tokens=False) + [IM_END]
    out = _generate(model, tok.encode("hello"), max_new_tokens=2 * len(script) + 3, eos_token_id=None)
    assert out == (script * 3)[: 2 * len(script) + 3]


def test_far_away_trigger_still_fires(scripted):
    _, tok, model = scripted
    filler = tok.encode(" and so on") * 250  # ~750 tokens between the trigger and the answer
    prompt = tok.encode("story") + filler
    assert _generate(model, prompt, max_new_tokens=40) == tok.encode(SCRIPTS["story"], add_special_tokens=False) + [IM_END]


def test_multibyte_script_has_torn_tokens_and_streams_intact(scripted):
    path, tok, model = scripted
    out = _generate(model, tok.encode("an emoji please"))
    assert any("\ufffd" in tok.decode([t]) for t in out), "some token must end inside a multi-byte character"
    detok = IncrementalDetokenizer(Tokenizer(path))
    deltas = [detok.add(t) for t in out] + [detok.finish()]
    assert "".join(deltas) == SCRIPTS["emoji"] and not any("\ufffd" in d for d in deltas)


def test_explicit_token_ids_and_errors(tmp_path):
    with pytest.raises(ValueError, match="single token"):
        build_scripted_checkpoint(str(tmp_path / "a"), {"get_weather": "x"})
    with pytest.raises(ValueError, match="three consecutive tokens"):
        build_scripted_checkpoint(str(tmp_path / "b"), {"story": "so no no no yes no no no maybe"})
    with pytest.raises(ValueError, match="trigger token"):
        build_scripted_checkpoint(str(tmp_path / "c"), {"story": "a poem", "poem": "x"})
    with pytest.raises(ValueError, match="priority names triggers without a script"):
        build_scripted_checkpoint(str(tmp_path / "p"), {"story": "x"}, priority=("poem",))
    with pytest.raises(ValueError, match="empty"):
        build_scripted_checkpoint(str(tmp_path / "d"), {"story": ""})
    path = build_scripted_checkpoint(str(tmp_path / "e"), {"count": [49, 50, 51, 52, 53]})
    model = AutoModelForCausalLM.from_pretrained(path)
    assert _generate(model, Tokenizer(path).encode("count"), max_new_tokens=8) == [49, 50, 51, 52, 53, IM_END]
