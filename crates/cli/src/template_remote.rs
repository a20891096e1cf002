//! `kiln template build -f Dockerfile` and the built templates' part of `kiln template gc`: a
//! client of a running server's Template API, the same routes the `e2b` SDK uses (request the
//! build, upload each COPY's files by hash, start it with the steps, follow its status and
//! log), so the build runs in the server's build sandboxes with its step cache.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use kiln_server::tplbuild::files;
use reqwest::Method;
use serde_json::{json, Value};

use crate::client::Client;
use crate::dockerfile::{self, Step};

/// What `kiln template build -f` was asked.
pub struct DockerfileBuild {
    pub file: PathBuf,
    pub context: Option<PathBuf>,
    pub name: Option<String>,
    pub tags: Vec<String>,
    pub ready_cmd: Option<String>,
    pub force: bool,
}

fn rt() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// A template name from a directory's name: lowercase letters, digits and `-`.
fn name_of(dir: &Path) -> String {
    let raw = dir
        .canonicalize()
        .ok()
        .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_default()
        .to_lowercase();
    let n: String = raw
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let n = n.trim_matches('-').to_string();
    if n.is_empty() {
        "dockerfile".into()
    } else {
        n
    }
}

/// Uploads the files of a COPY of `src` to `dest` unless the server has them; their hash.
async fn upload(
    c: &Client,
    template_id: &str,
    context: &Path,
    ignore: &[String],
    src: &str,
    dest: &str,
) -> anyhow::Result<String> {
    let tmp = tempfile::NamedTempFile::new()?;
    files::write_archive(context, src, ignore, std::io::BufWriter::new(tmp.reopen()?))?;
    let hash = files::files_hash(tmp.path(), src, dest, u64::MAX)
        .with_context(|| format!("the files of COPY {src}"))?;
    let link = c
        .call(
            Method::GET,
            &format!("/templates/{template_id}/files/{hash}"),
            None,
        )
        .await?;
    if link["present"].as_bool() == Some(true) {
        return Ok(hash);
    }
    let url = link["url"]
        .as_str()
        .context("the server gave no upload URL")?;
    let body = tokio::fs::read(tmp.path()).await?;
    let resp = reqwest::Client::new()
        .put(url)
        .body(body)
        .send()
        .await
        .with_context(|| format!("uploading the files of COPY {src}"))?;
    if !resp.status().is_success() {
        let status = resp.status();
        bail!(
            "uploading the files of COPY {src}: {status}: {}",
            resp.text().await.unwrap_or_default()
        );
    }
    Ok(hash)
}

fn step_json(s: &Step, hash: Option<String>) -> Value {
    let (kind, args) = match s {
        Step::Run(c) => ("RUN", vec![c.clone()]),
        Step::Copy {
            src,
            dest,
            owner,
            mode,
        } => (
            "COPY",
            vec![
                src.clone(),
                dest.clone(),
                owner.clone().unwrap_or_default(),
                mode.clone().unwrap_or_default(),
            ],
        ),
        Step::Env(kv) => (
            "ENV",
            kv.iter()
                .flat_map(|(k, v)| [k.clone(), v.clone()])
                .collect(),
        ),
        Step::Workdir(w) => ("WORKDIR", vec![w.clone()]),
        Step::User(u) => ("USER", vec![u.clone()]),
    };
    let mut v = json!({ "type": kind, "args": args, "force": false });
    if let Some(h) = hash {
        v["filesHash"] = json!(h);
    }
    v
}

/// Builds the Dockerfile through the server's Template API; 0 when the build is ready.
pub fn build(c: Client, a: DockerfileBuild) -> anyhow::Result<i32> {
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading {}", a.file.display()))?;
    let conv = dockerfile::convert(&text)?;
    let context = a.context.clone().unwrap_or_else(|| {
        a.file
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."))
    });
    let ignore: Vec<String> = std::fs::read_to_string(context.join(".dockerignore"))
        .map(|t| t.lines().map(str::to_string).collect())
        .unwrap_or_default();
    let name = a.name.clone().unwrap_or_else(|| name_of(&context));
    rt()?.block_on(async move {
        let req = c
            .call(
                Method::POST,
                "/v3/templates",
                Some(json!({ "name": name, "tags": a.tags })),
            )
            .await?;
        let (tid, bid) = match (req["templateID"].as_str(), req["buildID"].as_str()) {
            (Some(t), Some(b)) => (t.to_string(), b.to_string()),
            _ => bail!("unexpected answer to the build request: {req}"),
        };
        let mut steps = Vec::new();
        for s in &conv.steps {
            let hash = match s {
                Step::Copy { src, dest, .. } => {
                    Some(upload(&c, &tid, &context, &ignore, src, dest).await?)
                }
                _ => None,
            };
            steps.push(step_json(s, hash));
        }
        let mut start = json!({ "fromImage": conv.from_image, "force": a.force, "steps": steps });
        if let Some(cmd) = &conv.start_cmd {
            start["startCmd"] = json!(cmd);
            start["readyCmd"] = json!(a.ready_cmd.as_deref().unwrap_or("sleep 20"));
        }
        c.call(
            Method::POST,
            &format!("/v2/templates/{tid}/builds/{bid}"),
            Some(start),
        )
        .await?;
        let mut offset = 0;
        loop {
            let st = c
                .get_json(&format!(
                    "/templates/{tid}/builds/{bid}/status?logsOffset={offset}"
                ))
                .await?;
            let entries = st["logEntries"].as_array().cloned().unwrap_or_default();
            offset += entries.len();
            for e in &entries {
                println!("{}", e["message"].as_str().unwrap_or_default());
            }
            match st["status"].as_str() {
                Some("ready") => {
                    println!("template {name} ({tid}) built: build {bid}");
                    return Ok(0);
                }
                Some("error") => {
                    eprintln!(
                        "kiln: the build failed: {}",
                        st["reason"]["message"]
                            .as_str()
                            .unwrap_or("no reason given")
                    );
                    return Ok(1);
                }
                _ if entries.is_empty() => tokio::time::sleep(Duration::from_millis(300)).await,
                _ => {}
            }
        }
    })
}

/// Collects the templates the API key's team built on the server (`POST /template-builds/gc`).
pub fn collect(c: Client) -> anyhow::Result<()> {
    let done = rt()?.block_on(c.call(Method::POST, "/template-builds/gc", None))?;
    let n = |k: &str| done[k].as_array().map_or(0, Vec::len);
    println!(
        "built templates: {} versions, {} cache entries, {} snapshots removed",
        n("builds"),
        done["cacheEntries"].as_u64().unwrap_or(0),
        n("snapshots")
    );
    Ok(())
}
