//! model.safetensors.index.json: `checkpoint::parse_index`; every shard name it accepts must be a
//! plain file name inside the model directory.
#![no_main]
use deltafin::model::checkpoint::parse_index;
use libfuzzer_sys::fuzz_target;
use std::path::{Component, Path};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok((names, map)) = parse_index(Path::new("model.safetensors.index.json"), text) {
        for n in &names {
            let mut c = Path::new(n).components();
            assert!(matches!((c.next(), c.next()), (Some(Component::Normal(_)), None)), "shard name {n:?}");
        }
        assert!(map.values().all(|v| names.contains(v)));
    }
});
