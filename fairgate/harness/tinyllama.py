"""A tiny llama-architecture model with random weights, written as GGUF with the ``gguf`` package.

Its output is gibberish, but an engine runs it like any llama: real prefill, real decode steps, real
continuous batching - which is all the real-engine tests need, with nothing downloaded. The vocabulary is
SentencePiece-style (llama.cpp's ``llama`` tokenizer): ``<unk>``, ``<s>``, ``</s>``, the 256 byte tokens
(``<0x00>``..``<0xFF>``) every byte falls back to, then printable ASCII characters and letter pairs, with and
without the word-start marker ``▁``. Tensor names and shapes follow llama.cpp's ``LLM_ARCH_LLAMA``
(``gguf.MODEL_TENSORS``).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

WORD_START = "\u2581"  # SentencePiece's "▁": the piece starts a word


@dataclass(frozen=True)
class TinyLlama:
    """The model's shape: ``embedding`` (hidden size), ``layers``, ``ffn`` (feed-forward size), ``heads``
    (all of them key/value heads too), ``context`` (trained context length, tokens)."""

    # ~21M parameters: decode steps of 15-40 ms at a batch of 8 on one CPU thread, slow enough that the
    # gateway's relay (a Python process on the same two cores) is not what the tests measure.
    embedding: int = 512
    layers: int = 6
    ffn: int = 1536
    heads: int = 8
    context: int = 16384

    @property
    def head_dim(self) -> int:
        return self.embedding // self.heads


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """The tokens, their SentencePiece scores (longer pieces score higher, so they are preferred) and
    their types (``gguf.TokenType``)."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    chars = [c for c in string.printable if c not in string.whitespace] + [" "]
    pieces = chars + [WORD_START + c for c in chars if c != " "]
    letters = string.ascii_lowercase
    pairs = [a + b for a in letters for b in "aeiounrst"]
    pieces += pairs + [WORD_START + p for p in pairs]
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    scores = [0.0] * (3 + 256) + [-100.0 + len(p) for p in pieces]
    return tokens, scores, [int(t) for t in types]


def write_random_gguf(path: Path, model: TinyLlama | None = None, seed: int = 0) -> Path:
    """Write a random-weight ``model`` (default ``TinyLlama()``) to ``path`` (F16 matrices, F32 norms);
    returns ``path``. Deterministic in ``seed``."""
    model = model or TinyLlama()
    tokens, scores, types = vocabulary()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("fairgate-tiny-random")
    writer.add_context_length(model.context)
    writer.add_embedding_length(model.embedding)
    writer.add_block_count(model.layers)
    writer.add_feed_forward_length(model.ffn)
    writer.add_head_count(model.heads)
    writer.add_head_count_kv(model.heads)
    writer.add_rope_dimension_count(model.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in _tensors(model, len(tokens), np.random.default_rng(seed)):
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tensors(model: TinyLlama, vocab: int, rng: np.random.Generator) -> list[tuple[str, np.ndarray]]:
    """(name, array) of every tensor; numpy shapes are (rows, columns), GGUF's ``ne`` reversed."""
    e, f = model.embedding, model.ffn

    def matrix(rows: int, cols: int) -> np.ndarray:  # F16: what llama.cpp runs fastest on a CPU
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float16)

    def norm() -> np.ndarray:
        return np.ones(e, dtype=np.float32)

    # The control and byte tokens' output rows are near zero, so their logits are near zero while ~40 % of
    # the text pieces' are well above: a top-k sampler (llama.cpp's default top_k 40) never draws them. A
    # byte token above 0x7F is half a character, which the server holds back (a token with no text, no
    # chunk), and </s> would end a sequence early: every generated token is then one chunk of text.
    output = matrix(vocab, e)
    output[: 3 + 256] *= 1e-3
    out = [("token_embd.weight", matrix(vocab, e)), ("output_norm.weight", norm()), ("output.weight", output)]
    for i in range(model.layers):
        out += [
            (f"blk.{i}.attn_norm.weight", norm()),
            (f"blk.{i}.attn_q.weight", matrix(e, e)),
            (f"blk.{i}.attn_k.weight", matrix(e, e)),
            (f"blk.{i}.attn_v.weight", matrix(e, e)),
            (f"blk.{i}.attn_output.weight", matrix(e, e)),
            (f"blk.{i}.ffn_norm.weight", norm()),
            (f"blk.{i}.ffn_gate.weight", matrix(f, e)),
            (f"blk.{i}.ffn_up.weight", matrix(f, e)),
            (f"blk.{i}.ffn_down.weight", matrix(e, f)),
        ]
    return out
