//! What kiln keeps of an image, whichever way it arrived (registry pull or tarball import):
//! its identity, its layers in order (blobs in the [`super::blobs::Blobs`] cache) and the
//! runtime part of its config (`Env`, `WorkingDir`, `User`, `Entrypoint`, `Cmd`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::OciError;

/// Media types kiln accepts for layers (the blob's magic bytes decide the decompressor).
pub const LAYER_MEDIA_TYPES: &[&str] = &[
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.diff.tar",
];

/// One layer: the blob's digest (compressed, as the manifest names it) and the uncompressed
/// tar's digest from the config (`rootfs.diff_ids`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layer {
    pub digest: String,
    pub diff_id: String,
    pub media_type: String,
    pub size: u64,
}

/// An image whose blobs are all in the cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Image {
    /// Where it came from: the full image name, or `import:<file name>`.
    pub source: String,
    /// Its identity: the manifest digest (registry, OCI layout) or the config digest (`docker
    /// save`). The template cache is keyed by it.
    pub digest: String,
    pub config_digest: String,
    pub layers: Vec<Layer>,
    pub config: RunConfig,
    /// Pulled with registry credentials: whoever later uses it without credentials of their
    /// own must first show that the registry lets them read it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub with_credentials: bool,
}

/// The part of the image config a sandbox uses.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunConfig {
    pub env: BTreeMap<String, String>,
    pub workdir: Option<String>,
    pub user: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
}

/// The image config JSON (OCI `application/vnd.oci.image.config.v1+json` and Docker's).
#[derive(Debug, Deserialize)]
struct ConfigFile {
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    os: String,
    #[serde(default)]
    config: Option<ConfigSection>,
    rootfs: RootFs,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ConfigSection {
    #[serde(default)]
    env: Option<Vec<String>>,
    #[serde(default)]
    working_dir: Option<String>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    entrypoint: Option<Vec<String>>,
    #[serde(default)]
    cmd: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
struct RootFs {
    #[serde(default)]
    diff_ids: Vec<String>,
}

/// A parsed config: what sandboxes use, and the layers' uncompressed digests.
#[derive(Debug, Clone)]
pub struct ParsedConfig {
    pub run: RunConfig,
    pub diff_ids: Vec<String>,
}

/// Parses an image config; refuses images for another OS or architecture.
pub fn parse_config(bytes: &[u8], image: &str) -> Result<ParsedConfig, OciError> {
    let c: ConfigFile = serde_json::from_slice(bytes)
        .map_err(|e| OciError::Invalid(format!("{image}: the image config is not valid: {e}")))?;
    if (!c.os.is_empty() && c.os != "linux")
        || (!c.architecture.is_empty() && c.architecture != "amd64")
    {
        return Err(OciError::Invalid(format!(
            "{image} is built for {}/{}; kiln runs linux/amd64 images",
            c.os, c.architecture
        )));
    }
    let s = c.config.unwrap_or_default();
    let mut env = BTreeMap::new();
    for kv in s.env.unwrap_or_default() {
        match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() => {
                env.insert(k.to_string(), v.to_string());
            }
            _ => {}
        }
    }
    let nonempty = |o: Option<String>| o.filter(|s| !s.trim().is_empty());
    Ok(ParsedConfig {
        run: RunConfig {
            env,
            workdir: nonempty(s.working_dir),
            user: nonempty(s.user),
            entrypoint: s.entrypoint.unwrap_or_default(),
            cmd: s.cmd.unwrap_or_default(),
        },
        diff_ids: c.rootfs.diff_ids,
    })
}

/// Pairs manifest layers with the config's diff_ids (they must match in number).
pub fn pair_layers(
    blobs: Vec<(String, String, u64)>,
    diff_ids: &[String],
    image: &str,
) -> Result<Vec<Layer>, OciError> {
    if blobs.len() != diff_ids.len() {
        return Err(OciError::Invalid(format!(
            "{image}: the manifest lists {} layers but the config {}",
            blobs.len(),
            diff_ids.len()
        )));
    }
    blobs
        .into_iter()
        .zip(diff_ids)
        .map(|((digest, media_type, size), diff_id)| {
            if !media_type.is_empty() && !LAYER_MEDIA_TYPES.contains(&media_type.as_str()) {
                return Err(OciError::Invalid(format!(
                    "{image}: layer {digest} has media type {media_type}, which kiln cannot unpack (it takes tar layers, plain, gzip or zstd)"
                )));
            }
            super::blobs::digest_hex(&digest)?;
            super::blobs::digest_hex(diff_id)?;
            Ok(Layer {
                digest,
                diff_id: diff_id.clone(),
                media_type,
                size,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_fields_are_kept() {
        let j = br#"{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/usr/bin:/bin","A=b=c"],
            "WorkingDir":"/app","User":"app","Entrypoint":["/bin/sh"],"Cmd":["-c","x"]},
            "rootfs":{"type":"layers","diff_ids":["sha256:aa"]}}"#;
        let c = parse_config(j, "img").unwrap();
        assert_eq!(c.run.env["A"], "b=c");
        assert_eq!(c.run.env["PATH"], "/usr/bin:/bin");
        assert_eq!(c.run.workdir.as_deref(), Some("/app"));
        assert_eq!(c.run.user.as_deref(), Some("app"));
        assert_eq!(c.run.cmd, vec!["-c", "x"]);
        assert_eq!(c.diff_ids, vec!["sha256:aa"]);
        let arm = br#"{"architecture":"arm64","os":"linux","rootfs":{"diff_ids":[]}}"#;
        let e = parse_config(arm, "img").unwrap_err().to_string();
        assert!(e.contains("linux/arm64"), "{e}");
        let empty = br#"{"config":{"User":"","WorkingDir":""},"rootfs":{"diff_ids":[]}}"#;
        let c = parse_config(empty, "img").unwrap();
        assert_eq!((c.run.user, c.run.workdir), (None, None));
    }

    #[test]
    fn layers_pair_with_diff_ids() {
        let d = |c: char| format!("sha256:{}", c.to_string().repeat(64));
        let l = pair_layers(
            vec![(d('a'), LAYER_MEDIA_TYPES[1].into(), 3)],
            &[d('b')],
            "img",
        )
        .unwrap();
        assert_eq!(l[0].diff_id, d('b'));
        assert!(pair_layers(vec![], &[d('b')], "img").is_err());
        let e = pair_layers(
            vec![(
                d('a'),
                "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip".into(),
                3,
            )],
            &[d('b')],
            "img",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("cannot unpack"), "{e}");
    }
}
