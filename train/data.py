"""Training data with nothing downloaded: byte streams cut into windows of `seq_len + 1` tokens.

Every batch is a pure function of (seed, step), so the data position is the step: two runs with one seed
see the same batches in the same order, and a resumed run continues exactly where it stopped.

- `stdlib`: the Python standard library's own sources as bytes (vocab 256), split into train and
  validation by a hash of each file's path.
- `recall`: a synthetic associative-recall stream (`recall_document`). Documents of `recall_doc_len` tokens
  are two-token slots, each a fact (a key, then the value it has throughout the document) with probability
  `recall_fact_probability`, else filler. Every key has its own `recall_values_per_key` value symbols, so a
  key's second and later showings repeat a value that only its earlier showing tells: predictable when that
  showing lies inside the model's context, a guess among the key's symbols when not. Sparse facts put the
  showings of one key `recall_num_keys / recall_fact_probability` slots apart on average, so a model
  trained and evaluated with a longer context reaches a lower validation loss on the same tokens: the
  FlashAttention paper's 1k -> 4k effect in a form where the cause is known. Each recalled token carries its
  distance (tokens back to the key's last showing), so evaluation scores answers by distance and by whether
  the showing was inside the window.
- any other value: a path to a text file, read as bytes; the last `val_fraction` of it is validation.
"""

from __future__ import annotations

import hashlib
import pathlib
import sysconfig

import numpy as np

VOCAB_SIZE = 256
# Recall documents: token 0 is filler, 1..num_keys the keys, and after them each key's own value symbols.
# A value symbol belongs to one key, so a repeated value is found by one attention hop (the key's query
# matches earlier values of its family) plus a key -> family bigram. With any value symbol after any key,
# recall needs a two-layer induction circuit (match the key, copy the token after it), which did not form
# within CPU budgets (train/results/cpu_recall).
FILLER = 0
SLOT_LEN = 2
# Separate seed namespaces: validation documents do not depend on the training seed, so runs with
# different seeds or contexts are scored on the same tokens.
_TRAIN_STREAM, _VAL_STREAM = 0, 1
_VAL_SEED = 0x5EED


