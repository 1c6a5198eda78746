"""The synthetic training corpus of the built-in demo model (bench/demo_kit/train.py): chat conversations made from
small fact tables and phrasing templates, with a fixed seed, so the same code always gives the same corpus.

What is in it: greetings and small talk; capitals and calendar facts as short answers; sums (bench/demo_kit/arith.py:
one-digit facts, two-digit sums column by column), small differences and products; a JSON reply; copying; tool use
in the chat template's tool-call syntax (get_weather(city), calculator(expression), with the tool's result and a
final answer); and ReAct traces in the format of lang/examples/react.py. Some things are held out on
purpose so that tests can measure what generalises: HELDOUT_PHRASINGS (question templates never trained on),
HELDOUT_CITIES (never seen in a weather conversation), is_heldout_pair (two-digit sums never asked), and
STATEMENT_ONLY (countries whose capital appears only in plain statements, never as an answer to a question).

A conversation is a Sample: messages and tools for the chat template, or raw text (statements); `trainable` says
which assistant pieces the loss sees (tool results and prompts are context only).
"""
from __future__ import annotations

import json
import random
from typing import Any

from .arith import SUM_MAX, arithmetic_qa, is_heldout_pair
from .react import react_sample
from .sample import Sample

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Russia": "Moscow", "Canada": "Ottawa",
    "Mexico": "Mexico City", "Brazil": "Brasilia", "Argentina": "Buenos Aires", "Peru": "Lima", "Chile": "Santiago",
    "Egypt": "Cairo", "Kenya": "Nairobi", "Nigeria": "Abuja", "Morocco": "Rabat", "Greece": "Athens",
    "Turkey": "Ankara", "Poland": "Warsaw", "Austria": "Vienna", "Sweden": "Stockholm", "Norway": "Oslo",
    "Finland": "Helsinki", "Denmark": "Copenhagen", "Ireland": "Dublin", "Belgium": "Brussels",
    "Netherlands": "Amsterdam", "Switzerland": "Bern", "Hungary": "Budapest", "Australia": "Canberra",
    "Thailand": "Bangkok", "Vietnam": "Hanoi", "Indonesia": "Jakarta", "Iran": "Tehran", "Cuba": "Havana",
    "Iceland": "Reykjavik", "Ukraine": "Kyiv", "Colombia": "Bogota", "Ghana": "Accra", "Nepal": "Kathmandu",
    "Mongolia": "Ulaanbaatar", "Jamaica": "Kingston", "Uganda": "Kampala", "Ethiopia": "Addis Ababa",
    "Scotland": "Edinburgh", "England": "London", "South Korea": "Seoul",
}
# Capitals that appear only in statements ("The capital of Peru is Lima."), never as the answer to a question.
STATEMENT_ONLY = ("Peru", "Finland", "Ghana", "Mongolia")

CAPITAL_PHRASINGS = (
    "What is the capital of {c}?", "What's the capital of {c}?", "Which city is the capital of {c}?",
    "Tell me the capital of {c}.", "Name the capital of {c}.", "capital of {c}?", "What is {c}'s capital?",
    "I would like to know the capital of {c}.", "Please name the capital of {c}.",
    "Could you tell me the capital of {c}?",
)
WEATHER_PHRASINGS = (
    "What is the weather in {c}?", "What's the weather like in {c}?", "How is the weather in {c} today?",
    "Tell me the weather in {c}.", "Weather in {c}?", "Can you check the weather in {c}?",
    "Is it raining in {c}?", "I am going to {c}. What is the weather there?", "Please tell me the weather in {c}.",
    "Could you get the weather for {c}?", "Check the weather in {c}, please.",
)
# Weather questions are also composed from parts, so that the model finds the city by what it is, not by where a
# fixed template puts it; a composed question equal to a held-out phrasing is drawn again.
WEATHER_OPENERS = ("", "", "Can you ", "Could you ", "I need to ", "Please ", "Help me ", "I want to ", "Try to ")
WEATHER_VERBS = ("check", "get", "find", "tell me", "give me", "report")
WEATHER_NOUNS = ("the weather", "the current weather", "the weather conditions", "today's weather", "the forecast")
WEATHER_PREPS = ("in", "for", "at")
CALC_PHRASINGS = ("What is {e}?", "Calculate {e}.", "Please compute {e}.", "Use the calculator: {e}",
                  "How much is {e}?")
