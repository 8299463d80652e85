//! The proxy's YAML files: the local mesh config (`local_xds_path`, in
//! ztunnel's format) through `xds::local::parse`, and the proxy's own config
//! file through `Layers::apply_yaml` and `ProxyConfig::from_layers`.
//!
//! Checked beyond "no panic": a mesh that loads finds each workload and
//! service at its addresses.

#![no_main]

use std::path::Path;

use ambit::config::proxy::PROXY_KEYS;
use ambit::config::{Layers, ProxyConfig};
use ambit::xds::local;
use ambit_fuzz::check_state;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Both files are read with read_to_string: UTF-8 or nothing.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("fuzz.yaml");
    // Errors are formatted too: their text is what an operator reads.
    match local::parse(path, text) {
        Ok(state) => check_state(&state),
        Err(e) => drop(e.to_string()),
    }
    let mut layers = Layers::new(PROXY_KEYS);
    match layers.apply_yaml(path, text) {
        Ok(()) => {
            if let Err(e) = ProxyConfig::from_layers(&layers) {
                drop(e.to_string());
            }
            drop(layers.render());
        }
        Err(e) => drop(e.to_string()),
    }
});
