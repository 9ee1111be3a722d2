"""Chat prompts written here, so that nothing is downloaded: instructions built from templates and
subjects (general questions, writing tasks, programming requests), for an instruct model's draft
heads to train on (`tandem train-draft --prompts chat`) and for the `chat` workload of
benchmarks/spec_decode.py.

The two splits share no template and no subject: every fourth template, every fifth general
subject and every fourth programming task belong to "test" only, so a benchmark's prompts are never among a head's training prompts
in wording or in topic.
"""

from __future__ import annotations

import random
from typing import Any

SPLITS = ("train", "test")

_GENERAL_TEMPLATES = (
    "What is {s}?",
    "Explain {s} in simple terms.",
    "Can you tell me about {s}?",
    "Give me three interesting facts about {s}.",
    "Why is {s} important?",
    "Write a short paragraph about {s}.",
    "How would you explain {s} to a ten-year-old?",
    "What are the main advantages and disadvantages of {s}?",
    "Summarize what people should know about {s}.",
    "Write a short poem about {s}.",
    "What is the history of {s}?",
    "List some common misconceptions about {s}.",
    "How does {s} affect everyday life?",
    "Describe {s} in a few sentences.",
    "What questions should a beginner ask about {s}?",
    "Write a tweet about {s}.",
    "Compare {s} with something similar and explain the difference.",
    "What are the key ideas behind {s}?",
    "Give me a step-by-step introduction to {s}.",
    "Write an email to a friend recommending they learn about {s}.",
)

_SUBJECTS = (
    "photosynthesis",
    "the water cycle",
    "black holes",
    "the French Revolution",
    "climate change",
    "the human immune system",
    "volcanoes",
    "the Roman Empire",
    "renewable energy",
    "machine learning",
    "the stock market",
    "healthy sleep habits",
    "the theory of evolution",
    "electric cars",
    "the Great Wall of China",
    "meditation",
    "coffee",
    "the Internet",
    "honey bees",
    "the Moon landing",
    "recycling",
    "earthquakes",
    "the printing press",
    "vitamins",
    "the solar system",
    "democracy",
    "rainforests",
    "the piano",
    "time management",
    "inflation",
    "DNA",
    "the Olympic Games",
    "bread baking",
    "public speaking",
    "the ocean tides",
    "vaccines",
    "the Renaissance",
    "gardening",
    "cryptography",
    "the human heart",
    "plate tectonics",
    "chess",
    "social media",
    "the Industrial Revolution",
    "dinosaurs",
    "learning a new language",
    "the speed of light",
    "composting",
    "the Amazon river",
    "friendship",
    "budgeting",
    "the pyramids of Egypt",
    "wind turbines",
    "jazz music",
    "antibiotics",
    "cloud computing",
    "the Silk Road",
    "penguins",
    "the scientific method",
    "exercise",
    "nuclear energy",
    "the Mona Lisa",
    "artificial intelligence",
    "rain",
    "the ancient Greeks",
    "electricity",
    "mountains",
    "tea",
    "the human brain",
    "bicycles",
    "hurricanes",
    "the periodic table",
    "birds migrating",
    "Shakespeare",
    "bridges",
    "sharks",
    "the moon",
    "forests",
    "rockets",
    "chocolate",
    "the Arctic",
    "origami",
    "the history of money",
    "lightning",
    "coral reefs",
    "the violin",
    "robots",
    "the Vikings",
    "mushrooms",
    "the human skeleton",
    "glaciers",
    "photography",
    "the ancient Maya",
    "deserts",
    "submarines",
    "the telephone",
    "owls",
    "the Northern Lights",
    "pizza",
    "the Eiffel Tower",
    "the circulatory system",
    "satellites",
    "elephants",
    "poetry",
    "the first airplanes",
    "soil",
    "vaccination campaigns",
    "the game of football",
    "magnets",
    "the Sahara",
    "kindness",
    "public libraries",
    "the metric system",
    "bats",
    "rivers",
    "the Middle Ages",
    "solar panels",
    "cheese",
    "the ozone layer",
    "stars",
)

_CODE_TEMPLATES = (
    "Write a Python function that {t}.",
    "How do I {t} in Python?",
    "Show me JavaScript code to {t}.",
    "Write a function in Python to {t}, with a docstring.",
    "Explain how to {t} in Python, with an example.",
    "Can you write a short C program that {t}?",
    "Write a Python class that can {t}.",
    "What is the simplest way to {t} in Python?",
    "Write a Rust function to {t}.",
    "I am new to programming. How can I {t}?",
    "Write unit tests for Python code written to {t}.",
    "Give me a one-line Python solution to {t}.",
)

_CODE_TASKS = (
    "reverse a string",
    "check whether a number is prime",
    "compute the factorial of a number",
    "read a file line by line",
    "sort a list of dictionaries by a key",
    "count the words in a sentence",
    "find the largest number in a list",
    "merge two sorted lists",
    "remove duplicates from a list",
    "compute the Fibonacci numbers",
    "check whether a string is a palindrome",
    "convert Celsius to Fahrenheit",
    "parse a JSON string",
    "flatten a nested list",
    "compute the average of a list of numbers",
    "find the most common element in a list",
    "validate an email address",
    "download a web page",
    "generate a random password",
    "count the vowels in a string",
    "implement binary search",
    "compute the greatest common divisor of two numbers",
    "write a list of rows to a CSV file",
    "capitalize every word in a sentence",
    "check whether two strings are anagrams",
    "transpose a matrix",
    "implement a stack",
    "compute the sum of the digits of a number",
    "find all even numbers in a list",
    "convert a decimal number to binary",
    "implement bubble sort",
    "measure how long a function takes",
    "count how often each letter appears in a text",
    "check whether a year is a leap year",
    "rotate a list by k positions",
    "find the second largest number in a list",
    "convert a string to title case",
    "compute the power set of a set",
    "implement a queue with two stacks",
    "find the intersection of two lists",
    "split a list into chunks of equal size",
    "compute the median of a list",
    "check whether a list is sorted",
    "print a multiplication table",
    "implement a linked list",
    "convert a Roman numeral to an integer",
    "compute the distance between two points",
    "find the longest word in a sentence",
)


def _split(items: tuple[str, ...], split: str, every: int) -> list[str]:
    return [s for i, s in enumerate(items) if (i % every == every - 1) == (split == "test")]


def chat_messages(n: int, seed: int = 0, split: str = "train") -> list[str]:
    """`n` user messages (a quarter of them programming requests), seeded; "train" and "test" share
    no template and no subject. Repeats only after every combination of the split was drawn."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    general = [
        t.format(s=s) for t in _split(_GENERAL_TEMPLATES, split, 4) for s in _split(_SUBJECTS, split, 5)
    ]
    code = [t.format(t=c) for t in _split(_CODE_TEMPLATES, split, 4) for c in _split(_CODE_TASKS, split, 4)]
    rng = random.Random(seed)
    rng.shuffle(general)
    rng.shuffle(code)
    out: list[str] = []
    g = c = 0
    for i in range(n):
        if i % 4 == 3:
            out.append(code[c % len(code)])
            c += 1
        else:
            out.append(general[g % len(general)])
            g += 1
    return out


def chat_prompt_ids(tokenizer: Any, messages: list[str]) -> list[list[int]]:
    """Each message as one user turn through the tokenizer's chat template, ending where the
    assistant's answer starts."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat prompts need a tokenizer with a chat template")
    out = []
    for m in messages:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True
        )
        out.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return out
