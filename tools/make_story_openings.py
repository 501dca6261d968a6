"""Write story openings for drafter distillation from the TinyStories *train* head (never the held-out file).

The copy of the train head this reads was lowercased by its uploader (docs/assets.md §5), which is out of
distribution for the cased tok512 target, so each story's first sentence is re-cased with three rules:
capitalise the sentence start and the pronoun "i", and capitalise the stories' character names: words
that follow "named" or "called" at least twice in the file and more often than they follow an article,
a possessive or "very"/"so" (which rules out adjectives such as "big"). One opening per line, in file order.

    python tools/make_story_openings.py tinystories-train-head-lowercased.txt data/tinystories/train-openings.txt

The output is shipped as data/tinystories/train-openings.txt (source, hashes and licence in
data/tinystories/PROVENANCE.md); rerunning this on the same head reproduces it byte for byte.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")
_NAME = re.compile(r"\b(?:named|called) ([a-z]+)")
_NOT_A_NAME = re.compile(r"\b(?:a|an|the|very|so|too|his|her|their|my|your|its) ([a-z]+)")
_WORD = re.compile(r"[a-z]+")
_PRONOUNS = {"her", "him", "it", "them", "me", "you", "us", "his", "my", "your", "their", "its", "this", "that"}


def stories(text: str) -> list[str]:
    """Stories are separated by a single newline; paragraphs inside a story by a blank line."""
    found, current = [], []
    for line in text.splitlines():
        if line.strip() and current and current[-1].strip():
            found.append("\n".join(current))
            current = []
        current.append(line)
    if current:
        found.append("\n".join(current))
    return [story.strip() for story in found if story.strip()]


def recase(sentence: str, names: set[str]) -> str:
    def word(match: re.Match[str]) -> str:
        token = match.group(0)
        return token.capitalize() if token in names or token == "i" else token

    sentence = _WORD.sub(word, sentence)
    return sentence[:1].upper() + sentence[1:]


def main(source: Path, out: Path) -> None:
    text = source.read_text(encoding="utf-8")
    after_named = Counter(_NAME.findall(text))
    after_article = Counter(_NOT_A_NAME.findall(text))
    names = {word for word, count in after_named.items()
             if count >= 2 and count > after_article[word] and word not in _PRONOUNS}
    openings = []
    for story in stories(text):
        flat = " ".join(story.split())
        end = _SENTENCE_END.search(flat)
        openings.append(recase(flat[:end.end()] if end else flat, names))
    out.write_text("\n".join(openings) + "\n", encoding="utf-8")
    print(f"{len(openings)} openings, {len(names)} names -> {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
