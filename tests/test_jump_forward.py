"""Jump-forward decoding (issue 11 item 5): a grammar's forced continuation is appended at once and computed in
one extend step. On and off must give outputs valid for the same grammar; on needs fewer forwards where keys
are long; KV accounting, streaming, stops, max_new_tokens, logprobs and retraction behave as without it.

The unit cases at the bottom drive scheduler/jump_forward.py with a fake matcher and tokenizer, so that the
retokenization and fallback rules are exercised whatever the tiny checkpoint's vocabulary happens to merge.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("xgrammar")

from _http_server import tiny_model_path  # noqa: E402
from radixserve.scheduler import Engine  # noqa: E402
from radixserve.scheduler.jump_forward import jump_forward_ids, stable_prefix  # noqa: E402
from test_structured import SCHEMAS, validate  # noqa: E402

PROMPT = "The answer is"
MAX_NEW = 200

LONG_KEYS = [
    {"type": "object", "properties": {
        "customer_identification_number": {"type": "integer", "minimum": 0, "maximum": 99},
        "preferred_method_of_contact": {"enum": ["email", "phone"]},
        "account_is_currently_active": {"type": "boolean"}},
     "required": ["customer_identification_number", "preferred_method_of_contact", "account_is_currently_active"]},
    {"type": "object", "properties": {
        "name_of_the_shipping_destination_city": {"type": "string", "maxLength": 4},
        "estimated_delivery_window_in_days": {"type": "integer", "minimum": 1, "maximum": 9}},
     "required": ["name_of_the_shipping_destination_city", "estimated_delivery_window_in_days"]},
    {"type": "array", "items": {"type": "object", "properties": {
        "temperature_reading_celsius": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["temperature_reading_celsius"]}, "minItems": 2, "maxItems": 2},
]
ALL_SCHEMAS = SCHEMAS + LONG_KEYS


def params(schema, sampled: bool = False, seed: int = 0, **extra) -> dict:
    p = {"json_schema": schema, "max_new_tokens": MAX_NEW, **extra}
    p.update(temperature=1.0, top_p=0.95, top_k=50, seed=seed) if sampled else p.update(temperature=0.0)
    return p


def make_engine(jump: bool, **kw) -> Engine:
    kw.setdefault("kv_cache_tokens", 16384)
    return Engine(tiny_model_path(), num_threads=1, disable_jump_forward=not jump, **kw)


@pytest.fixture(scope="module")
def engines():
    return {True: make_engine(True), False: make_engine(False)}


def stepped(engine: Engine, jobs, check_every_step: bool = True):
    """Run the jobs (prompt, params) step by step; returns rid -> (result, streamed text, streamed ids)."""
    rids = [engine.add_request(prompt, p) for prompt, p in jobs]
    texts = {r: "" for r in rids}
    ids = {r: [] for r in rids}
    results = {}
    steps = 0
    while engine.has_unfinished():
        for d in engine.step():
            texts[d.rid] += d.text
            ids[d.rid] += d.token_ids
            if d.finished:
                results[d.rid] = d.result
        if check_every_step:
            engine.check_integrity()
            for req in engine.planner.running:
                assert 0 <= req.kv_len <= req.seq_len and len(req.kv_slots) >= req.kv_len
        steps += 1
        assert steps < 20_000
    return {r: (results[r], texts[r], ids[r]) for r in rids}


def counters(engine: Engine) -> dict:
    s = engine.stats()
    return {k: s[k] for k in ("num_steps", "num_forward_tokens", "num_jump_forward_steps",
                              "num_jump_forward_tokens", "num_jump_forward_retokenized")}


def delta(engine: Engine, before: dict) -> dict:
    return {k: v - before[k] for k, v in counters(engine).items()}


# -- engine ---------------------------------------------------------------------------------------


def test_schema_count():
    assert len(ALL_SCHEMAS) >= 10


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_on_and_off_satisfy_the_same_schemas(engines, sampled):
    seeds = [5, 6] if sampled else [0]
    jobs = [(PROMPT, params(s, sampled, seed)) for s in ALL_SCHEMAS for seed in seeds]
    schemas = [s for s in ALL_SCHEMAS for _ in seeds]
    for jump, engine in engines.items():
        before = counters(engine)
        results = engine.generate([p for p, _ in jobs], [p for _, p in jobs])
        for schema, r in zip(schemas, results):
            assert r.finish_reason == "stop", (jump, schema, r.text)
            validate(json.loads(r.text, strict=False), schema)
            assert r.completion_tokens == len(r.output_ids)
        d = delta(engine, before)
        if jump:
            assert d["num_jump_forward_steps"] > 0 and d["num_jump_forward_tokens"] > 0
        else:
            assert d["num_jump_forward_steps"] == 0
        engine.check_integrity()


def test_long_keys_take_fewer_forwards(engines):
    """One request at a time, so num_steps counts its forwards: the fixed keys come in one extend each."""
    steps = {}
    for jump, engine in engines.items():
        before = counters(engine)
        for schema in LONG_KEYS:
            r, = engine.generate([PROMPT], params(schema))
            assert r.finish_reason == "stop"
            validate(json.loads(r.text, strict=False), schema)
        d = delta(engine, before)
        steps[jump] = d["num_steps"]
        if jump:
            assert d["num_jump_forward_tokens"] > 0
    assert steps[True] * 2 <= steps[False], steps


def test_integrity_and_streaming_every_step(engines):
    """A stepped mixed batch: accounting holds after every step, and the streamed deltas (text and ids) add up
    to each final result."""
    engine = engines[True]
    jobs = [(PROMPT, params(s, True, 3)) for s in ALL_SCHEMAS]
    jobs += [(PROMPT + " plain", dict(max_new_tokens=12, temperature=0.0, ignore_eos=True))]
    before = counters(engine)
    out = stepped(engine, jobs)
    assert delta(engine, before)["num_jump_forward_tokens"] > 0
    for (_, p), (result, text, ids) in zip(jobs, out.values()):
        assert text == result.text
        assert ids == result.output_ids
        if "json_schema" in p:
            assert result.finish_reason == "stop"
            validate(json.loads(result.text, strict=False), p["json_schema"])


def test_logprob_requests_do_not_jump(engines):
    engine = engines[True]
    before = counters(engine)
    num_tokens = 0
    for schema in LONG_KEYS:
        r, = engine.generate([PROMPT], params(schema, logprobs=2))
        assert r.finish_reason == "stop"
        assert len(r.logprobs) == r.completion_tokens
        validate(json.loads(r.text, strict=False), schema)
        num_tokens += r.completion_tokens
    d = delta(engine, before)
    assert d["num_jump_forward_steps"] == 0
    assert d["num_steps"] == num_tokens  # one forward per token


@pytest.mark.parametrize("stop", [dict(stop=["identification"]), dict(stop_regex=r"identif\w+")],
                         ids=["stop", "stop_regex"])
def test_stops_inside_forced_text(engines, stop):
    """The key is forced text: its stop string still ends the request, cut there, and never streamed."""
    schema = LONG_KEYS[0]
    for jump, engine in engines.items():
        before = counters(engine)
        out = stepped(engine, [(PROMPT, params(schema, **stop))])
        (result, text, _), = out.values()
        assert result.finish_reason == "stop"
        assert result.text == text == '{"customer_', result.text
        assert result.matched_stop == (stop.get("stop") or [stop.get("stop_regex")])[0]
        if jump:
            assert delta(engine, before)["num_jump_forward_tokens"] > 0


def test_max_new_tokens_caps_forced_tokens(engines):
    engine = engines[True]
    for cap in (3, 6, 11):
        before = counters(engine)
        r, = engine.generate([PROMPT], params(LONG_KEYS[0], max_new_tokens=cap))
        assert r.finish_reason == "length"
        assert r.completion_tokens == len(r.output_ids) == cap
        assert '{"customer_identification_number":'.startswith(r.text), r.text
    assert delta(engine, before)["num_jump_forward_tokens"] > 0
    engine.check_integrity()


def test_small_pool_retracts_and_stays_valid(engines):
    """Requests whose outputs outgrow a small pool: retraction (with forced tokens still pending) keeps every
    output valid, equal to the big pool's (greedy) and the accounting whole after every step."""
    from _engine_helpers import shared_prefix_prompts

    prompts = shared_prefix_prompts(8, prefix_len=24, seed=5)
    schema = LONG_KEYS[0]
    jobs = [(p, params(schema, max_new_tokens=80)) for p in prompts]
    expected = engines[True].generate(prompts, [p for _, p in jobs])
    engine = make_engine(True, kv_cache_tokens=160, page_size=4)
    out = stepped(engine, jobs)
    stats = engine.stats()
    assert stats["num_retractions"] > 0
    assert stats["num_jump_forward_tokens"] > 0
    for exp, (result, text, ids) in zip(expected, out.values()):
        assert result.finish_reason == "stop", result.text
        validate(json.loads(result.text, strict=False), schema)
        assert text == result.text and ids == result.output_ids == exp.output_ids
    engine.shutdown()


