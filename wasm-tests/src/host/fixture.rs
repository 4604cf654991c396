//! Builds the echo-filter fixture (`wasm-tests/fixtures/echo-filter`, its own workspace)
//! once per test process, into `target/fixtures`, so host tests need no prebuilt `.wasm`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The workspace root (parent of this crate).
pub fn workspace_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().unwrap_or(here).to_path_buf()
}

/// Path of the built echo filter; builds it on first use (a few seconds when cached).
pub fn echo_filter() -> anyhow::Result<PathBuf> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| build().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn build() -> anyhow::Result<PathBuf> {
    let root = workspace_root();
    let manifest = root.join("wasm-tests/fixtures/echo-filter/Cargo.toml");
    let target_dir = root.join("target/fixtures");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let out = Command::new(cargo)
        .args([
            "build",
            "--release",
            "--target",
            "wasm32-wasip1",
            "--manifest-path",
        ])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&target_dir)
        // Whatever the outer cargo set for its own build must not leak into this one.
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .output()?;
    if !out.status.success() {
        anyhow::bail!(
            "building {} failed:\n{}",
            manifest.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(target_dir.join("wasm32-wasip1/release/echo_filter.wasm"))
}
