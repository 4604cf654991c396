//! OCI image of the filter in the "compat" Wasm image format that Istio's agent, Envoy
//! Gateway and plain registry tooling accept, written as an OCI image layout (`oci-layout`,
//! `index.json`, `blobs/sha256/…`) without a container engine. `skopeo copy oci:DIR:TAG
//! docker://…` pushes it.
//!
//! The bytes are a function of the module alone, so the manifest digest (what
//! `WasmPlugin.spec.sha256` and `EnvoyExtensionPolicy…image.sha256` pin) is reproducible: the
//! tar entry has mtime 0, uid/gid 0, mode 0644 and no user names; the gzip header has mtime 0,
//! no file name and OS byte 255; the JSON documents are serialised from fixed structures with
//! no timestamps. (A different `flate2` backend or version may compress differently: the
//! digest is reproducible for one Cargo.lock.)
//!
//! Media types, checked against istio/istio `pkg/wasm/imagefetcher.go` (commit 01348d9) and
//! solo-io/wasm `spec/spec-compat.md`:
//! - manifest `application/vnd.oci.image.manifest.v1+json`. Istio first asks whether the
//!   manifest is Docker schema 2; an OCI manifest falls through to its "compat" branch;
//! - layer `application/vnd.oci.image.layer.v1.tar+gzip`: Istio takes the last layer, which
//!   must have exactly this type, gunzips it and returns the first tar entry whose base name is
//!   `plugin.wasm`. The spec wants exactly one layer, so there is one;
//! - config `application/vnd.oci.image.config.v1+json` (Istio never reads it; registries and
//!   skopeo want a valid image config);
//! - manifest annotation `module.wasm.image/variant: compat`, which the spec requires for the
//!   OCI layer type (Istio does not check it).
//!
//! The other variant Istio reads ("oci": two layers of `application/vnd.module.wasm.*`
//! types) and the CNCF one-layer `application/vnd.wasm.content.layer.v1+wasm` artifact (which
//! Istio rejects) are not produced.

use std::io::{Read, Write};
use std::path::Path;

use anyhow::{bail, ensure, Context};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
pub const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
pub const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const VARIANT_ANNOTATION: &str = "module.wasm.image/variant";
/// The name of the module inside the layer, fixed by the compat spec.
pub const PLUGIN_FILE: &str = "plugin.wasm";
/// `index.json` annotation naming the tag (`oci:DIR:TAG` in skopeo).
pub const REF_NAME_ANNOTATION: &str = "org.opencontainers.image.ref.name";

/// `sha256:<hex>` of `bytes`.
pub fn digest(bytes: &[u8]) -> String {
    let mut hex = String::with_capacity(71);
    hex.push_str("sha256:");
    for b in Sha256::digest(bytes) {
        hex.push_str(&format!("{b:02x}"));
    }
    hex
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<std::collections::BTreeMap<String, String>>,
}

