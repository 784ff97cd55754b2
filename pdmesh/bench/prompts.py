"""The benchmarks' prompts: short chat questions and one long prompt of a chosen length.

Every side of a comparison gets the same prompts from here, so their token counts match.
"""

from __future__ import annotations

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the ocean.",
    "Explain why the sky is blue.", "Give me three tips for learning to cook.",
    "What is a prime number?", "Summarise the plot of Hamlet in one paragraph.",
    "How do vaccines work?", "Describe a cat to someone who has never seen one.",
]
SUBJECTS = ["river", "engineer", "library", "mountain", "garden", "market", "teacher", "harbour"]
VERBS = ["noticed", "described", "measured", "repaired", "painted", "visited", "counted"]
OBJECTS = ["an old bridge", "seven lanterns", "the north wall", "a quiet road", "the clocks"]


def chat(i: int) -> list[dict[str, str]]:
    """Chat ``i``: one user question, numbered so that no two streams share a prompt."""
    return [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"}]


def long_prompt(tok, target: int, salt: int) -> tuple[str, int]:
    """A raw prompt of at most ``target`` tokens (as close as whole sentences allow)."""
    head = f"Field notes, volume {salt}.\n"
    tail = "\nSummarise the notes above in one sentence."
    sentences: list[str] = []
    i = 0
    while True:
        s = (f"Note {i}: the {SUBJECTS[(i + salt) % 8]} {VERBS[i % 7]} "
             f"{OBJECTS[(3 * i + salt) % 5]} near marker {17 * i + salt}. ")
        n = len(tok.encode(head + "".join(sentences) + s + tail))
        if n > target:
            break
        sentences.append(s)
        i += 1
    text = head + "".join(sentences) + tail
    return text, len(tok.encode(text))


def prompt_text(tok, target: int, salt: int) -> str:
    """A raw prompt of ``target`` tokens or a word fewer: field notes cut at a word, so a
    load of prompts of chosen lengths differs prompt to prompt (``salt``)."""
    words: list[str] = []
    i = 0
    while len(words) < 2 * target:  # every word is at least one token
        words += (f"Note {i}: the {SUBJECTS[(i + salt) % 8]} {VERBS[i % 7]} "
                  f"{OBJECTS[(3 * i + salt) % 5]} near marker {17 * i + salt}.").split()
        i += 1
    low, high = 1, len(words)  # the longest prefix of words within target tokens
    while low < high:
        mid = (low + high + 1) // 2
        if len(tok.encode(" ".join(words[:mid]))) <= target:
            low = mid
        else:
            high = mid - 1
    return " ".join(words[:low])


def words(n: int, salt: int) -> str:
    """``n`` words of field notes (about 1.3 tokens a word), different for each ``salt``:
    the load benchmark's prompts, sized in words as a user would size them."""
    out: list[str] = []
    i = 0
    while len(out) < n:
        out += (f"Note {i}: the {SUBJECTS[(i + salt) % 8]} {VERBS[i % 7]} "
                f"{OBJECTS[(3 * i + salt) % 5]} near marker {17 * i + salt}.").split()
        i += 1
    return " ".join(out[:n])
