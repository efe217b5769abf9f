"""Regenerate tools/data/corpus.txt, the text the tiny models' tokenizer is trained on.

The corpus is committed (the Makefile depends on it); this script documents where it came from
and rebuilds it byte for byte: hand-written prose (tools/data/prose.txt), sentences generated from
small word banks, chat-like exchanges, and a lot of arithmetic (the RL demo trains arithmetic, so
its prompts and answers should tokenize into short sequences). Everything comes from one seeded
``random.Random``; no network, no external data set.

It does not train anything; tools/tiny_model.py does.

    .venv/bin/python tools/make_corpus.py            # rewrites tools/data/corpus.txt
"""

from __future__ import annotations

import random
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
SEED = 1234


def _split(words: str, sep: str | None = None) -> tuple[str, ...]:
    return tuple(words.split(sep))


NAMES = _split("Anna Ben Carla David Elena Farid Grace Hugo Iris Jonas Kira Leo Maya Nadia Omar Paula "
               "Quinn Rosa Sam Tara Umar Vera Will Xenia Yusuf Zoe Alice Bruno Chen Dara Emil Fatima "
               "George Hana Ivan Julia Karl Lena Marco Nora Oscar Priya Ravi Sofia Tom Ursula Victor Wendy")
PLACES = _split("the market|the station|the library|the harbor|the garden|the kitchen|the school|the park|"
                "the museum|the bakery|the river|the forest|the village|the city|the beach|the farm|"
                "the office|the workshop|the hospital|the bridge|the hill|the lake|the square|the shop", "|")
OBJECTS = _split("apples|books|pencils|coins|cups|eggs|flowers|stamps|marbles|shells|cards|boxes|bottles|"
                 "candles|buttons|letters|tickets|oranges|cookies|stones|keys|ribbons|plates|bags", "|")
ADJECTIVES = _split("quiet bright small large old new warm cold busy empty green red blue yellow heavy light "
                    "careful patient quick slow gentle strange simple clever tired happy curious")
VERBS = _split("walked ran looked waited listened worked read wrote painted cooked cleaned counted sang "
               "laughed rested studied traveled returned arrived smiled wondered")
TIMES = _split("in the morning|at noon|in the afternoon|in the evening|at night|on Monday|on Tuesday|"
               "on Wednesday|on Thursday|on Friday|on Saturday|on Sunday|last week|yesterday|today|"
               "in spring|in summer|in autumn|in winter", "|")
WEATHER = _split("it was raining|the sun was shining|the wind was strong|snow was falling|the sky was grey|"
                 "the air was warm|fog covered the streets|a storm was coming", "|")
TOPICS = {
    "the ocean": "The ocean covers most of the surface of the Earth and holds most of its water.",
    "the moon": "The moon goes around the Earth about once a month and reflects the light of the sun.",
    "bees": "Bees collect nectar from flowers and turn it into honey inside the hive.",
    "trees": "Trees take in carbon dioxide and give off oxygen, and their roots hold the soil in place.",
    "rain": "Rain forms when water vapor in clouds cools and gathers into drops heavy enough to fall.",
    "bread": "Bread is made from flour, water, salt and yeast, which makes the dough rise.",
    "the heart": "The heart is a muscle that pumps blood through the body.",
    "volcanoes": "A volcano is an opening in the ground where hot melted rock comes to the surface.",
    "maps": "A map is a drawing of a place that shows where things are in relation to each other.",
    "clocks": "A clock measures time by counting the steady swings or vibrations of something inside it.",
    "prime numbers": "A prime number is a whole number greater than one whose only divisors are one and itself.",
    "even numbers": "An even number can be divided by two with nothing left over.",
    "fractions": "A fraction describes a part of a whole, such as one half or three quarters.",
    "zero": "Zero is the number that, added to any number, leaves it unchanged.",
}
GREETINGS = (("Hello!", "Hello! How can I help you today?"),
             ("Hi there.", "Hi! What would you like to talk about?"),
             ("Good morning.", "Good morning! I hope your day is going well."),
             ("Thank you.", "You are welcome."),
             ("Can you help me with some math?",
              "Of course. Tell me the problem and I will work through it."),
             ("Who are you?", "I am a small assistant. I answer questions and do arithmetic."),
             ("Goodbye.", "Goodbye! Have a nice day."))
SYSTEMS = ("You are a helpful assistant.", "You are a careful math tutor. Give the final answer.",
           "Answer briefly.", "You solve arithmetic problems step by step.")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
OP_WORDS = {"+": "plus", "-": "minus", "*": "times"}


def _sentence(r: random.Random) -> str:
    name, place, adj, verb, time = (r.choice(NAMES), r.choice(PLACES), r.choice(ADJECTIVES),
                                    r.choice(VERBS), r.choice(TIMES))
    forms = (f"{name} {verb} to {place} {time}.",
             f"{time.capitalize()}, {name} {verb} near {place} because {r.choice(WEATHER)}.",
             f"The {adj} {r.choice(OBJECTS)[:-1]} belonged to {name}, who kept it at {place}.",
             f"{name} and {r.choice(NAMES)} {verb} together {time}, and {r.choice(WEATHER)}.",
             f"At {place} {name} found a {adj} {r.choice(OBJECTS)[:-1]} and smiled.",
             f"\"Is it far to {place}?\" asked {name}. \"Not very,\" said {r.choice(NAMES)}.")
    return r.choice(forms)


