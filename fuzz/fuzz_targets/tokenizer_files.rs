//! The tokenizer files: input = tiktoken.model text, NUL, tokenizer_config.json text. Both are
//! parsed (`parse_rank_file`, `parse_specials`); when they parse and are small, the tokenizer is
//! built and must round-trip text through encode/decode.
#![no_main]
use deltafin::model::tokenizer::{Tokenizer, parse_rank_file, parse_specials};
use deltafin_fuzz::split_nul;
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let (ranks, config) = split_nul(data);
    let Ok(ranks) = std::str::from_utf8(ranks) else { return };
    let Ok(tokens) = parse_rank_file(Path::new("tiktoken.model"), ranks) else { return };
    let config = config.and_then(|c| std::str::from_utf8(c).ok()).unwrap_or("{}");
    let Ok(specials) = parse_specials(Path::new("tokenizer_config.json"), config, tokens.len()) else { return };
    if tokens.len() > 4096 {
        return;
    }
    let Ok(tok) = Tokenizer::from_parts(tokens, specials) else { return };
    for text in ["Hello, world! 123 <|open|>", config] {
        let ids = tok.encode(text);
        assert!(ids.iter().all(|&i| i < tok.n_base()), "ordinary text became a special id");
        assert_eq!(tok.decode(&ids).ok().as_deref(), Some(text));
    }
});
