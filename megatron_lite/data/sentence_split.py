"""A small rule-based sentence splitter for ``preprocess_data.py --split-sentences``.

Megatron uses NLTK's punkt, which needs a download; this splitter needs nothing and is
deterministic.  A sentence ends at ``.``, ``!`` or ``?`` (plus closing quotes/brackets) followed by
whitespace and a character that is not a lower-case letter, unless the word before the period is
a known abbreviation ("Dr.", "e.g.") or an initial ("J."); at CJK full stops (。！？); and at blank
lines (paragraph breaks), punctuation or not.

``keep_newlines=False`` (Megatron's default): sentences are stripped of surrounding whitespace.
``keep_newlines=True``: each sentence keeps the whitespace that follows it, so joining the
sentences gives back the text (minus leading whitespace), newlines included.

``NltkSplitter`` wraps punkt for users who have nltk and its punkt data installed already.
"""

from __future__ import annotations

import functools
import re

ABBREVIATIONS = frozenset("""
mr mrs ms dr prof sr jr st mt vs cf al fig figs eq eqs approx dept est gen gov col lt sgt capt
rev hon inc ltd co corp jan feb mar apr jun jul aug sep sept oct nov dec e.g i.e a.m p.m u.s u.k
ph.d vol vols pp ed eds ch sec no nos op
""".split())

_CANDIDATE = re.compile(
    r"""(?:[.!?]+['"”’)\]]*(?=\s)|[。！？]+['"”’)\]」』]*)|\n[ \t\r\f\v]*\n"""
)


def _ends_sentence(text: str, start: int, end: int) -> bool:
    """Is the punctuation run text[start:end] a sentence end?"""
    mark = text[start]
    if mark == "\n" or mark in "。！？":
        return True
    rest = text[end:].lstrip()
    if not rest:
        return True
    if rest[0].islower():
        return False
    if mark == "." and text[start:end].rstrip("'\"”’)]") == ".":
        word = text[:start].rsplit(None, 1)[-1] if text[:start].strip() else ""
        word = word.lstrip("\"'“‘([").lower()
        if word in ABBREVIATIONS or (len(word) == 1 and word.isalpha()):
            return False
    return True


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """Split text into sentences (see the module docstring); empty sentences are dropped."""
    sentences, start = [], 0
    for m in _CANDIDATE.finditer(text):
        if not _ends_sentence(text, m.start(), m.end()):
            continue
        # The sentence runs to the end of the punctuation; the whitespace after it goes with it
        # when keeping newlines (so nothing is lost), and is dropped otherwise.
        cut = m.end()
        nxt = cut + (len(text[cut:]) - len(text[cut:].lstrip()))
        piece = text[start:nxt] if keep_newlines else text[start:cut]
        if piece.strip():
            sentences.append(piece if keep_newlines else piece.strip())
            start = nxt
    tail = text[start:]
    if tail.strip():
        sentences.append(tail if keep_newlines else tail.strip())
    return sentences


class NltkSplitter:
    """NLTK punkt (only when nltk and its punkt data are already installed; nothing is downloaded)."""

    def __init__(self, lang: str = "english", keep_newlines: bool = False):
        try:
            import nltk
        except ImportError:
            raise ImportError("--sentence-splitter nltk needs the nltk package (pip install nltk) "
                              "and its punkt data; use the default built-in splitter otherwise") from None
        try:
            splitter = nltk.load(f"tokenizers/punkt/{lang}.pickle")
        except LookupError as err:  # nltk >= 3.9 loads punkt_tab (no pickle) for this name: name what it lacks
            found = re.search(r"Resource \W*(punkt\w*)", str(err))
            package = found.group(1) if found else "punkt"
            raise ImportError(f"nltk {package} data for {lang!r} is not installed; run "
                              f"python -m nltk.downloader {package}, or use the built-in splitter") from None
        self.splitter = splitter
        self.keep_newlines = keep_newlines

    def __call__(self, text: str) -> list[str]:
        if not self.keep_newlines:
            return self.splitter.tokenize(text)
        # Keep the whitespace (newlines) after each sentence: extend every span to the next one.
        spans = list(self.splitter.span_tokenize(text))
        ends = [s for s, _ in spans[1:]] + [len(text)]
        return [text[s:e] for (s, _), e in zip(spans, ends)]


def build_splitter(kind: str = "builtin", lang: str = "english", keep_newlines: bool = False):
    """A callable text -> list of sentences."""
    if kind == "nltk":
        return NltkSplitter(lang, keep_newlines)
    if kind != "builtin":
        raise ValueError(f"--sentence-splitter must be builtin or nltk, not {kind!r}")
    if lang != "english":  # the built-in rules are English ones: refused, not silently applied to German
        raise ValueError(f"--lang {lang} needs --sentence-splitter nltk (punkt for that language); the built-in "
                         "splitter has English rules only")
    return functools.partial(split_sentences, keep_newlines=keep_newlines)
