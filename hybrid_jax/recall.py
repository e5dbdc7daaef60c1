"""The associative-recall task of the embedded model, and where that model lives.

Format (fixed, byte-level): key:value pairs, one space between pairs, then a query and its answer

    ab:17 cd:42 ef:03 ?cd:   ->   42

Keys are two lowercase letters (distinct within a prompt), values two digits. The model reads BOS + the prompt's
bytes and answers with the value's two bytes, then EOS. `scripts/train_recall.py` trains the `recall` preset
on 1 to 32 pairs with fresh pairs every step and writes the checkpoint shipped in `hybrid_jax/assets/recall`
(docs/recall.md); `hybrid-jax generate` with no arguments loads it.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybrid_jax.tokenizer import ByteTokenizer

MODEL_DIR = Path(__file__).parent / "assets" / "recall"
MAX_PAIRS = 32  # the training range: 1 .. MAX_PAIRS pairs
ANSWER_TOKENS = 3  # two digits, then EOS
DEFAULT_PROMPT = "kv:31 ab:17 cd:42 ef:03 gh:58 ij:76 ?cd:"

_LETTERS = np.array(list(string.ascii_lowercase))
_PROMPT = re.compile(r"((?:[a-z]{2}:[0-9]{2} )+)\?([a-z]{2}):")


@dataclass(frozen=True)
class Query:
    prompt: str  # "ab:17 cd:42 ?cd:"
    answer: str  # "42"


def sample(rng: np.random.Generator, num_pairs: int) -> Query:
    """One prompt of `num_pairs` pairs with distinct keys; the query asks for one of them, chosen uniformly."""
    if not 1 <= num_pairs <= 26 * 26:
        raise ValueError(f"num_pairs={num_pairs}: must lie in [1, 676] (distinct two-letter keys)")
    keys = rng.choice(26 * 26, size=num_pairs, replace=False)
    values = rng.integers(0, 100, size=num_pairs)
    pairs = [f"{_LETTERS[k // 26]}{_LETTERS[k % 26]}:{v:02d}" for k, v in zip(keys, values, strict=True)]
    i = int(rng.integers(num_pairs))
    return Query(prompt=" ".join(pairs) + f" ?{pairs[i][:2]}:", answer=pairs[i][3:])


def expected_answer(prompt: str) -> str | None:
    """The value a prompt in the recall format asks for; None when the text is not in the format (or its
    query key is absent or given twice)."""
    m = _PROMPT.fullmatch(prompt)
    if m is None:
        return None
    found = [p[3:] for p in m.group(1).split() if p[:2] == m.group(2)]
    return found[0] if len(found) == 1 else None


def encode_batch(queries: list[Query], *, with_answers: bool, width: int | None = None):
    """Right-padded ids [n, width] (BOS + prompt bytes, + the answer bytes and EOS when `with_answers`) and the
    number of prompt tokens per row [n] (BOS included): the answer's first token is predicted at index
    prompt_lengths - 1."""
    tok = ByteTokenizer()
    rows = [tok.encode(q.prompt + (q.answer if with_answers else "")) for q in queries]
    if with_answers:
        rows = [r + [tok.eos_id] for r in rows]
    need = max(len(r) for r in rows)
    width = need if width is None else width
    if need > width:
        raise ValueError(f"width={width}: the longest row has {need} tokens")
    ids = np.full((len(rows), width), tok.pad_id, np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    lengths = np.array([1 + len(q.prompt.encode()) for q in queries], np.int32)
    return ids, lengths


def prompt_tokens(num_pairs: int) -> int:
    """Tokens of a prompt with `num_pairs` pairs: BOS, 6 bytes a pair ("ab:17 "), then "?cd:"."""
    return 1 + 6 * num_pairs + 4
