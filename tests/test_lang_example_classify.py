"""lang/examples/classify.py on the built-in demo model: its system turn is what the demo chat template renders
for its tools, and `select` labels each request with the tool the model would call."""
from radixserve.lang.examples import classify

EXPECTED = ["get_weather", "calculator", "get_weather", "calculator", "get_weather", "calculator"]


def test_preamble_is_the_demo_templates_tool_rendering():
    from radixserve.kernels.demo import demo_model_path
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    user = [{"role": "user", "content": "hi"}]
    with_tools = tokenizer.apply_chat_template(user, tools=classify.TOOLS, tokenize=False)
    as_system = tokenizer.apply_chat_template([{"role": "system", "content": classify.TOOL_PREAMBLE}] + user,
                                              tokenize=False)
    assert as_system == with_tools


def test_demo_model_labels_every_request_with_its_tool():
    from radixserve.lang import Runtime

    runtime = Runtime(None, num_threads=1)
    try:
        states = classify.run_classifier(runtime)
    finally:
        runtime.shutdown()
    assert [s["label"] for s in states] == EXPECTED
    for state in states:  # a clear margin, not a coin toss
        scores = sorted(state.get_meta_info("label")["normalized_logprobs"])
        assert scores[1] - scores[0] > 1.0, (state["label"], scores)
    records = [r for s in states for r in s.requests]
    assert sum(r.output.cached_tokens for r in records) > 0.8 * sum(r.output.prompt_tokens for r in records)
