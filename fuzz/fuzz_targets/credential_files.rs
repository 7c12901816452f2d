//! Fuzz the key files' parsers: a credential file (`Credentials::parse`) and a cluster master
//! key file (`crypto::parse_master_key`). Any text gives keys or an error naming the line,
//! never a panic; what parses writes back (`to_file_text`, `master_key_text`) to text that
//! parses to the same keys.
//! Run: `cargo +nightly fuzz run credential_files seeds/credential_files -- -max_total_time=60`.
#![no_main]

use expertmesh_transport::crypto::{self, Credentials, KeyError};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The loaders read the file as UTF-8 text (`read_to_string`); other bytes never get here.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let named = |e: &KeyError| assert!(!e.to_string().is_empty());
    match Credentials::parse(text, "fuzz.cred") {
        Ok(c) => {
            let written = c.to_file_text();
            let again = Credentials::parse(&written, "written.cred")
                .unwrap_or_else(|e| panic!("written credential does not parse: {e}\n{written}"));
            assert_eq!(again.to_file_text(), written);
            assert_eq!(again.cluster(), c.cluster());
        }
        Err(e) => named(&e),
    }
    match crypto::parse_master_key(text, "fuzz.key") {
        Ok(k) => {
            let again = crypto::parse_master_key(&crypto::master_key_text(&k), "written.key")
                .expect("a written master key parses");
            assert_eq!(again.bytes(), k.bytes());
        }
        Err(e) => named(&e),
    }
});
