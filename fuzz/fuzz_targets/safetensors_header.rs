//! A safetensors shard (the whole file's bytes): `checkpoint::parse_header`, then the absolute byte
//! ranges `Checkpoint::open` computes from it, which must lie inside the file.
#![no_main]
use deltafin::model::checkpoint::parse_header;
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    if let Ok((n, meta)) = parse_header(Path::new("model.safetensors"), data) {
        let data_start = 8 + n as u64;
        for (_, info) in meta.tensors() {
            let (s, e) = (data_start + info.data_offsets.0 as u64, data_start + info.data_offsets.1 as u64);
            assert!(s <= e && e <= data.len() as u64, "tensor range {s}..{e} outside a {}-byte file", data.len());
        }
    }
});
