//! Fuzz the Hugging Face `config.json` mapping: any bytes that parse as a JSON object give a
//! `ModelSpec` or a list of reasons, never a panic; a spec that maps is a valid model file (it
//! round-trips through the model file format to the same spec).
//! Run: `cargo +nightly fuzz run hf_config seeds/hf_config -- -max_total_time=60`.
#![no_main]

use expertmesh_checkpoint::hf_config::{Family, model_from_hf_config};
use expertmesh_topology::model_file::{model_from_toml_str, model_to_toml_string};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    // The reader refuses anything but a JSON object before mapping (`read_config`).
    let Ok(Value::Object(config)) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    if let Some(Value::String(t)) = config.get("model_type") {
        let _ = Family::from_model_type(t);
    }
    match model_from_hf_config(&config, "fuzz-model") {
        Ok(spec) => {
            let text = model_to_toml_string(&spec);
            let again = model_from_toml_str(&text)
                .unwrap_or_else(|p| panic!("a mapped model is not a valid model file: {p:?}"));
            assert_eq!(again, spec, "the model file does not round-trip");
        }
        Err(reasons) => assert!(!reasons.is_empty() && reasons.iter().all(|r| !r.is_empty())),
    }
});
