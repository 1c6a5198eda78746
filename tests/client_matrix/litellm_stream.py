"""litellm `completion` against radixserve with streamed tool calls, then the tool's result and a streamed answer.

Run by tests/test_client_matrix.py with a client-only venv's python (LITELLM_LOCAL_MODEL_COST_MAP=True: no
network): `python litellm_stream.py URL MODEL`. Prints one JSON report as its last line.
"""
from __future__ import annotations

import json
import sys

import litellm

litellm.suppress_debug_info = True  # its "Provider List" banner for a model it has no price for

from _report import WEATHER_TOOL, emit, tool_calls


def main(url: str, model: str) -> None:
    options = dict(model="openai/" + model, api_base=url + "/v1", api_key="unused", temperature=0, stream=True,
                   tools=[WEATHER_TOOL])
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    chunks = list(litellm.completion(messages=messages, **options))
    call_deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    message = litellm.stream_chunk_builder(chunks, messages=messages).choices[0].message
    calls = tool_calls(message.tool_calls)

    followup = messages + [message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "sunny"})}
        for call in message.tool_calls or []]
    answer_chunks = list(litellm.completion(messages=followup, **options))
    answer = "".join(c.choices[0].delta.content or "" for c in answer_chunks)
    emit({"chunks": len(chunks), "tool_call_deltas": len(call_deltas),
          "finish_reasons": [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason],
          "calls": calls, "answer_chunks": len(answer_chunks), "answer": answer,
          "answer_finish": [c.choices[0].finish_reason for c in answer_chunks if c.choices[0].finish_reason]})


if __name__ == "__main__":
    main(*sys.argv[1:3])
