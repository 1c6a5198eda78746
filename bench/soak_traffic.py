"""The soak's clients: seeded requests from every API, each ending in exactly one recorded outcome.

A kind is one coroutine that sends a request (or a short chain) and returns its outcomes. Every request runs under
the client deadline; what does not end by then is a "timeout" (a hang, a violation). Statuses are the HTTP code as
text, "hangup" for a client that left a stream on purpose, "timeout", or "transport" (the connection failed)."""
from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import httpx

SYSTEMS = ("You are a careful assistant for a travel agency. Answer briefly and name the city you mean.",
           "You are a coding assistant. Answer with one short sentence and no code unless asked.",
           "You are the support bot of a bank. Never reveal account numbers; answer in one line.")
SALTS = (None, "tenant-a", "tenant-b")  # several cache_salt tenants beside the unsalted traffic
QUESTIONS = ("What is the capital of France?", "Say hello.", "Name a color.", "What day follows Monday?",
             "Count to three.", "What is 2 + 3?", "Give me a fruit.", "Where is Paris?")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                 "required": ["name", "age"]}
# Requests that must get a 4xx: bodies that are not JSON, wrong types, out-of-range values, unknown fields' values.
MALFORMED: tuple[tuple[str, bytes], ...] = (
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", b'{"messages": "hello"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}'),
    ("/v1/completions", b'{"prompt": 42, "max_tokens": 4}'),
    ("/generate", b'{"input_ids": ["a", "b"], "sampling_params": {"max_new_tokens": 2}}'),
    ("/v1/responses", b'{"input": "hi", "previous_response_id": "resp_does_not_exist"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}'),
)
# kind -> weight; malformed is about 1 request in 20.
WEIGHTS = {"chat": 4, "chat_stream": 4, "completion": 2, "generate_ids": 2, "responses_chain": 1, "tool_call": 1,
           "json_schema": 1, "n2": 1, "hangup": 1.5, "abort": 1.5, "malformed": 1}


@dataclass
class Outcome:
    kind: str
    status: str
    start: float  # time.monotonic() when sent
    latency_s: float
    detail: str = ""


