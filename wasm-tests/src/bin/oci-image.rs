//! `oci-image`: packs the filter into an OCI image layout in Istio's "compat" Wasm image
//! format (one gzip tar layer holding `plugin.wasm`), with no container engine, and prints
//! the manifest digest. The digest depends only on the module's bytes.
//!
//! cargo run -p wasm-tests --release --bin oci-image -- --out target/oci/tokenaware
//! skopeo copy oci:target/oci/tokenaware:latest docker://REGISTRY/tokenaware:latest

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use wasm_tests::{envoy::repo_root, oci};

/// Builds the compat OCI image of tokenaware.wasm; prints the manifest digest on stdout.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Output directory (an OCI image layout; an earlier layout there is replaced).
    #[arg(long)]
    out: PathBuf,
    /// The module to pack [default: target/wasm32-wasip1/release/tokenaware.wasm].
    #[arg(long)]
    wasm: Option<PathBuf>,
    /// Tag recorded in index.json (`oci:OUT:TAG` for skopeo).
    #[arg(long, default_value = "latest")]
    tag: String,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let wasm_path = args
        .wasm
        .unwrap_or_else(|| repo_root().join("target/wasm32-wasip1/release/tokenaware.wasm"));
    let wasm = std::fs::read(&wasm_path).with_context(|| {
        format!(
            "read {} (build it with `cargo build -p tokenaware --release --target wasm32-wasip1`)",
            wasm_path.display()
        )
    })?;
    let built = oci::write_layout(&wasm, &args.out, &args.tag)?;
    eprintln!(
        "oci-image: {} ({} bytes, {}) -> {}:{} (layer {})",
        wasm_path.display(),
        wasm.len(),
        built.wasm_digest,
        args.out.display(),
        built.tag,
        built.layer_digest
    );
    println!("{}", built.manifest_digest);
    Ok(())
}
