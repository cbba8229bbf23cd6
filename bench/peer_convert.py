#!/usr/bin/env python3
"""Runs llama.cpp's own HF -> GGUF converter (its kimi_k3 code path) on a `deltafin synth` checkpoint.

    peer_convert.py LLAMA_CPP_DIR MODEL_DIR --outfile OUT.gguf [converter options...]

Only the vocabulary step is replaced. The converter's kimi_k3 path reads the tokenizer through
transformers with trust_remote_code, i.e. the Python tokenizer class that the published checkpoint
ships; a synthetic checkpoint ships the tiktoken rank file and tokenizer_config.json instead (what
deltafin reads). So this wrapper writes a builtin vocabulary from those two files in the form the
converter's own kimi-k2 branch writes (gpt2-style BPE, pre-tokenizer "kimi-k2", merges derived from
the ranks with the converter's QwenModel.bpe helper), then hands over to the converter's main().
One hyperparameter is filled in when absent: num_key_value_heads (see init below). Every tensor,
the other hyperparameters and the MXFP4 expert repack go through the converter unchanged.
"""
from __future__ import annotations

import base64
import json
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: peer_convert.py LLAMA_CPP_DIR MODEL_DIR --outfile OUT.gguf [options]")
    llama_dir = Path(sys.argv[1]).resolve()
    if not (llama_dir / "convert_hf_to_gguf.py").is_file():
        sys.exit(f"peer_convert: {llama_dir}/convert_hf_to_gguf.py not found")
    if not (llama_dir / "conversion" / "kimi_k3.py").is_file():
        sys.exit(f"peer_convert: {llama_dir} has no kimi_k3 converter (conversion/kimi_k3.py)")
    # The converter parses sys.argv itself: leave it MODEL_DIR and the options.
    sys.argv = [str(llama_dir / "convert_hf_to_gguf.py")] + sys.argv[2:]
    sys.path.insert(0, str(llama_dir))
    sys.path.insert(1, str(llama_dir / "gguf-py"))

    import convert_hf_to_gguf as conv  # noqa: E402  (the vendored converter)
    from conversion.base import gguf, logger  # noqa: E402
    from conversion.kimi_k3 import KimiK3Model  # noqa: E402
    from conversion.qwen import QwenModel  # noqa: E402

    def builtin_vocab(self) -> None:
        d = Path(self.dir_model)
        ranks: dict[bytes, int] = {}
        for n, line in enumerate((d / "tiktoken.model").read_text().splitlines(), 1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{d}/tiktoken.model line {n}: expected 'BASE64 RANK'")
            ranks[base64.b64decode(parts[0])] = int(parts[1])
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        specials = {v["content"]: int(k) for k, v in cfg.get("added_tokens_decoder", {}).items()}

        vocab: dict[str, int] = {}
        merges: list[str] = []
        for tok, rank in ranks.items():
            vocab[QwenModel.token_bytes_to_string(tok)] = rank
            if len(tok) > 1:
                pair = QwenModel.bpe(ranks, tok, max_rank=rank)
                if len(pair) == 2:
                    merges.append(" ".join(map(QwenModel.token_bytes_to_string, pair)))
        by_id = {i: t for t, i in {**vocab, **specials}.items()}
        tokens: list[str] = []
        types: list[int] = []
        for i in range(self.hparams["vocab_size"]):
            if i not in by_id:
                tokens.append(f"[PAD{i}]")
                types.append(gguf.TokenType.UNUSED)
            else:
                tokens.append(by_id[i])
                types.append(gguf.TokenType.CONTROL if i in specials.values() else gguf.TokenType.NORMAL)
        logger.info(f"builtin vocabulary: {len(ranks)} ranks, {len(specials)} specials, {len(merges)} merges")
        w = self.gguf_writer
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("kimi-k2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                         ("pad_token_id", w.add_pad_token_id)):
            if (v := self.hparams.get(key)) is not None:
                add(v)
        tmpl = d / "chat_template.jinja"
        if tmpl.is_file():
            w.add_chat_template(tmpl.read_text(encoding="utf-8"))

    # The converter splits kv_b_proj per KV head before it rewrites num_key_value_heads to 1 (MLA
    # served as MQA), so it needs the checkpoint's own value; synth's config.json leaves it out.
    # For MLA it is the head count (every head has its own K and V before absorption).
    base_init = KimiK3Model.__init__

    def init(self, *args, **kwargs) -> None:
        base_init(self, *args, **kwargs)
        if "num_key_value_heads" not in self.hparams:
            self.hparams["num_key_value_heads"] = self.hparams["num_attention_heads"]
            logger.info(f"num_key_value_heads absent: using num_attention_heads = {self.hparams['num_attention_heads']}")

    KimiK3Model.__init__ = init
    KimiK3Model.set_vocab = builtin_vocab
    conv.main()


if __name__ == "__main__":
    main()
