"""The model's vocabulary: tokenize, detokenize, end-of-generation tokens, and a fingerprint.

Shared by the router (which loads the vocab alone, no weights) and the worker (which wraps its already
loaded model), so both sides turn text into exactly the same tokens. The fingerprint is a hash of the
whole vocabulary (the GGUF's tokenizer metadata, every token's text, type and score, plus the special ids llama.cpp
took from it): equal on both sides iff they tokenize alike.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import struct
import threading
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from common.weights import tokenizer_fingerprint
from protocol import vocab_message

POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's enum llama_pooling_type

_backend_lock = threading.Lock()
_backend_ready = False


def init_backend() -> None:
    """Initialise llama.cpp once per process and silence its stderr chatter (errors still print)."""
    global _backend_ready
    with _backend_lock:
        if _backend_ready:
            return
        from llama_cpp import _logger

        _logger.set_verbose(os.environ.get("KVROUTE_LLAMA_VERBOSE", "") not in ("", "0"))
        llama_cpp.llama_backend_init()
        _backend_ready = True


JOIN_AT = 1 << 15  # pieces joined at once (detokenize)


class VocabError(Exception):
    """The file could not be loaded as a vocabulary."""


def _meta_str(model: Any, key: str) -> str | None:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    if n < 0:
        return None
    if n >= len(buf):
        buf = ctypes.create_string_buffer(n + 1)
        llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace")


class Vocab:
    """Tokenizer of one GGUF model. Thread-safe for reads (llama.cpp's vocab is immutable after load)."""

    n_vocab: int
    bos: int | None
    eos: int | None
    add_bos: bool
    add_space_prefix: bool
    name: str
    chat_template: str | None
    fingerprint: str
    pooling: str | None  # the pooling the GGUF declares (`rank`: a reranker), None when it declares none
    causal: bool  # False for an encoder (bidirectional attention): it embeds and ranks, it cannot generate

    def __init__(self, model: Any, path: str | os.PathLike[str], *, owned: bool) -> None:
        self._model = model  # keeps the llama_model alive as long as the vocab pointer is used
        self.path = Path(path)
        self._owned = owned
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        v = self._vocab
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(v)
        bos, eos = llama_cpp.llama_vocab_bos(v), llama_cpp.llama_vocab_eos(v)
        self.bos = bos if bos >= 0 else None
        self.eos = eos if eos >= 0 else None
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(v))
        # SentencePiece vocabularies put a space before a text's first word unless the GGUF says not to (llama.cpp)
        prefix = _meta_str(model, "tokenizer.ggml.add_space_prefix")
        self.add_space_prefix = (
            prefix == "true" if prefix is not None else llama_cpp.llama_vocab_type(v) == llama_cpp.LLAMA_VOCAB_TYPE_SPM
        )
        self.name = _meta_str(model, "general.name") or Path(path).stem
        tmpl = llama_cpp.llama_model_chat_template(model, None)
        self.chat_template = tmpl.decode("utf-8", "replace") if tmpl else None
        arch = _meta_str(model, "general.architecture") or ""
        declared = _meta_str(model, f"{arch}.pooling_type")
        self.pooling = POOLING_TYPES.get(int(declared)) if declared and declared.isdigit() else None
        self.causal = _meta_str(model, f"{arch}.attention.causal") != "false"  # an encoder (BERT) cannot generate
        rerank = llama_cpp.llama_model_chat_template(model, b"rerank")
        self.rerank_template = rerank.decode("utf-8", "replace") if rerank else None
        sep = llama_cpp.llama_vocab_sep(v)
        self.sep = sep if sep >= 0 else None
        self.add_eos = bool(llama_cpp.llama_vocab_get_add_eos(v))
        self.add_sep = bool(llama_cpp.llama_vocab_get_add_sep(v))
        self._eog = frozenset(t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(v, t))
        self._pieces: dict[int, bytes] = {}
        self.fingerprint = self._fingerprint()

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Vocab:
        """Load only the vocabulary of the GGUF at `path` (no weights; fast). Raises VocabError."""
        init_backend()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise VocabError(f"cannot load the vocabulary of {path}")
        return cls(model, path, owned=True)

    @classmethod
    def from_model(cls, model_ptr: Any, path: str | os.PathLike[str]) -> Vocab:
        """Wrap an already loaded llama_model (the worker's); the caller keeps ownership of the model."""
        return cls(model_ptr, path, owned=False)

    def close(self) -> None:
        if self._owned and self._model:
            llama_cpp.llama_model_free(self._model)
        self._model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _fingerprint(self) -> str:
        v = self._vocab
        h = hashlib.blake2b(digest_size=16)
        h.update(
            struct.pack(
                "<iiiii?",
                llama_cpp.llama_vocab_type(v),
                self.n_vocab,
                -1 if self.bos is None else self.bos,
                -1 if self.eos is None else self.eos,
                llama_cpp.llama_vocab_eot(v),
                self.add_bos,
            )
        )
        h.update(tokenizer_fingerprint(self.path).encode())  # (what llama.cpp built the vocabulary from)
        return h.hexdigest()

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Text -> token ids. `add_special` adds BOS when the model wants it; `parse_special` turns
        special-token text such as `<start_of_turn>` into its id."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        while True:
            out = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), out, cap, add_special, parse_special)
            if n >= 0:
                return out[:n]
            cap = -n

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text; None when the file has no such key."""
        return _meta_str(self._model, key)

    def arch_meta_int(self, key: str) -> int | None:
        """An architecture's integer hyperparameter (`block_count`, `context_length`...); None: absent or a list."""
        value = self.meta(f"{self.meta('general.architecture') or ''}.{key}")
        return int(value) if value is not None and value.isdigit() else None

    def kv_bytes_per_token(self) -> float:
        """An estimate, from the GGUF's hyperparameters, of the KV bytes one token takes in one slot (every layer, f16;
        the worker computes the exact figure from the loaded model, and says it in its hello)."""
        n_layer, n_embd = self.arch_meta_int("block_count") or 0, self.arch_meta_int("embedding_length") or 0
        n_head = self.arch_meta_int("attention.head_count") or 1
        n_head_kv = self.arch_meta_int("attention.head_count_kv") or n_head
        k = self.arch_meta_int("attention.key_length") or n_embd // n_head
        v = self.arch_meta_int("attention.value_length") or n_embd // n_head
        return float(n_layer * n_head_kv * (k + v) * 2)

    def rerank_prompt(self, query: str, document: str, *, query_tokens: list[int] | None = None) -> list[int]:
        """A reranker's input for one (query, document) pair, as llama-server makes it (format_prompt_rerank): the
        GGUF's `rerank` template with {query} and {document} filled in (its special-token text read as such; the
        two are filled in one pass, so a query holding "{document}" stays as written), else [BOS] query [EOS] [SEP]
        document [EOS], each special token where the vocabulary asks for it (EOS falls back to SEP). Special-token
        text inside the query or the document is text. `query_tokens`: the query as this tokenizes it, when the
        caller has it already (a query with many documents is tokenized once)."""
        if self.rerank_template is not None:
            fill = {"{query}": query, "{document}": document}
            text = re.sub(r"\{query\}|\{document\}", lambda m: fill[m.group(0)], self.rerank_template)
            return self.tokenize(text, add_special=False, parse_special=True)
        end = self.eos if self.eos is not None else self.sep
        out = [self.bos] if self.add_bos and self.bos is not None else []
        out += self.tokenize(query, add_special=False, parse_special=False) if query_tokens is None else query_tokens
        out += [end] if self.add_eos and end is not None else []
        out += [self.sep] if self.add_sep and self.sep is not None else []
        out += self.tokenize(document, add_special=False, parse_special=False)
        out += [end] if self.add_eos and end is not None else []
        return out

    @property
    def model_ptr(self) -> Any:
        """The llama_model this vocabulary belongs to (vocab-only when loaded alone): for mtmd (common/projector.py)."""
        return self._model

    def piece(self, token: int) -> bytes:
        """Raw bytes of one token (special tokens rendered); may be part of a UTF-8 sequence."""
        cached = self._pieces.get(token)
        if cached is not None:
            return cached
        if not 0 <= token < self.n_vocab:
            raise ValueError(vocab_message(token, self.n_vocab))
        buf = ctypes.create_string_buffer(256)  # (its own: the router's preparing threads call this side by side)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        out = buf.raw[:n]
        self._pieces[token] = out
        return out

    def detokenize(self, tokens: list[int]) -> str:
        """Token ids -> text: the pieces joined, invalid UTF-8 replaced (the same text the worker streams). Joined
        JOIN_AT pieces at a time: one join of a million pieces holds the GIL, and every other thread, for 0.2 s."""
        pieces = [self.piece(t) for t in tokens]
        parts = [b"".join(pieces[i : i + JOIN_AT]) for i in range(0, len(pieces), JOIN_AT)]
        return b"".join(parts).decode("utf-8", "replace")

    def attr(self, token: int) -> int:
        """llama.cpp's attribute bits of a token (LLAMA_TOKEN_ATTR_CONTROL ...)."""
        return int(llama_cpp.llama_vocab_get_attr(self._vocab, token))

    @functools.cached_property
    def attrs(self) -> np.ndarray:
        """Every token's attribute bits, token id -> bits, read once (262k calls: 0.08 s for Gemma's vocabulary)."""
        get, v = llama_cpp.llama_vocab_get_attr, self._vocab
        return np.fromiter((get(v, t) for t in range(self.n_vocab)), dtype=np.int64, count=self.n_vocab)

    def text(self, token: int) -> bytes:
        """A token's text as the vocabulary stores it (SentencePiece's spaces as U+2581; special tokens as written)."""
        return llama_cpp.llama_vocab_get_text(self._vocab, token) or b""

    @property
    def pointer(self) -> Any:
        """The llama_vocab pointer (for libraries that read the vocabulary themselves)."""
        return self._vocab

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, <end_of_turn> ...)."""
        return token in self._eog

    @property
    def eog_tokens(self) -> frozenset[int]:
        return self._eog