# Never trained on; tests use them to check that phrasing generalises.
HELDOUT_PHRASINGS = {
    "capital": ("Do you know the capital of {c}?", "Please tell me what the capital of {c} is."),
    "sum": ("Can you tell me what {a} + {b} is?", "Please add {a} and {b}."),
    "weather": ("Do you know the weather in {c}?", "Please look up the weather for {c}."),
}

WEATHER_CITIES = (
    "Paris", "London", "Berlin", "Tokyo", "Madrid", "Rome", "Oslo", "New York", "Chicago", "Boston", "Toronto",
    "Sydney", "Melbourne", "Dubai", "Mumbai", "Delhi", "Shanghai", "Beijing", "Seoul", "Bangkok", "Singapore",
    "Cairo", "Istanbul", "Athens", "Vienna", "Prague", "Warsaw", "Dublin", "Amsterdam", "Brussels", "Zurich",
    "Geneva", "Munich", "Hamburg", "Milan", "Naples", "Barcelona", "Seville", "Porto", "Stockholm", "Helsinki",
    "Copenhagen", "Moscow", "Kyiv", "Budapest", "Lima", "Bogota", "Santiago", "Havana", "Miami", "Denver",
    "Seattle", "Austin", "Dallas", "Houston", "Phoenix", "Atlanta", "Vancouver", "Montreal", "Osaka", "Hanoi",
    "Manila", "Jakarta", "Lagos", "Accra", "Casablanca", "Tunis", "Tehran", "Baghdad", "Karachi", "Dhaka",
    "Kathmandu", "Perth", "Auckland", "Wellington", "Cape Town", "Johannesburg", "San Francisco", "Los Angeles",
    "Rio de Janeiro", "Sao Paulo", "Buenos Aires", "Mexico City", "Edinburgh", "Glasgow", "Manchester", "Lyon",
    "Marseille", "Nice", "Bordeaux", "Florence", "Venice", "Krakow", "Riga", "Tallinn", "Vilnius", "Sofia",
)
# Never in a weather conversation (some are capitals, so they do appear in capital facts).
HELDOUT_CITIES = ("Lisbon", "Nairobi", "Reykjavik", "Montevideo", "Kyoto", "Bucharest")
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "clear", "stormy")

DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
MONTH_DAYS = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)

SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a friendly assistant. Answer briefly.",
                  "You are a helpful assistant that answers in one short sentence.")
GREETINGS = ("Hello! ", "Hi! ", "Hi, ", "Hey! ", "Hello, ", "Good morning! ")
SMALL_TALK = (
    (("Hello!", "Hello", "Hi!", "Hi", "Hey!", "Hello there!", "Good morning!", "Good evening!"),
     "Hello! How can I help you today?"),
    (("How are you?", "How are you today?", "How are you doing?", "Hi! How are you?"),
     "I am fine, thank you! How can I help you?"),
    (("Who are you?", "What are you?", "What is your name?", "Tell me about yourself."),
     "I am the radixserve demo model, a small model that answers simple questions and can call tools."),
    (("What can you do?", "How can you help me?", "What do you know?"),
     "I can answer simple questions about capitals, arithmetic and dates, and I can call tools such as "
     "get_weather and calculator."),
    (("Thank you!", "Thanks!", "Thank you very much.", "Thanks a lot!"), "You are welcome!"),
    (("Goodbye!", "Bye!", "See you later!", "Good night!"), "Goodbye! Have a nice day."),
    (("Tell me a joke.", "Do you know a joke?"),
     "Why did the robot go on holiday? It needed to recharge its batteries."),
    (("Write a short poem.", "Write me a poem."),
     "The sun goes down, the stars come out,\nthe night is calm, without a doubt."),
)

NAMES = ("Alice", "Bob", "Carla", "David", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kofi", "Lena",
         "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara")
SYLLABLES = ("ka ko ra ro ta to na no ma mo sa so la lo pa po ba bo da do ga go ve vi ze fa fo ha ho ja jo we "
             "ya tra pre cli dro ste ben mar lin tor san del").split()
