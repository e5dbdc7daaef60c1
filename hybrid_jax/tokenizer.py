"""Byte-level tokenizer of the embedded tiny model: ids 0-255 are bytes, then BOS, EOS, PAD."""

from __future__ import annotations


class ByteTokenizer:
    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        return ([self.bos_id] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """Bytes only; special and out-of-range ids are skipped, invalid UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")