class Traffic:
    """Sends one request of a kind at a time; owns nothing but its seeded random source."""

    def __init__(self, client: httpx.AsyncClient, model: str, rng: random.Random, deadline_s: float,
                 vocab_hi: int = 200) -> None:
        self.client, self.model, self.rng, self.deadline_s = client, model, rng, deadline_s
        self.vocab_hi = vocab_hi
        self.kinds: dict[str, Callable[[], Awaitable[list[Outcome]]]] = {
            name: getattr(self, "_" + name) for name in WEIGHTS}

    def pick(self) -> str:
        return self.rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]

    async def run(self, kind: str) -> list[Outcome]:
        return await self.kinds[kind]()

    # -- the kinds -------------------------------------------------------------------------------------------

    def _messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.rng.choice(SYSTEMS)},
                {"role": "user", "content": self.rng.choice(QUESTIONS)}]

    def _chat_body(self, **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(),
                                "max_tokens": self.rng.randint(4, 24), "temperature": self.rng.choice([0.0, 0.8])}
        salt = self.rng.choice(SALTS)
        if salt is not None:
            body["cache_salt"] = salt
        body.update(extra)
        return body

    async def _chat(self) -> list[Outcome]:
        return [await self._post("chat", "/v1/chat/completions", self._chat_body())]

    async def _chat_stream(self) -> list[Outcome]:
        return [await self._stream("chat_stream", "/v1/chat/completions", self._chat_body(stream=True))]

    async def _completion(self) -> list[Outcome]:
        body = {"model": self.model, "prompt": self.rng.choice(SYSTEMS) + " " + self.rng.choice(QUESTIONS),
                "max_tokens": self.rng.randint(4, 24)}
        return [await self._post("completion", "/v1/completions", body)]

    async def _generate_ids(self) -> list[Outcome]:
        ids = [self.rng.randrange(10, self.vocab_hi) for _ in range(self.rng.randint(8, 96))]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": self.rng.randint(4, 24), "temperature": 0}}
        return [await self._post("generate_ids", "/generate", body)]

    async def _responses_chain(self) -> list[Outcome]:
        first = {"model": self.model, "input": self.rng.choice(QUESTIONS), "max_output_tokens": 16, "store": True}
        out, body = await self._post_json("responses", "/v1/responses", first)
        if out.status != "200" or not isinstance(body, dict) or "id" not in body:
            return [out]
        second = {"model": self.model, "input": self.rng.choice(QUESTIONS), "max_output_tokens": 16,
                  "previous_response_id": body["id"]}
        return [out, await self._post("responses", "/v1/responses", second)]

    async def _tool_call(self) -> list[Outcome]:
        body = self._chat_body(tools=[WEATHER_TOOL], tool_choice="required", max_tokens=64)
        return [await self._post("tool_call", "/v1/chat/completions", body)]

    async def _json_schema(self) -> list[Outcome]:
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
        return [await self._post("json_schema", "/v1/chat/completions", self._chat_body(response_format=fmt,
                                                                                            max_tokens=48))]

    async def _n2(self) -> list[Outcome]:
        return [await self._post("n2", "/v1/chat/completions", self._chat_body(n=2))]

    async def _hangup(self) -> list[Outcome]:
        """A streaming client that leaves after k chunks (the server must free what the request held)."""
        return [await self._stream("hangup", "/v1/chat/completions", self._chat_body(stream=True, max_tokens=64),
                                   leave_after=self.rng.randint(1, 3))]

    async def _abort(self) -> list[Outcome]:
        """A /generate that /abort_request cancels while it runs: a normal finish, never a 5xx."""
        rid = f"soak-{uuid.UUID(int=self.rng.getrandbits(128)).hex}"
        body = {"text": self.rng.choice(SYSTEMS), "rid": rid,
                "sampling_params": {"max_new_tokens": 128, "temperature": 0.8, "ignore_eos": True}}
        request = asyncio.ensure_future(self._post("abort", "/generate", body))
        await asyncio.sleep(self.rng.uniform(0.02, 0.4))
        cancel = await self._post("abort_request", "/abort_request", {"rid": rid})
        return [await request, cancel]

    async def _malformed(self) -> list[Outcome]:
        path, raw = self.rng.choice(MALFORMED)
        return [await self._post("malformed", path, raw)]

    # -- transport --------------------------------------------------------------------------------------------

    async def _post(self, kind: str, path: str, body: dict[str, Any] | bytes) -> Outcome:
        return (await self._post_json(kind, path, body))[0]

    async def _post_json(self, kind: str, path: str, body: dict[str, Any] | bytes) -> tuple[Outcome, Any]:
        start = time.monotonic()
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            async with asyncio.timeout(self.deadline_s):
                response = await self.client.post(path, content=content,
                                                  headers={"Content-Type": "application/json"})
        except TimeoutError:
            return Outcome(kind, "timeout", start, time.monotonic() - start), None
        except httpx.TransportError as exc:
            return Outcome(kind, "transport", start, time.monotonic() - start, _transport_detail(exc, None)), None
        try:
            parsed = response.json()
        except ValueError:
            parsed = None
        detail = "" if response.status_code == 200 else response.text[:200]
        if response.status_code == 200 and kind == "abort" and isinstance(parsed, dict):
            detail = str(parsed.get("meta_info", {}).get("finish_reason", ""))[:80]
        return Outcome(kind, str(response.status_code), start, time.monotonic() - start, detail), parsed

    async def _stream(self, kind: str, path: str, body: dict[str, Any], leave_after: int | None = None) -> Outcome:
        """A streamed request: 200 only if the stream ended with [DONE] and no error event."""
        start = time.monotonic()
        chunks: list[int] = []  # one entry per data event read, so a transport error can say how far it got
        try:
            async with asyncio.timeout(self.deadline_s):
                async with self.client.stream("POST", path, json=body) as response:
                    if response.status_code != 200:
                        text = (await response.aread()).decode(errors="replace")
                        return Outcome(kind, str(response.status_code), start, time.monotonic() - start, text[:200])
                    chunks.append(0)  # the headers arrived
                    return await self._read_events(kind, response, start, leave_after, chunks)
        except TimeoutError:
            return Outcome(kind, "timeout", start, time.monotonic() - start)
        except httpx.TransportError as exc:
            return Outcome(kind, "transport", start, time.monotonic() - start,
                           _transport_detail(exc, len(chunks) - 1 if chunks else None))

    async def _read_events(self, kind: str, response: httpx.Response, start: float,
                           leave_after: int | None, seen: list[int]) -> Outcome:
        chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return Outcome(kind, "200", start, time.monotonic() - start)
            if '"error"' in data and data.lstrip().startswith('{"error"'):
                return Outcome(kind, "error-event", start, time.monotonic() - start, data[:200])
            chunks += 1
            seen.append(chunks)
            if leave_after is not None and chunks >= leave_after:
                return Outcome(kind, "hangup", start, time.monotonic() - start)
        return Outcome(kind, "cut", start, time.monotonic() - start, "the stream ended without [DONE]")


def _transport_detail(exc: httpx.TransportError, events: int | None) -> str:
    """The exception and how far the response got: before its headers (None) or after `events` data events."""
    where = "before the response headers" if events is None else f"after the headers and {events} event(s)"
    return f"{type(exc).__name__} {where}: {str(exc)[:120]}"


async def burst(client: httpx.AsyncClient, model: str, size: int, deadline_s: float) -> list[Outcome]:
    """`size` small chat requests at once, past the server's queue: each gets a 200 or a 429, nothing else."""
    rng = random.Random(size)
    traffic = Traffic(client, model, rng, deadline_s)
    bodies = [{"model": model, "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}], "max_tokens": 4}
              for _ in range(size)]
    return list(await asyncio.gather(*(traffic._post("burst", "/v1/chat/completions", b) for b in bodies)))