# Letters of invented place names: any letter can start or follow, so that their tokens are as varied as a real
# name's ("Lisbon" is L-is-b-on, "Nairobi" N-a-i-ro-bi): the model must copy tokens, not recall a syllable list.
ONSETS = tuple("bcdfghjklmnprstvwyzq") + ("ch", "sh", "th", "kr", "br", "st", "ny", "gr", "pl", "tr", "x", "kh")
VOWELS = tuple("aeiouy") + ("ai", "ei", "ou", "ia", "io", "ee", "oo", "au")
CODAS = ("", "", "", "n", "r", "s", "l", "k", "m", "t", "st", "nd", "rk", "x", "sh")
# Wrapped around any question (never the held-out phrasings' own words).
PREFIXES = ("", "", "", "", "", "Quick question: ", "Hey, ", "Question: ", "I wonder: ", "Help me out. ")
SUFFIXES = ("", "", "", "", "", " Thanks!", " Thank you.", " Answer briefly.", " Be quick.")

WEATHER_DESCRIPTIONS = ("Get the current weather in a city", "Get the weather for a city",
                        "Current weather conditions for a city.", "Look up the weather in a given city")
CALC_DESCRIPTIONS = ("Evaluate an arithmetic expression", "A calculator for arithmetic expressions",
                     "Compute the value of a math expression.")


