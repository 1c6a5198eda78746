"""instructor against radixserve in its TOOLS and JSON_SCHEMA modes (a pydantic model out of each reply).

Run by tests/test_client_matrix.py with a client-only venv's python: `python instructor_modes.py URL MODEL`.
Prints one JSON report as its last line: per mode, the validated object, and the requests instructor sent (so a
retry after a failed validation shows).
"""
from __future__ import annotations

import json
import sys

import httpx2
import instructor
from openai import OpenAI
from pydantic import BaseModel

from _report import emit


class Story(BaseModel):
    title: str
    lines: int


class Poem(BaseModel):
    title: str
    lines: int


CASES = {  # mode -> (response model, prompt)
    "TOOLS": (Story, "Tell a story about rain."),
    "JSON_SCHEMA": (Poem, "Write a poem about rain."),
}


def main(url: str, model: str) -> None:
    report: dict = {}
    for mode, (response_model, prompt) in CASES.items():
        sent: list[dict] = []
        http = httpx2.Client(event_hooks={"request": [lambda r: sent.append(json.loads(r.content))]}, timeout=120)
        client = instructor.from_openai(OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                               http_client=http), mode=getattr(instructor.Mode, mode))
        result = client.chat.completions.create(model=model, response_model=response_model, temperature=0,
                                                messages=[{"role": "user", "content": prompt}], max_retries=1)
        report[mode] = {"type": type(result).__name__, "object": result.model_dump(),
                        "requests": [{key: body.get(key) for key in ("tools", "tool_choice", "response_format")}
                                     for body in sent]}
    emit(report)


if __name__ == "__main__":
    main(*sys.argv[1:3])
