//! `--prompt-ids` text: `cli::parse_ids`; accepted ids print back to text that parses to the same.
#![no_main]
use deltafin::cli::parse_ids;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    if let Ok(ids) = parse_ids(s) {
        assert!(!ids.0.is_empty());
        let back: Vec<String> = ids.0.iter().map(u32::to_string).collect();
        assert_eq!(parse_ids(&back.join(",")).map(|x| x.0).ok(), Some(ids.0));
    }
});