impl Descriptor {
    fn of(media_type: &str, bytes: &[u8]) -> Self {
        Descriptor {
            media_type: media_type.into(),
            digest: digest(bytes),
            size: bytes.len() as u64,
            annotations: None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub schema_version: u32,
    #[serde(default)]
    pub media_type: Option<String>,
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<std::collections::BTreeMap<String, String>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Index {
    schema_version: u32,
    #[serde(default)]
    media_type: Option<String>,
    manifests: Vec<Descriptor>,
}

#[derive(Serialize)]
struct RootFs<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    diff_ids: Vec<String>,
}

/// The image config. Field order is fixed by the struct, so the bytes are too.
#[derive(Serialize)]
struct ImageConfig<'a> {
    architecture: &'a str,
    os: &'a str,
    rootfs: RootFs<'a>,
    config: serde_json::Map<String, serde_json::Value>,
}

/// The uncompressed layer: one ustar entry `plugin.wasm`, normalised metadata.
pub fn layer_tar(wasm: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut header = tar::Header::new_ustar();
    header.set_path(PLUGIN_FILE)?;
    header.set_size(wasm.len() as u64);
    header.set_entry_type(tar::EntryType::Regular);
    header.set_mode(0o644);
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(0);
    header.set_cksum();
    let mut builder = tar::Builder::new(Vec::new());
    builder.append(&header, wasm)?;
    Ok(builder.into_inner()?)
}

/// gzip with a fixed header (no name, mtime 0, OS "unknown") at the best compression level.
pub fn gzip(bytes: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut enc = flate2::GzBuilder::new()
        .mtime(0)
        .operating_system(255)
        .write(Vec::new(), flate2::Compression::best());
    enc.write_all(bytes)?;
    Ok(enc.finish()?)
}

/// What [`write_layout`] produced.
#[derive(Debug, Clone)]
pub struct Built {
    /// `sha256:…` of the manifest: the image digest a registry reports.
    pub manifest_digest: String,
    pub manifest_size: u64,
    /// `sha256:…` of the gzip layer blob.
    pub layer_digest: String,
    /// `sha256:…` of the module itself.
    pub wasm_digest: String,
    pub tag: String,
}

/// Writes the compat image of `wasm` as an OCI image layout in `dir`, tagged `tag`.
///
/// `dir` must be absent, empty, or an earlier OCI layout (which is replaced).
pub fn write_layout(wasm: &[u8], dir: &Path, tag: &str) -> anyhow::Result<Built> {
    ensure!(
        wasm.starts_with(b"\0asm"),
        "not a wasm module (no \\0asm magic)"
    );
    ensure!(
        !tag.is_empty()
            && tag.len() <= 128
            && tag
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)),
        "bad tag {tag:?}"
    );
    prepare_dir(dir)?;

    let tar = layer_tar(wasm)?;
    let layer = gzip(&tar)?;
    let config = serde_json::to_vec(&ImageConfig {
        architecture: "wasm",
        os: "wasip1",
        rootfs: RootFs {
            kind: "layers",
            diff_ids: vec![digest(&tar)],
        },
        config: serde_json::Map::new(),
    })?;
    let manifest = serde_json::to_vec(&Manifest {
        schema_version: 2,
        media_type: Some(MANIFEST_MEDIA_TYPE.into()),
        config: Descriptor::of(CONFIG_MEDIA_TYPE, &config),
        layers: vec![Descriptor::of(LAYER_MEDIA_TYPE, &layer)],
        annotations: Some([(VARIANT_ANNOTATION.to_string(), "compat".to_string())].into()),
    })?;
    let mut entry = Descriptor::of(MANIFEST_MEDIA_TYPE, &manifest);
    entry.annotations = Some([(REF_NAME_ANNOTATION.to_string(), tag.to_string())].into());
    let index = serde_json::to_vec(&Index {
        schema_version: 2,
        media_type: Some(INDEX_MEDIA_TYPE.into()),
        manifests: vec![entry],
    })?;

    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs)?;
    for blob in [&layer, &config, &manifest] {
        let d = digest(blob);
        std::fs::write(blobs.join(&d["sha256:".len()..]), blob)?;
    }
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    std::fs::write(dir.join("index.json"), &index)?;
    Ok(Built {
        manifest_digest: digest(&manifest),
        manifest_size: manifest.len() as u64,
        layer_digest: digest(&layer),
        wasm_digest: digest(wasm),
        tag: tag.into(),
    })
}

fn prepare_dir(dir: &Path) -> anyhow::Result<()> {
    if dir.exists() {
        let empty = std::fs::read_dir(dir)?.next().is_none();
        if !empty {
            ensure!(
                dir.join("oci-layout").is_file(),
                "{} exists and is not an OCI image layout; not overwriting it",
                dir.display()
            );
            std::fs::remove_dir_all(dir)?;
        }
    }
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))
}

fn read_blob(dir: &Path, d: &Descriptor) -> anyhow::Result<Vec<u8>> {
    let hex = d
        .digest
        .strip_prefix("sha256:")
        .with_context(|| format!("unsupported digest {}", d.digest))?;
    ensure!(
        hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
        "bad digest {}",
        d.digest
    );
    let path = dir.join("blobs/sha256").join(hex);
    let bytes = std::fs::read(&path).with_context(|| format!("read {}", path.display()))?;
    ensure!(
        bytes.len() as u64 == d.size && digest(&bytes) == d.digest,
        "blob {} does not match its descriptor",
        d.digest
    );
    Ok(bytes)
}

/// The manifest descriptor tagged `tag` in the layout's `index.json` (or the only one).
pub fn manifest_descriptor(dir: &Path, tag: Option<&str>) -> anyhow::Result<Descriptor> {
    let raw = std::fs::read(dir.join("index.json")).context("read index.json")?;
    let index: Index = serde_json::from_slice(&raw).context("parse index.json")?;
    let named = |d: &&Descriptor| {
        d.annotations
            .as_ref()
            .and_then(|a| a.get(REF_NAME_ANNOTATION))
            .map(String::as_str)
            == tag
    };
    match tag {
        Some(t) => index
            .manifests
            .iter()
            .find(named)
            .cloned()
            .with_context(|| format!("no manifest tagged {t:?} in index.json")),
        None if index.manifests.len() == 1 => Ok(index.manifests[0].clone()),
        None => bail!(
            "index.json lists {} manifests; name a tag",
            index.manifests.len()
        ),
    }
}

