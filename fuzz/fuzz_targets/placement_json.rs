//! placement.json: `Manifest::parse`; a manifest it accepts names only listed drives and carries
//! parseable checksums (what `manifest_spec` relies on).
#![no_main]
use deltafin::store::placement::Manifest;
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(m) = Manifest::parse(Path::new("placement.json"), text) {
        for l in &m.layers {
            for x in &l.experts {
                assert!(x.drives.iter().all(|&d| (d as usize) < m.drives.len()));
                assert!(u64::from_str_radix(&x.xxh3, 16).is_ok());
            }
        }
    }
});
