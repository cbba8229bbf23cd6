//! Text through a fixed tokenizer (the demo model's: learned merges, K3's specials): `encode`
//! never yields a special id and round-trips; `encode_with_specials` round-trips too; the
//! streaming decoder, fed token by token, gives the same text.
#![no_main]
use deltafin::model::tokenizer::StreamDecoder;
use deltafin_fuzz::demo_tokenizer;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let tok = demo_tokenizer();
    let text = String::from_utf8_lossy(data);
    let ids = tok.encode(&text);
    assert!(ids.iter().all(|&i| i < tok.n_base()), "ordinary text became a special id");
    assert_eq!(tok.decode(&ids).ok().as_deref(), Some(&*text));
    let with = tok.encode_with_specials(&text);
    assert_eq!(tok.decode(&with).ok().as_deref(), Some(&*text));
    let mut d = StreamDecoder::default();
    let mut streamed = String::new();
    for &i in &ids {
        if let Ok(b) = tok.token_bytes(i) {
            streamed.push_str(&d.push(b));
        }
    }
    assert_eq!(d.finish(), 0, "a whole text leaves no unfinished character");
    assert_eq!(streamed, text);
});
