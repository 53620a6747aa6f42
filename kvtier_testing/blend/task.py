"""A synthetic multi-document task whose answers need attention across documents.

A registry of "name colour" records is printed over several pages; each page is one document
(one segment). Page breaks fall inside records: every page ends with a name whose colour opens
the next page. So a page's first colour means nothing without the page before it::

    <s> registry mira                                 system segment (ends with a dangling name)
    red the note kel blue see sami green ... tova     page 1: "red" is mira's colour
    gray data lund pink ... orin                      page 2: "gray" is tova's colour
    ...
    ? tova                                            question: the answer is the next token, "gray"

Two kinds of question, half each:

- ``split``: the name ends one page and its colour opens the next. The only link between the two
  is that they are adjacent in the prompt, so the colour token must have attended across the
  page boundary when its KV was made. KV cached per page in isolation (naive reuse) lacks that
  link, whatever the question does: these need cross-document attention.
- ``within``: name and colour are on the same page: any reuse that keeps each page's own KV works.

The vocabulary is closed (word-level), so the task model needs no BPE tokenizer; ``VOCAB`` is the
id order of its ``tokenizer.json``. Everything is a pure function of a seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
QUESTION, REGISTRY = "?", "registry"
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "pink", "brown", "black", "white", "gray", "cyan"]
_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "j", "h"]
_RIMES = ["ara", "el", "ina", "ov", "uma", "et", "is", "ond"]
NAMES = [onset + rime for rime in _RIMES for onset in _ONSETS][:96]
FILLERS = ["the", "note", "see", "also", "page", "item", "entry", "list", "and", "then", "more", "here",
           "next", "line", "data", "as", "per", "old", "new", "file", "copy", "by", "of", "on"]
VOCAB = SPECIAL + [QUESTION, REGISTRY] + COLORS + NAMES + FILLERS
TOKEN_ID = {word: i for i, word in enumerate(VOCAB)}
assert len(TOKEN_ID) == len(VOCAB), "duplicate words in the vocabulary"
BOS_ID, EOS_ID, PAD_ID = TOKEN_ID["<s>"], TOKEN_ID["</s>"], TOKEN_ID["<pad>"]
COLOR_IDS = [TOKEN_ID[c] for c in COLORS]
VOCAB_SIZE = (len(VOCAB) + 7) // 8 * 8

RECORDS_PER_PAGE = 3
MAX_FILLER = 4  # 1..MAX_FILLER filler words between items


@dataclass
class Example:
    segments: list[list[int]]  # system, pages..., question ("?", name): the prompt
    answer: int  # the colour's token id
    kind: str  # "split" or "within"

    @property
    def tokens(self) -> list[int]:
        return [t for segment in self.segments for t in segment]


def encode(words: list[str]) -> list[int]:
    return [TOKEN_ID[w] for w in words]


def decode(ids: list[int]) -> list[str]:
    return [VOCAB[i] if 0 <= i < len(VOCAB) else "<unk>" for i in ids]


def _filler(rng: random.Random) -> list[str]:
    return rng.choices(FILLERS, k=rng.randint(1, MAX_FILLER))


def make_registry(rng: random.Random, num_pages: int) -> tuple[list[list[str]], dict[str, str], list[str], list[str]]:
    """Pages (system segment first) as words, every name's colour, split names, within names."""
    per_page = RECORDS_PER_PAGE + 1
    names = rng.sample(NAMES, 1 + num_pages * per_page)
    colour = {name: rng.choice(COLORS) for name in names}
    system = ["<s>", REGISTRY, *_filler(rng)[:1], names[0]]
    pages, split, within = [system], [names[0]], []
    previous = names[0]
    for p in range(num_pages):
        own = names[1 + p * per_page : 1 + (p + 1) * per_page]
        words = [colour[previous], *_filler(rng)]
        for name in own[:-1]:
            words += [name, colour[name], *_filler(rng)]
            within.append(name)
        words.append(own[-1])  # dangling: its colour opens the next page
        pages.append(words)
        previous = own[-1]
        if p < num_pages - 1:
            split.append(own[-1])
    return pages, colour, split, within


def make_example(seed: int | str, num_pages: int = 8, kind: str | None = None) -> Example:
    """One prompt (system, pages, question) and its answer. ``kind`` None picks either, half each."""
    rng = random.Random(f"kvtier-blend-task-{seed}")
    pages, colour, split, within = make_registry(rng, num_pages)
    kind = kind or rng.choice(("split", "within"))
    name = rng.choice(split if kind == "split" else within)
    segments = [encode(words) for words in pages] + [encode([QUESTION, name])]
    return Example(segments, TOKEN_ID[colour[name]], kind)


def make_training_sequence(rng: random.Random, num_pages: int, questions: int) -> tuple[list[int], list[int]]:
    """A full prompt followed by ``questions`` question/answer pairs; returns the tokens and the
    positions whose next token is an answer (the positions of the asked names)."""
    pages, colour, split, within = make_registry(rng, num_pages)
    words = [w for page in pages for w in page]
    answer_positions = []
    for _ in range(questions):
        pool = split if rng.random() < 0.5 else within
        name = rng.choice(pool)
        words += [QUESTION, name]
        answer_positions.append(len(words) - 1)
        words.append(colour[name])
    return encode(words), answer_positions


def make_copy_sequence(rng: random.Random, low: int = 24, high: int = 64) -> tuple[list[int], list[int]]:
    """Training aid: ``<s>`` and a random run of task words, then the run again; returns the
    tokens and the positions whose next token is a target (every one inside the repeat)."""
    words = rng.choices(COLORS + NAMES + FILLERS, k=rng.randint(low, high))
    tokens = encode(["<s>", *words, *words])
    first = 1 + len(words)
    return tokens, list(range(first, len(tokens) - 1))


def eval_set(size: int, num_pages: int = 8, offset: int = 0) -> list[Example]:
    """``size`` held-out examples (training draws from another seed stream), half of each kind."""
    return [make_example(f"eval-{offset + i}", num_pages, kind=("split", "within")[i % 2]) for i in range(size)]
