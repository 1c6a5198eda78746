"""The built-in training text of the demo tokenizer: English-ish prose, chat and tool-call phrasing, JSON, code,
numbers, a little non-ASCII text, and a deterministic stream of invented words so that BPE training can fill
vocabularies of a few thousand ids. Changing anything here changes every demo/test tokenizer (and the demo cache key).
"""
from __future__ import annotations

_PROSE = """\
The quick brown fox jumps over the lazy dog while the old cat sleeps in the warm sun.
A serving engine keeps the keys and values of every prompt it has seen, so that a second request
which starts with the same words can skip the work that was already done.
When many users share one long system prompt, the cache turns most of the prompt into a simple lookup.
The weather in Paris is mild today, with light rain in the morning and a clear sky in the evening.
What is the weather like in London, Berlin, Tokyo, Madrid, Rome, Oslo and New York this week?
Please tell me the time, the date, the temperature and the chance of rain for tomorrow.
The assistant answers questions, writes short stories, explains code and calls tools when it needs facts.
You are a helpful assistant. Answer briefly and politely. Think step by step before you answer.
The user asked for a summary of the report, and the assistant wrote three clear sentences.
Hello! How are you? I am fine, thank you. Good morning, good evening, good night and goodbye.
Yes, no, maybe, always, never, sometimes, often, usually, rarely, today, tomorrow, yesterday.
One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, twenty, hundred, thousand.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday; January, February, March, April, May, June,
July, August, September, October, November, December; spring, summer, autumn, winter.
Red, orange, yellow, green, blue, purple, black, white, gray, brown and pink are colors.
The river runs past the village, under the stone bridge, through the forest and down to the sea.
She opened the window, looked at the mountains and decided to walk to the lake before lunch.
They cooked rice, beans, bread, soup, cheese, apples, bananas, oranges, tomatoes, potatoes and fish.
The train leaves the station at nine o'clock and arrives in the city two hours later.
Our team builds fast tools for science, music, art, history, language, travel and sports.
The computer reads the file, parses each line, counts the words and prints the result.
Memory is limited, so the engine evicts the least recently used pages first and never the locked ones.
Every token has an id; every id has a vector; every vector passes through many layers of the model.
A story begins: once upon a time there was a small robot who wanted to learn how to sing.
The answer is forty two. The end. Stop here. Done. Finished. Nothing more to say.
"""

_CHAT = """\
system user assistant tool function call calls arguments name description parameters properties type
required string number integer boolean object array enum result results response error message content
<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
What is the weather in Paris?<|im_end|>
<|im_start|>assistant
<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{"temperature": 21, "unit": "celsius", "condition": "sunny"}
</tool_response><|im_end|>
<|im_start|>assistant
It is sunny and 21 degrees in Paris.<|im_end|>
{"type": "function", "function": {"name": "get_time", "description": "Get the current time in a city",
"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
{"name": "search", "arguments": {"query": "best pizza in Rome", "limit": 5}}
"""

_CODE = """\
def add(a, b):
    return a + b

for i in range(10):
    print(i, i * i, "value =", i + 1)

class Counter:
    def __init__(self):
        self.count = 0

    def step(self) -> int:
        self.count += 1
        return self.count

if x == 0 and y != 1 or z >= 2:
    result = [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]
else:
    result = {"key": "value", "list": [10, 20, 30], "ok": true, "none": null}
x = 3.14159; y = -2.5e-3; z = 1_000_000; url = "https://example.com/api/v1/items?id=42&page=7"
"""

# Non-ASCII text. Each of these lines appears twice in the corpus except the last one, whose emoji bytes thus
# never merge (pairs seen once are not merged): multi-byte characters stay split across tokens in the vocabulary.
_WORLD = """\
héllo wörld, café, naïve, résumé, über, señor, déjà vu, crème brûlée
你好，世界。今天天气很好。
こんにちは世界
Привет, мир! Как дела?
"""
_ONCE = "héllo 世界 🚀\n"

# Words that are guaranteed single tokens, alone and after a space (scripted checkpoints use them as triggers).
TRIGGER_WORDS = ("weather", "hello", "story", "answer", "poem", "count", "emoji", "tool", "stop", "greeting")
_TRIGGERS = (" ".join(TRIGGER_WORDS) + "\n") * 2 + "\n".join(TRIGGER_WORDS) + "\n"

_SYLLABLES = (
    "ka ko ki ra ro ri ta to ti na no ni ma mo mi sa so si la lo li pa po pi ba bo bi da do di ga go gi va vo "
    "vi ze zo fa fo fi ha ho hi ja jo wa we ya yo tra pre cli dro ste ben mar lin tor ver san del"
).split()


def _invented_words() -> str:
    """A deterministic stream of pronounceable invented words (each written at least twice)."""
    n = len(_SYLLABLES)
    words = []
    for i in range(n):
        for j in range(0, n, 3):
            k = (i * 7 + j * 5) % n
            words.append(_SYLLABLES[i] + _SYLLABLES[(i + j) % n] + _SYLLABLES[k])
    lines = [" ".join(words[start : start + 12]) for start in range(0, len(words), 12)]
    text = ".\n".join(line.capitalize() for line in lines) + ".\n"
    return text + text


def corpus() -> str:
    """The full training text (a pure function of this module's source)."""
    base = _PROSE + _CHAT + _CODE + _WORLD + _TRIGGERS
    return base * 3 + _invented_words() + _ONCE
