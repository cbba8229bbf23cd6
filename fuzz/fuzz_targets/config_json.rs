//! config.json: `K3Config::parse` on any bytes, then the sizes the engine derives from a config
//! that parsed. Must return a typed error or a config, never panic or abort.
#![no_main]
use deltafin::model::K3Config;
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(c) = K3Config::parse(Path::new("config.json"), text) {
        assert_eq!(c.attn.len(), c.layers);
        assert_eq!(c.ffn.len(), c.layers);
        let _ = (c.kda_dim(), c.moe_layers(), c.expert_bytes());
    }
});
