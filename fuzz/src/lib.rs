//! Helpers shared by the fuzz targets: splitting one input into several files, and small fixed
//! tokenizers built once per process. Contract: nothing here panics on any input.

use deltafin::model::bpe_train::{TRAINING_TEXT, train_ranks};
use deltafin::model::tokenizer::{K3_SPECIALS, NUM_SPECIALS, Tokenizer};
use std::sync::OnceLock;

/// The input up to the first NUL and the rest after it (None when there is no NUL).
pub fn split_nul(data: &[u8]) -> (&[u8], Option<&[u8]>) {
    match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], Some(&data[i + 1..])),
        None => (data, None),
    }
}

/// K3's special names for a base vocabulary of `n_base` tokens (the synth layout).
pub fn k3_specials(n_base: usize) -> Vec<String> {
    let mut names: Vec<String> = (0..NUM_SPECIALS).map(|i| format!("<|reserved_token_{}|>", n_base + i)).collect();
    for (off, name) in K3_SPECIALS {
        names[off] = name.to_string();
    }
    names
}

/// The demo model's tokenizer: 2048 base tokens learned from the built-in text (real merges, so
/// BPE has work to do), K3's specials after them.
pub fn demo_tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let n_base = 2048;
        let ranks = train_ranks(TRAINING_TEXT, n_base);
        match Tokenizer::from_parts(ranks, k3_specials(n_base)) {
            Ok(t) => t,
            Err(e) => panic!("the demo tokenizer must build: {e}"),
        }
    })
}
