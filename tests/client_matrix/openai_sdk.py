"""The `openai` SDK against radixserve: a strict tool, a named tool_choice, response_format json_schema.

Run by tests/test_client_matrix.py with a client-only venv's python: `python openai_sdk.py URL MODEL`.
Prints one JSON report (what the SDK returned, parsed by the SDK) as its last line; the test checks it.
"""
from __future__ import annotations

import json
import sys
from typing import Literal

from openai import OpenAI
from pydantic import BaseModel, Field

from _report import WEATHER_TOOL, emit, tool_calls


class Poem(BaseModel):
    title: str
    lines: int


class BoundedPoem(BaseModel):  # bounded, so that a reply the grammar alone writes ends
    title: Literal["Rain", "Snow"]
    lines: int = Field(ge=1, le=9)


def main(url: str, model: str) -> None:
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    report: dict = {}

    reply = chat.create(model=model, messages=weather, tools=[WEATHER_TOOL], temperature=0)
    report["strict_auto"] = _choice(reply)

    # Named tool_choice on a prompt the model answers with nothing: any call here is the grammar's.
    named = {"type": "function", "function": {"name": "get_weather"}}
    plain = [{"role": "user", "content": "Call the function."}]
    reply = chat.create(model=model, messages=plain, tools=[WEATHER_TOOL], tool_choice=named, temperature=0)
    report["named_forced"] = _choice(reply)
    report["no_tools"] = _choice(chat.create(model=model, messages=plain, temperature=0))

    # The round trip: the tool's result goes back, the model answers.
    reply = chat.create(model=model, messages=weather, tools=[WEATHER_TOOL], tool_choice=named, temperature=0)
    call = reply.choices[0].message.tool_calls[0]
    followup = weather + [reply.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "sunny"})}]
    report["named_round_trip"] = [_choice(reply),
                                  _choice(chat.create(model=model, messages=followup, tools=[WEATHER_TOOL],
                                                      temperature=0))]

    # response_format json_schema through the SDK's own parse() (strict schema from a pydantic model).
    poem = chat.parse(model=model, messages=[{"role": "user", "content": "Write a poem about rain."}],
                      response_format=Poem, temperature=0)
    report["json_schema"] = {"parsed": poem.choices[0].message.parsed.model_dump(),
                             "finish_reason": poem.choices[0].finish_reason}
    bounded = chat.parse(model=model, messages=plain, response_format=BoundedPoem, temperature=0)
    report["json_schema_forced"] = {"parsed": bounded.choices[0].message.parsed.model_dump(),
                                    "content": bounded.choices[0].message.content}
    emit(report)


def _choice(reply) -> dict:
    choice = reply.choices[0]
    return {"finish_reason": choice.finish_reason, "content": choice.message.content,
            "tool_calls": tool_calls(choice.message.tool_calls)}


if __name__ == "__main__":
    main(*sys.argv[1:3])