/// Reads the module back out of a layout the way Istio's compat branch does, verifying
/// every blob digest and the media types on the way: returns (manifest, plugin.wasm).
pub fn extract_plugin(dir: &Path, tag: Option<&str>) -> anyhow::Result<(Manifest, Vec<u8>)> {
    let desc = manifest_descriptor(dir, tag)?;
    ensure!(
        desc.media_type == MANIFEST_MEDIA_TYPE,
        "manifest media type {}",
        desc.media_type
    );
    let manifest: Manifest = serde_json::from_slice(&read_blob(dir, &desc)?)?;
    ensure!(
        manifest.layers.len() == 1,
        "compat image must have one layer, has {}",
        manifest.layers.len()
    );
    let layer = &manifest.layers[0];
    ensure!(
        layer.media_type == LAYER_MEDIA_TYPE,
        "layer media type {} (want {LAYER_MEDIA_TYPE})",
        layer.media_type
    );
    read_blob(dir, &manifest.config)?;
    let gz = read_blob(dir, layer)?;
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(gz.as_slice()));
    for entry in archive.entries()? {
        let mut entry = entry?;
        let path = entry.path()?.into_owned();
        if path.file_name().is_some_and(|n| n == PLUGIN_FILE) {
            let mut wasm = Vec::new();
            entry.read_to_end(&mut wasm)?;
            return Ok((manifest, wasm));
        }
    }
    bail!("{PLUGIN_FILE} not found in the layer")
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODULE: &[u8] = b"\0asm\x01\0\0\0";

    #[test]
    fn tar_entry_is_normalised() {
        let tar = layer_tar(MODULE).unwrap();
        assert_eq!(tar.len(), 512 + 512 + 1024); // header, one data block, end marker
        let mut a = tar::Archive::new(tar.as_slice());
        let e = a.entries().unwrap().next().unwrap().unwrap();
        let h = e.header();
        assert_eq!(h.path().unwrap().to_str(), Some(PLUGIN_FILE));
        assert_eq!(
            (
                h.mode().unwrap(),
                h.uid().unwrap(),
                h.gid().unwrap(),
                h.mtime().unwrap()
            ),
            (0o644, 0, 0, 0)
        );
        assert_eq!(h.username().unwrap(), Some(""));
    }

    #[test]
    fn gzip_header_has_no_time_or_name() {
        let gz = gzip(b"x").unwrap();
        // magic, CM=8, FLG=0 (no name), MTIME=0, XFL, OS=255
        assert_eq!(&gz[..8], &[0x1f, 0x8b, 8, 0, 0, 0, 0, 0]);
        assert_eq!(gz[9], 255);
    }

    #[test]
    fn layout_round_trips_and_is_reproducible() {
        let base = std::env::temp_dir().join(format!("tokenaware-oci-unit-{}", std::process::id()));
        let (a, b) = (base.join("a"), base.join("b"));
        let x = write_layout(MODULE, &a, "t1").unwrap();
        let y = write_layout(MODULE, &b, "t1").unwrap();
        assert_eq!(x.manifest_digest, y.manifest_digest);
        // Rebuilding into an existing layout replaces it.
        let z = write_layout(MODULE, &a, "t1").unwrap();
        assert_eq!(x.manifest_digest, z.manifest_digest);
        let (m, wasm) = extract_plugin(&a, Some("t1")).unwrap();
        assert_eq!(wasm, MODULE);
        assert_eq!(m.annotations.unwrap()[VARIANT_ANNOTATION], "compat");
        assert!(extract_plugin(&a, Some("other")).is_err());
        // A tampered blob is caught.
        let layer = a.join("blobs/sha256").join(&x.layer_digest[7..]);
        std::fs::write(&layer, b"junk").unwrap();
        assert!(extract_plugin(&a, None).is_err());
        // A directory that is not a layout is never wiped.
        let other = base.join("c");
        std::fs::create_dir_all(&other).unwrap();
        std::fs::write(other.join("keep"), b"x").unwrap();
        assert!(write_layout(MODULE, &other, "t1").is_err());
        assert!(other.join("keep").is_file());
        std::fs::remove_dir_all(&base).unwrap();
    }
}