def test_cli_flag():
    from radixserve.frontend.cli import build_parser
    from radixserve.frontend.flags import config_from_args

    assert not config_from_args(build_parser().parse_args(["serve"])).engine.disable_jump_forward
    cfg = config_from_args(build_parser().parse_args(["serve", "--disable-jump-forward"]))
    assert cfg.engine.disable_jump_forward


# -- unit: retokenization and fallbacks -------------------------------------------------------------


class FakeTokenizer:
    """Greedy longest match over a tiny vocabulary; decoding joins the pieces."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces
        self.ids = {p: i for i, p in enumerate(pieces)}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out = []
        while text:
            piece = max((p for p in self.pieces if text.startswith(p)), key=len)
            out.append(self.ids[piece])
            text = text[len(piece):]
        return out

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


class FakeMatcher:
    """Accepts any token sequence whose text is a prefix of `language`; `refuse` ids are never accepted."""

    def __init__(self, tok: FakeTokenizer, language: str, forced: str, refuse=()):
        self.tok, self.language, self.forced, self.refuse = tok, language, forced, set(refuse)
        self.accepted: list[int] = []

    def text(self) -> str:
        return self.tok.decode(self.accepted)

    def accept_token(self, tid: int) -> bool:
        if tid in self.refuse or not self.language.startswith(self.text() + self.tok.pieces[tid]):
            return False
        self.accepted.append(tid)
        return True

    def rollback(self, num: int) -> None:
        del self.accepted[len(self.accepted) - num:]

    def find_jump_forward_string(self) -> str:
        return self.forced if self.text() == '{"' else ""


PIECES = ['{', '"', '{"', 'name', '":', '"name', 'na', 'me', ':', ' ', '<s>']


@pytest.fixture
def tok():
    return FakeTokenizer(PIECES)


def start(tok, refuse=()):
    m = FakeMatcher(tok, '{"name": 1}', 'name":', refuse)
    assert m.accept_token(tok.ids['{']) and m.accept_token(tok.ids['"'])
    return m


def test_retokenization_replaces_the_sampled_token(tok):
    m = start(tok)
    ids, replaced = jump_forward_ids(m, tok, [tok.ids['{']], tok.ids['"'], 10, frozenset())
    # Forced 'name":' is cut to its stable prefix 'name': the '":' after it is the model's to write.
    assert replaced and tok.decode(ids) == '"name'
    assert ids == [tok.ids['"name']]
    assert m.text() == '{"name'


def test_rejected_retokenization_falls_back_to_plain(tok):
    m = start(tok, refuse={tok.ids['"name']})
    ids, replaced = jump_forward_ids(m, tok, [tok.ids['{']], tok.ids['"'], 10, frozenset())
    assert not replaced and ids[0] == tok.ids['"'] and tok.decode(ids) == '"name'
    assert m.text() == '{"name'


@pytest.mark.parametrize("forced, stable", [
    ('name":', "name"), ('"arguments": {', '"arguments'), ('city": "', "city"), ("abc", ""), ('": ', ""),
    ('get_forecast", "arguments', 'get_forecast'), ("1, 2]", "1, 2"), ("", ""),
])
def test_stable_prefix_ends_where_a_word_meets_punctuation(forced, stable):
    assert stable_prefix(forced) == stable


def test_a_forced_string_ending_in_an_added_token_is_forced_whole(tok):
    tok.added_token_ids = frozenset({tok.ids['<s>']})
    m = FakeMatcher(tok, '{"name<s>', 'name<s>')
    assert m.accept_token(tok.ids['{']) and m.accept_token(tok.ids['"'])
    ids, replaced = jump_forward_ids(m, tok, [tok.ids['{']], tok.ids['"'], 10, frozenset())
    assert tok.decode(ids) == '"name<s>' and m.text() == '{"name<s>'


def test_all_rejected_means_no_jump_and_the_matcher_unchanged(tok):
    m = start(tok, refuse={tok.ids['"name'], tok.ids['name']})
    assert jump_forward_ids(m, tok, [tok.ids['{']], tok.ids['"'], 10, frozenset()) is None
    assert m.text() == '{"'


def test_special_ids_are_never_forced(tok):
    m = start(tok)
    special = frozenset({tok.ids['"name'], tok.ids['name']})
    assert jump_forward_ids(m, tok, [tok.ids['{']], tok.ids['"'], 10, special) is None
    assert m.text() == '{"'


def test_room_caps_the_jump(tok):
    m = start(tok)
    assert jump_forward_ids(m, tok, [tok.ids['{']], tok.ids['"'], 1, frozenset()) is None  # t alone fits
    m = start(tok, refuse={tok.ids['"name']})  # plain: '"', 'name', '":' capped at two
    ids, replaced = jump_forward_ids(m, tok, [tok.ids['{']], tok.ids['"'], 2, frozenset())
    assert ids == [tok.ids['"'], tok.ids['name']] and not replaced
    assert m.text() == '{"name'
