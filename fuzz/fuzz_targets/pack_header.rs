//! Expert pack headers: `pack::parse_header(head, file_len)`. Input: one flag byte, the file length
//! (u64 LE), then the file's first bytes (pack version 2). With flag bit 0 the header checksum is recomputed first,
//! so the fuzzer gets past it to the record checks. Accepted records must lie inside the file.
#![no_main]
use deltafin::store::pack::{ALIGN, header_sum, parse_header};
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    if data.len() < 9 {
        return;
    }
    let flags = data[0];
    let file_len = u64::from_le_bytes(data[1..9].try_into().unwrap_or([0; 8]));
    let mut head = data[9..].to_vec();
    if flags & 1 == 1 && head.len() >= 96 {
        let count = u32::from_le_bytes([head[16], head[17], head[18], head[19]]) as usize;
        let mut model = [0u8; 32];
        model.copy_from_slice(&head[64..96]);
        if let Some(idx) = head.get(96..96 + count * 32) {
            let sum = header_sum(&model, idx);
            head[40..48].copy_from_slice(&sum.to_le_bytes());
        }
    }
    if let Ok(h) = parse_header(Path::new("L1.pack"), &head, file_len) {
        for e in &h.entries {
            assert!(e.offset % ALIGN == 0 && e.offset >= h.header_len);
            assert!(e.offset.checked_add(e.length).is_some_and(|end| end <= file_len));
        }
    }
});
