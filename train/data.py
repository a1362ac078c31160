"""Training data with nothing downloaded: byte streams cut into windows of `seq_len + 1` tokens.

Every batch is a pure function of (seed, step), so the data position is the step: two runs with one seed
see the same batches in the same order, and a resumed run continues exactly where it stopped.

- `stdlib`: the Python standard library's own sources as bytes (vocab 256), split into train and
  validation by a hash of each file's path.
- `recall`: a synthetic associative-recall stream. Documents of `recall_doc_len` tokens are made of 8-token
  records: a key (`recall_key_len` symbols), then `=` and a value (bind a fresh key to a random value), or
  `?` and the value of a key bound earlier in the same document (a query, with probability
  `recall_query_probability` while unused keys remain; its key is chosen uniformly among the bindings so far).
  A recalled value is predictable only if the key's last showing lies inside the model's context, so a model
  trained and evaluated with a longer context can reach a lower validation loss on the same tokens: the
  FlashAttention paper's 1k -> 4k effect in a form where the cause is known. Each recalled token carries its
  distance (tokens back to that last showing), so evaluation can score far answers on their own.
- any other value: a path to a text file, read as bytes; the last `val_fraction` of it is validation.
"""
from __future__ import annotations

import hashlib
import pathlib
import sysconfig

import numpy as np

VOCAB_SIZE = 256
KEY_LEN, VALUE_LEN = 2, 5
RECORD_LEN = KEY_LEN + 1 + VALUE_LEN
# 64 printable symbols for keys and values, so a document prints as readable text.
ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+/", dtype=np.uint8)
NUM_KEYS = len(ALPHABET) ** 2
SET_OP, GET_OP = ord("="), ord("?")
# Accuracy on a recalled value's token when its binding is out of sight: a uniform guess among the symbols.
RECALL_CHANCE = 1 / len(ALPHABET)
GET_PROBABILITY = 0.5
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
    files = [p for p in root.rglob("*.py")
             if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)]
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


def recall_document(rng: np.random.Generator, doc_len: int, *, key_len: int = KEY_LEN,
                    query_probability: float = GET_PROBABILITY) -> tuple[np.ndarray, np.ndarray]:
    """One recall document: uint8 tokens [doc_len] and int32 distances [doc_len]: for a recalled value's
    token, how many tokens back its key was last shown (the binding, or an earlier query of the same key,
    which shows the same value); 0 for every other token.

    Keys are distinct bindings (one symbol: 64 keys, two: 4096); once all are bound every record is a query.
    With one-symbol keys a two-layer model needs only an induction head (match the key, copy what followed).
    Measured on CPU (the `long` preset's model, 80% queries, float32), 2026-11-23: with documents as long as
    the context (doc_len 128, context 128, lr 1e-2) answer accuracy reached 62% by step 150, and 59% at
    context 512 with 128-token documents; with doc_len 512 or 4096 it learned nothing in 150-300 steps (contexts
    128 and 512, lr 1e-2 or 2e-3, bf16 or float32), and a model first trained on 128-token documents lost the
    skill (near answers 60% -> 11%) within 200 steps on 4096-token documents. The H100 runs at 1k and 4k
    context on 4096-token documents stayed at chance for 2,800 steps. Two-symbol keys (50% queries, lr 2e-3)
    had learned nothing in 1000 H100 steps. So the long-document task as built does not train in these
    budgets; showing the 1k -> 4k effect needs a task or schedule that does (issue 4).
    """
    value_len = RECORD_LEN - key_len - 1
    num_keys = len(ALPHABET) ** key_len
    num_records = doc_len // RECORD_LEN
    is_get = rng.random(num_records) < query_probability
    is_get[0] = False
    is_get[np.cumsum(~is_get) > num_keys] = True
    num_sets = int((~is_get).sum())
    keys = rng.choice(num_keys, size=num_sets, replace=False)
    values = rng.integers(0, len(ALPHABET), size=(num_sets, value_len))
    sets_before = np.cumsum(~is_get) - (~is_get)
    binding = np.where(is_get, (rng.random(num_records) * sets_before).astype(np.int64), np.cumsum(~is_get) - 1)
    digits = np.stack([keys[binding] // len(ALPHABET) ** (key_len - 1 - i) % len(ALPHABET) for i in range(key_len)], axis=1)
    records = np.concatenate([ALPHABET[digits], np.where(is_get, GET_OP, SET_OP).astype(np.uint8)[:, None],
                              ALPHABET[values[binding]]], axis=1)
    last_seen = {}
    distance = np.zeros((num_records, RECORD_LEN), dtype=np.int32)
    for r in range(num_records):
        b = int(binding[r])
        if is_get[r]:
            distance[r, key_len + 1:] = (r - last_seen[b]) * RECORD_LEN
        last_seen[b] = r
    return records.reshape(-1), distance.reshape(-1)


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
        return [{k: v[i:i + self.batch_size] for k, v in windows.items()} for i in range(0, count, self.batch_size)]


class TextDataset(Dataset):
    """Random windows of a byte corpus for training; consecutive windows of the validation split for eval."""

    def __init__(self, train: np.ndarray, val: np.ndarray, **kwargs):
        super().__init__(**kwargs)
        for name, split in (("train", train), ("validation", val)):
            if len(split) < self.seq_len + 1:
                raise ValueError(f"the {name} split has {len(split)} bytes; seq_len={self.seq_len} needs "
                                 f"at least {self.seq_len + 1}")
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

    def __init__(self, *, doc_len: int, key_len: int = KEY_LEN, query_probability: float = GET_PROBABILITY,
                 **kwargs):
        super().__init__(**kwargs)
        self.doc_len, self.key_len, self.query_probability = doc_len, key_len, query_probability

    def _stream(self, seed: tuple, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        first, last = start // self.doc_len, (start + length - 1) // self.doc_len
        docs = [recall_document(np.random.default_rng((*seed, d)), self.doc_len, key_len=self.key_len,
                                query_probability=self.query_probability) for d in range(first, last + 1)]
        offset = start - first * self.doc_len
        tokens = np.concatenate([d[0] for d in docs])[offset:offset + length]
        answers = np.concatenate([d[1] for d in docs])[offset:offset + length]
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
        return RecallDataset(doc_len=cfg.recall_doc_len, key_len=cfg.recall_key_len,
                             query_probability=cfg.recall_query_probability, **common)
    if cfg.data == "stdlib":
        train, val = stdlib_files(cfg.corpus_bytes, cfg.val_fraction)
        return TextDataset(_read(train), _read(val), **common)
    text = np.fromfile(cfg.data, dtype=np.uint8)
    cut = int(len(text) * (1 - cfg.val_fraction))
    return TextDataset(text[:cut], text[cut:], **common)