def stdlib_files(corpus_bytes: int, val_fraction: float) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """The standard library's .py files in a fixed pseudo-random order (by path hash), up to `corpus_bytes`.

    A file goes to validation when its hash falls in the lowest `val_fraction` of the hash range, so the
    split does not move when `corpus_bytes` changes.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)]
    digests = {p: hashlib.sha256(p.relative_to(root).as_posix().encode()).digest() for p in files}
    files.sort(key=digests.__getitem__)
    train, val, total = [], [], 0
    for path in files:
        size = path.stat().st_size
        if corpus_bytes and total + size > corpus_bytes:
            continue
        total += size
        is_val = int.from_bytes(digests[path][:4], "big") < val_fraction * 2**32
        (val if is_val else train).append(path)
    if not train or not val:
        raise ValueError(f"corpus_bytes={corpus_bytes} leaves an empty train or validation split; raise it")
    return train, val


def _read(paths) -> np.ndarray:
    return np.frombuffer(b"".join(p.read_bytes() for p in paths), dtype=np.uint8)


def recall_document(
    rng: np.random.Generator, doc_len: int, *, num_keys: int, values_per_key: int, fact_probability: float
) -> tuple[np.ndarray, np.ndarray]:
    """One recall document: uint8 tokens [doc_len] and int32 distances [doc_len].

    The document is doc_len / 2 slots of two tokens: with probability `fact_probability` a fact (a key drawn
    uniformly from `num_keys`, then its value), else two FILLER tokens. Each key has `values_per_key` value
    symbols of its own and takes one of them, uniformly, for the whole document, so every showing of a key
    after its first repeats the value shown before. A distance is, for such a repeated value's token, how
    many tokens back the key was last shown; 0 for every other token (first showings, keys, filler), which
    no context can predict beyond their frequencies.

    Showings of one key are `num_keys / fact_probability` slots apart on average (geometrically distributed),
    so the parameters set how far back recall reaches: the fraction of repeats more than D tokens back is
    about exp(-D * fact_probability / (2 * num_keys)).
    """
    if doc_len % SLOT_LEN:
        raise ValueError(f"doc_len={doc_len} must be a multiple of the slot length {SLOT_LEN}")
    if 1 + num_keys * (1 + values_per_key) > VOCAB_SIZE:
        raise ValueError(f"{num_keys} keys with {values_per_key} values each need more than {VOCAB_SIZE} tokens")
    choice = rng.integers(0, values_per_key, size=num_keys)
    is_fact = rng.random(doc_len // SLOT_LEN) < fact_probability
    fact_slots = np.flatnonzero(is_fact)
    keys = rng.integers(0, num_keys, size=len(fact_slots))
    slots = np.full((len(is_fact), SLOT_LEN), FILLER, dtype=np.uint8)
    slots[fact_slots, 0] = 1 + keys
    slots[fact_slots, 1] = 1 + num_keys + keys * values_per_key + choice[keys]
    # Facts sorted by key, then slot: a fact whose predecessor in that order has the same key repeats it.
    order = np.lexsort((fact_slots, keys))
    same_key = keys[order[1:]] == keys[order[:-1]]
    repeats, previous = order[1:][same_key], order[:-1][same_key]
    distances = np.zeros((len(is_fact), SLOT_LEN), dtype=np.int32)
    distances[fact_slots[repeats], 1] = (fact_slots[repeats] - fact_slots[previous]) * SLOT_LEN
    return slots.reshape(-1), distances.reshape(-1)


class Dataset:
    """Windows of a token stream: `train_batch(step)` and a fixed list of validation batches.

    A batch is a dict of int32 `inputs` and `targets` [batch, seq_len] (targets are inputs shifted by one),
    and for the recall task int32 `distances` [batch, seq_len] (see `recall_document`; 0 for targets that are
    not recalled values).
    """

    has_answers = False

    def __init__(self, *, seed: int, seq_len: int, batch_size: int, eval_tokens: int):
        self.seed, self.seq_len, self.batch_size, self.eval_tokens = seed, seq_len, batch_size, eval_tokens

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def eval_batches(self) -> list[dict[str, np.ndarray]]:
        raise NotImplementedError

    def _windows(self, tokens: np.ndarray, starts: np.ndarray, answers: np.ndarray | None = None):
        index = starts[:, None] + np.arange(self.seq_len + 1)
        batch = {"inputs": tokens[index[:, :-1]].astype(np.int32), "targets": tokens[index[:, 1:]].astype(np.int32)}
        if answers is not None:
            batch["distances"] = answers[index[:, 1:]]
        return batch

    def _batched(self, windows: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        count = len(windows["inputs"])
        return [{k: v[i : i + self.batch_size] for k, v in windows.items()} for i in range(0, count, self.batch_size)]


class TextDataset(Dataset):
    """Random windows of a byte corpus for training; consecutive windows of the validation split for eval."""

    def __init__(self, train: np.ndarray, val: np.ndarray, **kwargs):
        super().__init__(**kwargs)
        for name, split in (("train", train), ("validation", val)):
            if len(split) < self.seq_len + 1:
                raise ValueError(
                    f"the {name} split has {len(split)} bytes; seq_len={self.seq_len} needs at least {self.seq_len + 1}"
                )
        self.train, self.val = train, val

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng((self.seed, _TRAIN_STREAM, step))
        return self._windows(self.train, rng.integers(0, len(self.train) - self.seq_len, size=self.batch_size))

    def eval_batches(self) -> list[dict[str, np.ndarray]]:
        count = max(1, min(self.eval_tokens, len(self.val) - 1) // self.seq_len)
        return self._batched(self._windows(self.val, np.arange(count) * self.seq_len))


class RecallDataset(Dataset):
    """The associative-recall stream: documents generated on demand, document d from seed (seed, d).

    Step s trains on stream positions [s * batch * seq_len, (s + 1) * batch * seq_len], so runs with the same
    tokens per step (say 16 x 1024 and 4 x 4096) see exactly the same tokens in the same order.
    """

    has_answers = True

    def __init__(self, *, doc_len: int, num_keys: int, values_per_key: int, fact_probability: float, **kwargs):
        super().__init__(**kwargs)
        self.doc_len, self.num_keys, self.values_per_key = doc_len, num_keys, values_per_key
        self.fact_probability = fact_probability

    def _stream(self, seed: tuple, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        first, last = start // self.doc_len, (start + length - 1) // self.doc_len
        docs = [
            recall_document(
                np.random.default_rng((*seed, d)),
                self.doc_len,
                num_keys=self.num_keys,
                values_per_key=self.values_per_key,
                fact_probability=self.fact_probability,
            )
            for d in range(first, last + 1)
        ]
        offset = start - first * self.doc_len
        tokens = np.concatenate([d[0] for d in docs])[offset : offset + length]
        answers = np.concatenate([d[1] for d in docs])[offset : offset + length]
        return tokens, answers

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        span = self.batch_size * self.seq_len
        tokens, answers = self._stream((self.seed, _TRAIN_STREAM), step * span, span + 1)
        return self._windows(tokens, np.arange(self.batch_size) * self.seq_len, answers)

    def eval_batches(self) -> list[dict[str, np.ndarray]]:
        count = max(1, self.eval_tokens // self.seq_len)
        tokens, answers = self._stream((_VAL_SEED, _VAL_STREAM), 0, count * self.seq_len + 1)
        return self._batched(self._windows(tokens, np.arange(count) * self.seq_len, answers))


def make_dataset(cfg) -> Dataset:
    """The dataset a `TrainConfig` names: "stdlib", "recall" or a path to a text file."""
    common = dict(seed=cfg.seed, seq_len=cfg.seq_len, batch_size=cfg.batch_size, eval_tokens=cfg.eval_tokens)
    if cfg.data == "recall":
        return RecallDataset(
            doc_len=cfg.recall_doc_len,
            num_keys=cfg.recall_num_keys,
            values_per_key=cfg.recall_values_per_key,
            fact_probability=cfg.recall_fact_probability,
            **common,
        )
    if cfg.data == "stdlib":
        train, val = stdlib_files(cfg.corpus_bytes, cfg.val_fraction)
        return TextDataset(_read(train), _read(val), **common)
    text = np.fromfile(cfg.data, dtype=np.uint8)
    cut = int(len(text) * (1 - cfg.val_fraction))
    return TextDataset(text[:cut], text[cut:], **common)
