"""Byte-level tokenizer of the embedded models: ids 0-255 are bytes, then BOS, EOS, PAD."""

from __future__ import annotations


class ByteTokenizer:
    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        return ([self.bos_id] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """Bytes only; special and out-of-range ids are skipped, invalid UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def to_tokenizers(self):
        """The same ids as a `tokenizers.Tokenizer` (what a checkpoint folder's tokenizer.json holds, so that the
        shipped model loads like any other): byte b is the token of byte-level character b (no merges), then
        the specials <bos>, <eos>, <pad>. Encoding adds no BOS (the loader adds the config's)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        tok = Tokenizer(models.BPE(vocab={ch: b for b, ch in _byte_chars().items()}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(["<bos>", "<eos>", "<pad>"])  # ids 256, 257, 258
        return tok


def _byte_chars() -> dict[int, str]:
    """The byte-level pre-tokenizer's printable character for each byte (GPT-2's table): printable Latin-1
    bytes stand for themselves, the other 68 take code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(rest)}}
