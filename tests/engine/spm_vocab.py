"""A tiny SentencePiece ("llama") GGUF vocabulary for tokenizer and detokenizer tests."""

from __future__ import annotations

from gguf import GGUFWriter


def write_spm_gguf(path: str, template: str | None = None) -> tuple[list[str], list[float]]:
    """A tiny SentencePiece ("llama") vocabulary, written as llama.cpp's converter does."""
    pieces = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    pieces += [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    normal = ["▁", "a", "b", "c", "d", "e", "h", "l", "o", "r", "w", "é", "▁h", "▁w", "he", "ll",
              "lo", "or", "ld", "▁he", "llo", "▁hello", "▁wor", "▁world", "ab", "bc", "abc",
              "▁a", "▁ab", "▁abc", "ca", "cab"]
    pieces += [(p, -float(i) / 4 - (0.0 if len(p) > 1 else 10.0), 1) for i, p in enumerate(normal)]
    w = GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(1)
    w.add_tokenizer_model("llama")
    w.add_token_list([p for p, _, _ in pieces])
    w.add_token_scores([s for _, s, _ in pieces])
    w.add_token_types([t for _, _, t in pieces])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if template:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return [p for p, _, _ in pieces], [s for _, s, _ in pieces]
