//! File tools (read, write, list, upload and download in base64) and sandbox files as MCP
//! resources: `kiln://sandbox/{sandbox_id}/file/{+path}` (a directory reads as its listing).

use base64::Engine;
use kiln_proto::filesystem::{self as fspb, EntryInfo, FileType};
use rmcp::model::{CallToolResult, ContentBlock, ResourceContents};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};

use super::args::{abs_path, ToolError, ToolResult};
use super::ctx::Ctx;
use super::lifecycle::done;
use crate::client::SandboxRef;

/// Largest file the read tools return (upload/download move whole files up to this too).
const MAX_FILE: usize = 16 << 20;
/// Deepest listing.
const MAX_DEPTH: u32 = 5;
/// The scheme and prefix of file resources.
pub const URI_PREFIX: &str = "kiln://sandbox/";
/// The resource template of sandbox files.
pub const URI_TEMPLATE: &str = "kiln://sandbox/{sandbox_id}/file/{+path}";

fn b64() -> base64::engine::general_purpose::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

/// The resource URI of `path` in sandbox `id`.
pub fn uri(id: &str, path: &str) -> String {
    format!(
        "{URI_PREFIX}{}/file{}",
        kiln_envd::urlencode(id),
        kiln_envd::urlencode(path)
    )
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let h = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(h, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// (sandbox id, absolute path) of a file resource URI.
pub fn parse_uri(u: &str) -> Option<(String, String)> {
    let rest = u.strip_prefix(URI_PREFIX)?;
    let (id, path) = rest.split_once("/file")?;
    let id = percent_decode(id)?;
    let path = percent_decode(path)?;
    let path = if path.is_empty() { "/".into() } else { path };
    (!id.is_empty() && path.starts_with('/') && !path.contains('\0')).then_some((id, path))
}

async fn read_bytes(ctx: &Ctx, sbx: &SandboxRef, path: &str) -> ToolResult<Vec<u8>> {
    let data = ctx
        .client
        .download(sbx, path, None)
        .await
        .map_err(|e| ToolError::failed(format!("reading {path}: {e}")))?;
    if data.len() > MAX_FILE {
        return Err(ToolError::failed(format!(
            "{path} is {} bytes, more than the {MAX_FILE} this tool returns",
            data.len()
        )));
    }
    Ok(data)
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PathArgs {
    /// The sandbox's id.
    sandbox_id: String,
    /// Absolute path in the sandbox.
    path: String,
}

pub async fn read(ctx: &Ctx, a: PathArgs) -> ToolResult<CallToolResult> {
    abs_path("path", &a.path)?;
    let sbx = ctx.sandbox(&a.sandbox_id).await?;
    let data = read_bytes(ctx, &sbx, &a.path).await?;
    let text = String::from_utf8(data).map_err(|_| {
        ToolError::failed(format!(
            "{} is not UTF-8 text: use download_file for its bytes",
            a.path
        ))
    })?;
    Ok(CallToolResult::success(vec![ContentBlock::text(text)]))
}

pub async fn download(ctx: &Ctx, a: PathArgs) -> ToolResult<CallToolResult> {
    abs_path("path", &a.path)?;
    let sbx = ctx.sandbox(&a.sandbox_id).await?;
    let data = read_bytes(ctx, &sbx, &a.path).await?;
    let encoded = b64().encode(&data);
    let mut r = CallToolResult::success(vec![ContentBlock::resource(
        ResourceContents::blob(encoded.clone(), uri(&a.sandbox_id, &a.path))
            .with_mime_type("application/octet-stream"),
    )]);
    r.structured_content = Some(json!({
        "path": a.path, "size": data.len(), "content_base64": encoded,
    }));
    Ok(r)
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteArgs {
    /// The sandbox's id.
    sandbox_id: String,
    /// Absolute path in the sandbox (parent directories are created).
    path: String,
    /// The file's new content (UTF-8 text).
    content: String,
}

pub async fn write(ctx: &Ctx, a: WriteArgs) -> ToolResult<CallToolResult> {
    abs_path("path", &a.path)?;
    put(ctx, &a.sandbox_id, &a.path, a.content.into_bytes()).await
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UploadArgs {
    /// The sandbox's id.
    sandbox_id: String,
    /// Absolute path in the sandbox (parent directories are created).
    path: String,
    /// The file's bytes, base64 (standard alphabet, padded).
    content_base64: String,
}

pub async fn upload(ctx: &Ctx, a: UploadArgs) -> ToolResult<CallToolResult> {
    abs_path("path", &a.path)?;
    let data = b64()
        .decode(a.content_base64.trim())
        .map_err(|e| ToolError::arg("content_base64", format!("is not base64: {e}")))?;
    put(ctx, &a.sandbox_id, &a.path, data).await
}

async fn put(ctx: &Ctx, id: &str, path: &str, data: Vec<u8>) -> ToolResult<CallToolResult> {
    if data.len() > MAX_FILE {
        return Err(ToolError::failed(format!(
            "{} bytes is more than the {MAX_FILE} this tool writes",
            data.len()
        )));
    }
    let sbx = ctx.sandbox(id).await?;
    let n = data.len();
    ctx.client
        .upload(&sbx, path, data, None)
        .await
        .map_err(|e| ToolError::failed(format!("writing {path}: {e}")))?;
    Ok(done(
        format!("wrote {n} bytes to {path}"),
        json!({"path": path, "size": n}),
    ))
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListArgs {
    /// The sandbox's id.
    sandbox_id: String,
    /// Absolute path of a directory in the sandbox.
    path: String,
    /// How deep to go (1: the directory's own entries; at most 5).
    #[serde(default)]
    depth: Option<u32>,
}

fn kind(e: &EntryInfo) -> &'static str {
    match FileType::try_from(e.r#type) {
        Ok(FileType::Directory) => "dir",
        Ok(FileType::Symlink) => "symlink",
        Ok(FileType::File) => "file",
        _ => "other",
    }
}

fn entry_json(e: &EntryInfo) -> Value {
    json!({"name": e.name, "path": e.path, "type": kind(e), "size": e.size,
           "permissions": e.permissions, "owner": e.owner})
}

async fn list_dir(ctx: &Ctx, sbx: &SandboxRef, path: &str, depth: u32) -> ToolResult<Vec<Value>> {
    let envd = ctx.client.envd(sbx).await?;
    let req = fspb::ListDirRequest {
        path: path.to_string(),
        depth,
    };
    let resp: fspb::ListDirResponse = envd
        .unary("/filesystem.Filesystem/ListDir", &req, None)
        .await
        .map_err(|e| ToolError::failed(format!("listing {path}: {e}")))?;
    Ok(resp.entries.iter().map(entry_json).collect())
}

pub async fn list(ctx: &Ctx, a: ListArgs) -> ToolResult<CallToolResult> {
    abs_path("path", &a.path)?;
    let depth = a.depth.unwrap_or(1);
    if !(1..=MAX_DEPTH).contains(&depth) {
        return Err(ToolError::arg(
            "depth",
            format!("must be 1-{MAX_DEPTH}, got {depth}"),
        ));
    }
    let sbx = ctx.sandbox(&a.sandbox_id).await?;
    let entries = list_dir(ctx, &sbx, &a.path, depth).await?;
    let text = entries
        .iter()
        .map(|e| {
            let slash = if e["type"] == "dir" { "/" } else { "" };
            format!("{}{slash}", e["path"].as_str().unwrap_or(""))
        })
        .collect::<Vec<_>>()
        .join("\n");
    Ok(done(text, json!({"path": a.path, "entries": entries})))
}

/// The contents of a file resource: UTF-8 text as text, other bytes as a base64 blob, a
/// directory as its JSON listing.
pub async fn read_resource(ctx: &Ctx, u: &str) -> ToolResult<ResourceContents> {
    let (id, path) = parse_uri(u).ok_or_else(|| {
        ToolError::arg(
            "uri",
            format!("{u:?} is not a sandbox file URI ({URI_TEMPLATE})"),
        )
    })?;
    let sbx = ctx.sandbox(&id).await?;
    let envd = ctx.client.envd(&sbx).await?;
    let stat: fspb::StatResponse = envd
        .unary(
            "/filesystem.Filesystem/Stat",
            &fspb::StatRequest { path: path.clone() },
            None,
        )
        .await
        .map_err(|e| ToolError::failed(format!("{path}: {e}")))?;
    if stat.entry.as_ref().map(kind) == Some("dir") {
        let entries = list_dir(ctx, &sbx, &path, 1).await?;
        let listing = json!({ "path": path, "entries": entries }).to_string();
        return Ok(ResourceContents::text(listing, u).with_mime_type("application/json"));
    }
    let data = read_bytes(ctx, &sbx, &path).await?;
    Ok(match String::from_utf8(data) {
        Ok(text) => ResourceContents::text(text, u).with_mime_type("text/plain"),
        Err(e) => ResourceContents::blob(b64().encode(e.into_bytes()), u)
            .with_mime_type("application/octet-stream"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_round_trip() {
        let u = uri("abc", "/home/user/a b.txt");
        assert_eq!(u, "kiln://sandbox/abc/file/home/user/a%20b.txt");
        assert_eq!(
            parse_uri(&u),
            Some(("abc".into(), "/home/user/a b.txt".into()))
        );
        assert_eq!(
            parse_uri("kiln://sandbox/abc/file"),
            Some(("abc".into(), "/".into()))
        );
        assert_eq!(parse_uri("kiln://sandbox//file/x"), None);
        assert_eq!(parse_uri("file:///etc/passwd"), None);
        assert_eq!(parse_uri("kiln://sandbox/abc/file/%zz"), None);
    }
}