class Generator:
    """Deterministic stream of samples: Generator(seed).sample() in a fixed order."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.kinds = (
            (self.small_talk, 4), (self.capital, 8), (self.arithmetic, 28), (self.calendar, 3), (self.json, 3),
            (self.statement, 2), (self.weather, 18), (self.calculator, 4), (self.react, 5), (self.two_turns, 3),
            (self.copy, 20),
        )

    def sample(self) -> Sample:
        makers, weights = zip(*self.kinds)
        return self.rng.choices(makers, weights)[0]()

    # -- plain answers -------------------------------------------------------------------------------------------

    def _chat(self, question: str, answer: str, *, greet: bool = True, tools: list | None = None) -> Sample:
        r = self.rng
        if greet:
            question = self._wrap(question)
        messages = [{"role": "system", "content": r.choice(SYSTEM_PROMPTS)}] if r.random() < 0.35 else []
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return Sample(messages, tools, [None])

    def _wrap(self, question: str) -> str:
        r = self.rng
        if r.random() < 0.15:
            return r.choice(GREETINGS) + question
        return r.choice(PREFIXES) + question + r.choice(SUFFIXES)

    def small_talk(self) -> Sample:
        questions, answer = self.rng.choice(SMALL_TALK)
        return self._chat(self.rng.choice(questions), answer, greet=False, tools=self._maybe_tools(0.2))

    def capital_qa(self) -> tuple[str, str]:
        country = self.rng.choice([c for c in CAPITALS if c not in STATEMENT_ONLY])
        q = self.rng.choice(CAPITAL_PHRASINGS).format(c=country)
        return q, f"The capital of {country} is {CAPITALS[country]}."

    def capital(self) -> Sample:
        return self._chat(*self.capital_qa(), tools=self._maybe_tools(0.12))

    def arithmetic_qa(self) -> tuple[str, str]:
        return arithmetic_qa(self.rng)

    def arithmetic(self) -> Sample:
        return self._chat(*self.arithmetic_qa(), tools=self._maybe_tools(0.05, calculator=False))

    def calendar(self) -> Sample:
        r = self.rng
        kind = r.randrange(4)
        if kind == 0:
            i = r.randrange(7)
            q = r.choice(("What day comes after {d}?", "Which day follows {d}?", "What is the day after {d}?"))
            return self._chat(q.format(d=DAYS[i]), f"The day after {DAYS[i]} is {DAYS[(i + 1) % 7]}.")
        if kind == 1:
            i = r.randrange(12)
            q = r.choice(("What month comes after {m}?", "Which month follows {m}?", "What is the month after {m}?"))
            return self._chat(q.format(m=MONTHS[i]), f"The month after {MONTHS[i]} is {MONTHS[(i + 1) % 12]}.")
        if kind == 2:
            i = r.randrange(12)
            q = r.choice(("How many days are in {m}?", "How many days does {m} have?"))
            extra = " (29 in a leap year)" if i == 1 else ""
            return self._chat(q.format(m=MONTHS[i]), f"{MONTHS[i]} has {MONTH_DAYS[i]} days{extra}.")
        i = r.randrange(12)
        q = r.choice(("Which month is number {n}?", "What is month number {n} of the year?"))
        return self._chat(q.format(n=i + 1), f"Month number {i + 1} is {MONTHS[i]}.")

    def json(self) -> Sample:
        r = self.rng
        name, age = r.choice(NAMES + tuple(self._name() for _ in range(4))), r.randint(18, 90)
        city = r.choice(WEATHER_CITIES)
        q = r.choice(("Reply with a JSON object with the name {n} and the age {a}.",
                      "Give me JSON for a person called {n}, age {a}.",
                      "Write a JSON object: name {n}, age {a}, city {c}."))
        body = {"name": name, "age": age}
        if "{c}" in q:
            body["city"] = city
        return self._chat(q.format(n=name, a=age, c=city), json.dumps(body), greet=False)

    def copy(self) -> Sample:
        """Copy a name or phrase from the prompt (what a tool call's arguments need)."""
        r = self.rng
        words = [self._name() if r.random() < 0.75 else r.choice(WEATHER_CITIES + NAMES)
                 for _ in range(r.randint(1, 3))]
        phrase = " ".join(words)
        kind = r.randrange(4)
        if kind == 0:
            return self._chat(f"Repeat after me: {phrase}", phrase, greet=False)
        if kind == 1:
            return self._chat(f"My name is {phrase}. What is my name?", f"Your name is {phrase}.", greet=False)
        if kind == 2:
            return self._chat(f"Say {phrase}.", f"{phrase}.", greet=False)
        # As a tool call writes it: right after a quote, where its first token differs from the prompt's.
        key = r.choice(("city", "name", "place", "word"))
        return self._chat(f"Write {phrase} as JSON with the key {key}.", json.dumps({key: phrase}), greet=False)

    def statement(self) -> Sample:
        country = self.rng.choice(list(CAPITALS))
        capital = CAPITALS[country]
        form = self.rng.choice(("The capital of {c} is {k}.", "{k} is the capital of {c}.",
                                "{k} is the capital city of {c}.", "The capital city of {c} is {k}."))
        return Sample(text=form.format(c=country, k=capital))

    def two_turns(self) -> Sample:
        first = self.rng.choice((self.capital_qa, self.arithmetic_qa))()
        second = self.rng.choice((self.capital_qa, self.arithmetic_qa))()
        messages = [{"role": "user", "content": first[0]}, {"role": "assistant", "content": first[1]},
                    {"role": "user", "content": second[0]}, {"role": "assistant", "content": second[1]}]
        return Sample(messages, None, [None, None])

    # -- tools ---------------------------------------------------------------------------------------------------

    def _word(self) -> str:
        r = self.rng
        return "".join(r.choice(SYLLABLES) for _ in range(r.randint(2, 3))).capitalize()

    def _letters(self) -> str:
        """An invented name from letters: 1-4 syllables of onset, vowel and (sometimes) coda."""
        r = self.rng
        word = "".join(r.choice(ONSETS) * (r.random() < 0.85) + r.choice(VOWELS) + r.choice(CODAS)
                       for _ in range(r.randint(1, 4)))
        return word.capitalize()

    def _name(self) -> str:
        """An invented place name: one or (sometimes) two invented words."""
        r = self.rng
        word = self._letters if r.random() < 0.75 else self._word
        return word() if r.random() < 0.85 else f"{word()} {self._letters()}"

    def _tool_schema(self, name: str) -> dict[str, Any]:
        r = self.rng
        arg, descriptions = ("city", WEATHER_DESCRIPTIONS) if name == "get_weather" else \
            ("expression", CALC_DESCRIPTIONS)
        prop: dict[str, Any] = {"type": "string"}
        if r.random() < 0.5:
            prop["description"] = r.choice(("The city name", "Name of the city", "City, e.g. Paris")) \
                if arg == "city" else r.choice(("The expression, e.g. 2 + 3", "An arithmetic expression"))
        fn: dict[str, Any] = {"name": name}
        if r.random() < 0.85:
            fn["description"] = r.choice(descriptions)
        fn["parameters"] = {"type": "object", "properties": {arg: prop}, "required": [arg]}
        return {"type": "function", "function": fn}

    def _tools(self, need: str) -> list[dict[str, Any]]:
        names = [need]
        other = "calculator" if need == "get_weather" else "get_weather"
        if self.rng.random() < 0.5:
            names.append(other)
        self.rng.shuffle(names)
        return [self._tool_schema(n) for n in names]

    def _maybe_tools(self, p: float, calculator: bool = True) -> list | None:
        if self.rng.random() >= p:
            return None
        return self._tools("calculator") if calculator and self.rng.random() < 0.5 else self._tools("get_weather")

    def _city(self) -> str:
        # Mostly invented names: a name the model cannot recall from a list must be copied from the prompt.
        return self.rng.choice(WEATHER_CITIES) if self.rng.random() < 0.25 else self._name()

    def _conversation(self, tools, first) -> Sample:
        """A tool conversation: the round `first` makes, then often one to three more (another tool round or a
        plain question), all under one tool preamble, as an agent's session runs."""
        r = self.rng
        messages = [{"role": "system", "content": r.choice(SYSTEM_PROMPTS)}] if r.random() < 0.3 else []
        names = [t["function"]["name"] for t in tools]
        rounds = [first]
        for _ in range(r.choices((0, 1, 2, 3), (3, 3, 2, 2))[0]):
            pick = r.random()
            if pick < 0.35:
                rounds.append(None)  # a question that needs no tool
            else:
                rounds.append(self.weather_round if "get_weather" in names and (pick < 0.7 or len(names) == 1)
                              else self.calculator_round)
        turns = 0
        for k, make in enumerate(rounds):
            if make is None:
                question, answer = r.choice((self.capital_qa, self.arithmetic_qa))()
                messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
                turns += 1
                continue
            question, name, args, result, final = make()
            call = {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            messages += [{"role": "user", "content": question},
                         {"role": "assistant", "content": None, "tool_calls": [call]}]
            turns += 1
            if k == len(rounds) - 1 and r.random() < 0.15:  # the call alone: the client sees it and stops
                break
            content = result if isinstance(result, str) else json.dumps(result)
            messages += [{"role": "tool", "content": content}, {"role": "assistant", "content": final}]
            turns += 1
        return Sample(messages, tools, [None] * turns)

    def weather_round(self) -> tuple[str, str, dict, Any, str]:
        r = self.rng
        city = self._city()
        question = self._wrap(self._weather_question(city))
        temp, cond = r.randint(-10, 35), r.choice(CONDITIONS)
        result: dict[str, Any] = {"temperature": temp, "condition": cond}
        if r.random() < 0.5:
            result = {"city": city, **result}
        if r.random() < 0.3:
            result["unit"] = "celsius"
        return question, "get_weather", {"city": city}, result, f"It is {cond} and {temp} degrees in {city}."

    def _weather_question(self, city: str) -> str:
        r = self.rng
        heldout = {p.format(c=city) for p in HELDOUT_PHRASINGS["weather"]}
        while True:
            if r.random() < 0.5:
                question = r.choice(WEATHER_PHRASINGS).format(c=city)
            else:
                opener = r.choice(WEATHER_OPENERS)
                verb = r.choice(WEATHER_VERBS)
                question = (f"{opener}{verb} {r.choice(WEATHER_NOUNS)} {r.choice(WEATHER_PREPS)} {city}"
                            + ("?" if opener in ("Can you ", "Could you ") else r.choice((".", "", "!"))))
                question = question[0].upper() + question[1:]
            if question not in heldout:
                return question

    def weather(self) -> Sample:
        if self.rng.random() < 0.08:  # no tool to call: say so
            question = self._wrap(self._weather_question(self._city()))
            return self._chat(question, "I cannot check the weather: I have no weather tool.", greet=False)
        return self._conversation(self._tools("get_weather"), self.weather_round)

    def calculator_round(self) -> tuple[str, str, dict, Any, str]:
        r = self.rng
        a, b = r.randint(2, 999), r.randint(2, 99)
        while a <= SUM_MAX and b <= SUM_MAX and is_heldout_pair(a, b):  # never a held-out pair, even with a tool
            a = r.randint(100, 999)
        op = r.choice("+-*/")
        expr = f"{a} {op} {b}"
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op]
        text = f"{value:g}" if isinstance(value, float) else str(value)
        result = text if r.random() < 0.5 else {"result": value}
        question = r.choice(CALC_PHRASINGS).format(e=expr)
        return question, "calculator", {"expression": expr}, result, f"{expr} = {text}."

    def calculator(self) -> Sample:
        return self._conversation(self._tools("calculator"), self.calculator_round)

    # -- ReAct ---------------------------------------------------------------------------------------------------

    def react(self) -> Sample:
        return react_sample(self.rng)
