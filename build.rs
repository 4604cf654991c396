//! Generates the calibration preset table from `data/presets.csv` and stamps the build's
//! version and git hash, which the filter logs at start.
use std::{env, fs, path::Path, process::Command};

fn main() {
    println!("cargo:rerun-if-changed=data/presets.csv");
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/refs/heads");
    println!("cargo:rerun-if-changed=.git/logs/HEAD");
    let csv = fs::read_to_string("data/presets.csv").unwrap_or_default();
    let mut out = String::from(
        "/// (name, model, accelerator, engine, tensor parallel, tokens/s, chunk tokens)\n",
    );
    out.push_str("pub const PRESETS: &[Preset] = &[\n");
    for line in csv.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        if f.len() != 7 {
            println!("cargo:warning=presets.csv: skipping malformed line {line:?}");
            continue;
        }
        out.push_str(&format!(
            "    Preset {{ name: {:?}, model: {:?}, accelerator: {:?}, engine: {:?}, tensor_parallel: {}, peak_prefill_tokens_per_s: {}.0, chunk_tokens: {} }},\n",
            f[0], f[1], f[2], f[3], f[4], f[5], f[6]
        ));
    }
    out.push_str("];\n");
    let dir = env::var("OUT_DIR").unwrap_or_else(|_| ".".into());
    let _ = fs::write(Path::new(&dir).join("presets.rs"), out);
    let git = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=TOKENAWARE_GIT_HASH={git}");
}