def _banks() -> dict[str, list[str]]:
    """Word lists by part of speech from tools/data/words.txt: {"nouns": [...], ...}."""
    banks: dict[str, list[str]] = {}
    section = ""
    for line in (DATA / "words.txt").read_text(encoding="utf-8").splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif line and not line.startswith("#"):
            banks.setdefault(section, []).extend(line.split())
    return banks


BANKS = _banks()


def _wordy_sentence(r: random.Random) -> str:
    """A sentence over the larger word banks, so the tokenizer sees a few thousand distinct words."""
    def n() -> str:
        return r.choice(BANKS["nouns"])

    def a() -> str:
        return r.choice(BANKS["adjectives"])

    def v() -> str:
        return r.choice(BANKS["verbs"])

    forms = (f"The {a()} {n()} {v()} the {a()} {n()}.",
             f"{r.choice(NAMES)} {v()} a {a()} {n()} beside the {n()}.",
             f"Near the {n()}, a {a()} {n()} {v()} and {v()}.",
             f"Every {n()} in the {n()} was {a()}, and the {n()} was {a()}.",
             f"{a().capitalize()} as a {n()}, the {n()} {v()}.",
             f"{n().capitalize()}: {a()}, {a()} and {v()} by a {n()}.")
    return r.choice(forms)


def _story(r: random.Random) -> str:
    make = (_sentence, _wordy_sentence)
    return " ".join(r.choice(make)(r) for _ in range(r.randint(3, 7)))


def _operands(r: random.Random, op: str) -> tuple[int, int]:
    if op == "*":
        return r.randint(0, 12), (r.randint(0, 12) if r.random() < 0.7 else r.randint(0, 99))
    a, b = r.randint(0, 99), r.randint(0, 99)
    if op == "-" and r.random() < 0.8:
        a, b = max(a, b), min(a, b)
    return a, b


def _equation(r: random.Random) -> str:
    op = r.choice("+-*")
    a, b = _operands(r, op)
    c = OPS[op](a, b)
    forms = (f"{a}{op}{b}={c}", f"{a} {op} {b} = {c}", f"What is {a}{op}{b}? The answer is {c}.",
             f"What is {a} {OP_WORDS[op]} {b}? {a} {OP_WORDS[op]} {b} is {c}.",
             f"Compute {a}{op}{b}. {a}{op}{b}={c}. The answer is {c}.",
             f"Q: {a}{op}{b}=? A: {c}")
    return r.choice(forms)


def _word_problem(r: random.Random) -> str:
    name, thing = r.choice(NAMES), r.choice(OBJECTS)
    a, b = r.randint(1, 30), r.randint(1, 30)
    kind = r.randrange(3)
    if kind == 0:
        return (f"{name} has {a} {thing} and gets {b} more. "
                f"How many {thing} does {name} have now? {a}+{b}={a + b}. The answer is {a + b}.")
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return (f"{name} had {a} {thing} and gave away {b}. How many {thing} are left? "
                f"{a}-{b}={a - b}. The answer is {a - b}.")
    a, b = r.randint(2, 9), r.randint(2, 9)
    return (f"There are {a} boxes with {b} {thing} in each box. "
            f"How many {thing} are there in all? {a}*{b}={a * b}. The answer is {a * b}.")


def _chat(r: random.Random) -> str:
    lines = [f"system: {r.choice(SYSTEMS)}"] if r.random() < 0.4 else []
    for _ in range(r.randint(1, 3)):
        kind = r.randrange(4)
        if kind == 0:
            q, a = r.choice(GREETINGS)
        elif kind == 1:
            topic = r.choice(sorted(TOPICS))
            q, a = f"Tell me about {topic}.", TOPICS[topic]
        else:
            op = r.choice("+-*")
            x, y = _operands(r, op)
            z = OPS[op](x, y)
            q = r.choice((f"What is {x}{op}{y}?", f"Calculate {x} {op} {y}.", f"{x}{op}{y}=?"))
            a = r.choice((f"{x}{op}{y}={z}. The answer is {z}.", f"The answer is {z}.", f"{z}"))
        lines += [f"user: {q}", f"assistant: {a}"]
    return "\n".join(lines)


def _sections(r: random.Random) -> list[str]:
    """The prose, then ten rounds of (generator, items) blocks, so no kind dominates a span."""
    parts = [(DATA / "prose.txt").read_text(encoding="utf-8").strip()]
    makers = ((_story, 600), (_chat, 600), (_equation, 1600), (_word_problem, 500))
    for _ in range(10):
        for make, count in makers:
            parts.append("\n".join(make(r) for _ in range(count // 10)))
    # A little unicode and odd spacing so the byte-level tokenizer sees more than ASCII.
    parts.append("Café, naïve, résumé, Zürich, São Paulo, Ελλάδα, Москва, 東京, 서울, "
                 "☀ ✓ → ½ π ≈ 3.14159\n\ttabs\tand  double  spaces,   trailing spaces   "
                 "\n\n\nblank lines.")
    return parts


def generate(seed: int = SEED) -> str:
    """The corpus text: the same bytes for the same seed."""
    return "\n\n".join(_sections(random.Random(seed))) + "\n"


def main() -> None:
    text = generate()
    (DATA / "corpus.txt").write_text(text, encoding="utf-8")
    print(f"wrote {DATA / 'corpus.txt'}: {len(text.encode())} bytes")


if __name__ == "__main__":
    main()
