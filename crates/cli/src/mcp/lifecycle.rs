//! Sandbox lifecycle tools: create (template, timeout, network policy), list, kill, pause,
//! resume and fork, each one call to kiln's REST API.

use std::collections::BTreeMap;

use reqwest::Method;
use rmcp::model::{CallToolResult, ContentBlock};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};

use super::args::{non_empty, ToolError, ToolResult};
use super::ctx::Ctx;

/// Longest sandbox timeout a tool accepts (the server may allow less: its team quota).
const MAX_TIMEOUT_SECS: u64 = 24 * 3600;
/// Most children one fork makes.
const MAX_FORK: u32 = 16;

fn enc(id: &str) -> String {
    kiln_envd::urlencode(id)
}

/// A result with a one-line text for the model and the structured value.
pub fn done(text: impl Into<String>, structured: Value) -> CallToolResult {
    let mut r = CallToolResult::success(vec![ContentBlock::text(text.into())]);
    r.structured_content = Some(structured);
    r
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateArgs {
    /// Template to start from: `base`, `code-interpreter-v1`, `desktop`, `browser`, or a
    /// snapshot id. Default `base`.
    #[serde(default)]
    template: Option<String>,
    /// Seconds until kiln kills the sandbox (default: the server's, 300).
    #[serde(default)]
    timeout_secs: Option<u64>,
    /// Metadata to tag the sandbox with.
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    /// Environment variables of every process in the sandbox.
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    /// Allow traffic to the internet (default true).
    #[serde(default)]
    allow_internet: Option<bool>,
    /// CIDRs or domain names (`*.example.com`) the sandbox may reach even when other traffic
    /// is denied.
    #[serde(default)]
    allow_out: Option<Vec<String>>,
    /// CIDRs or domain names the sandbox may not reach (`0.0.0.0/0`: everything not allowed).
    #[serde(default)]
    deny_out: Option<Vec<String>>,
    /// Screen size `[width, height]` of a `desktop` sandbox, whose display is started with
    /// it (default `[1024, 768]`).
    #[serde(default)]
    resolution: Option<[u32; 2]>,
}

pub async fn create(ctx: &Ctx, a: CreateArgs) -> ToolResult<CallToolResult> {
    let template = a.template.unwrap_or_else(|| "base".into());
    non_empty("template", &template)?;
    let desktop = template == "desktop";
    let [width, height] = a.resolution.unwrap_or([1024, 768]);
    if a.resolution.is_some() && !desktop {
        return Err(ToolError::arg(
            "resolution",
            "applies only to the desktop template",
        ));
    }
    if !(320..=7680).contains(&width) || !(200..=4320).contains(&height) {
        return Err(ToolError::arg(
            "resolution",
            format!("{width}x{height} is outside 320x200 to 7680x4320"),
        ));
    }
    let mut body = json!({
        "templateID": template,
        "metadata": a.metadata.unwrap_or_default(),
        "envVars": a.env_vars.unwrap_or_default(),
    });
    if let Some(t) = a.timeout_secs {
        super::args::in_range("timeout_secs", t, MAX_TIMEOUT_SECS)?;
        body["timeout"] = json!(t);
    }
    if let Some(allow) = a.allow_internet {
        body["allow_internet_access"] = json!(allow);
    }
    let mut network = serde_json::Map::new();
    for (name, list, key) in [
        ("allow_out", a.allow_out, "allowOut"),
        ("deny_out", a.deny_out, "denyOut"),
    ] {
        if let Some(list) = list {
            if let Some(bad) = list.iter().find(|e| e.trim().is_empty()) {
                return Err(ToolError::arg(name, format!("entry {bad:?} is empty")));
            }
            network.insert(key.into(), json!(list));
        }
    }
    if !network.is_empty() {
        body["network"] = Value::Object(network);
    }
    ctx.progress(format!("creating a {template} sandbox")).await;
    let s = ctx.client.create_from(body).await.map_err(|e| match e {
        // The server's own message names the offending option (a CIDR, the template …).
        crate::client::ClientError::Api {
            status: 400,
            message,
        } => ToolError::failed(format!("kiln refused the sandbox: {message}")),
        other => ToolError::from(other),
    })?;
    if desktop {
        if let Err(e) = super::desktop::start_display(ctx, &s, width, height).await {
            let _ = ctx.client.kill(&s.id).await;
            return Err(e);
        }
    }
    Ok(done(
        format!("created sandbox {} from template {template}", s.id),
        json!({"sandbox_id": s.id, "template": template}),
    ))
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListArgs {
    /// Only sandboxes in this state: `running` or `paused` (default: both).
    #[serde(default)]
    state: Option<String>,
}

pub async fn list(ctx: &Ctx, a: ListArgs) -> ToolResult<CallToolResult> {
    let state = match a.state.as_deref() {
        None => "running,paused",
        Some(s @ ("running" | "paused")) => s,
        Some(other) => {
            return Err(ToolError::arg(
                "state",
                format!("{other:?}: use running or paused"),
            ))
        }
    };
    let v = ctx
        .client
        .get_json(&format!("/v2/sandboxes?state={state}&limit=1000"))
        .await?;
    let items: Vec<Value> = v
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| {
            json!({
                "sandbox_id": s["sandboxID"], "template": s["templateID"], "state": s["state"],
                "started_at": s["startedAt"], "end_at": s["endAt"], "metadata": s["metadata"],
            })
        })
        .collect();
    let lines: Vec<String> = items
        .iter()
        .map(|s| {
            format!(
                "{} {} {}",
                s["sandbox_id"].as_str().unwrap_or(""),
                s["template"].as_str().unwrap_or(""),
                s["state"].as_str().unwrap_or("")
            )
        })
        .collect();
    let text = if lines.is_empty() {
        "no sandboxes".to_string()
    } else {
        lines.join("\n")
    };
    Ok(done(text, json!({ "sandboxes": items })))
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct IdArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
}

pub async fn kill(ctx: &Ctx, a: IdArgs) -> ToolResult<CallToolResult> {
    non_empty("sandbox_id", &a.sandbox_id)?;
    ctx.client.kill(&a.sandbox_id).await?;
    Ok(done(
        format!("killed sandbox {}", a.sandbox_id),
        json!({"sandbox_id": a.sandbox_id, "killed": true}),
    ))
}

pub async fn pause(ctx: &Ctx, a: IdArgs) -> ToolResult<CallToolResult> {
    non_empty("sandbox_id", &a.sandbox_id)?;
    ctx.progress(format!("pausing {}", a.sandbox_id)).await;
    let path = format!("/sandboxes/{}/pause", enc(&a.sandbox_id));
    ctx.client.call(Method::POST, &path, None).await?;
    Ok(done(
        format!("paused sandbox {}", a.sandbox_id),
        json!({"sandbox_id": a.sandbox_id, "state": "paused"}),
    ))
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ResumeArgs {
    /// The paused sandbox's id.
    sandbox_id: String,
    /// Seconds until kiln kills it once resumed (default: the server's).
    #[serde(default)]
    timeout_secs: Option<u64>,
}

pub async fn resume(ctx: &Ctx, a: ResumeArgs) -> ToolResult<CallToolResult> {
    non_empty("sandbox_id", &a.sandbox_id)?;
    let mut body = json!({});
    if let Some(t) = a.timeout_secs {
        super::args::in_range("timeout_secs", t, MAX_TIMEOUT_SECS)?;
        body["timeout"] = json!(t);
    }
    ctx.progress(format!("resuming {}", a.sandbox_id)).await;
    // `connect` resumes a paused sandbox and is a no-op for a running one.
    let path = format!("/sandboxes/{}/connect", enc(&a.sandbox_id));
    ctx.client.call(Method::POST, &path, Some(body)).await?;
    Ok(done(
        format!("sandbox {} is running", a.sandbox_id),
        json!({"sandbox_id": a.sandbox_id, "state": "running"}),
    ))
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkArgs {
    /// The sandbox to fork (it keeps running).
    sandbox_id: String,
    /// How many copies (default 1).
    #[serde(default)]
    count: Option<u32>,
    /// Seconds until kiln kills each copy (default: the server's).
    #[serde(default)]
    timeout_secs: Option<u64>,
}

pub async fn fork(ctx: &Ctx, a: ForkArgs) -> ToolResult<CallToolResult> {
    non_empty("sandbox_id", &a.sandbox_id)?;
    let count = a.count.unwrap_or(1);
    if !(1..=MAX_FORK).contains(&count) {
        return Err(ToolError::arg(
            "count",
            format!("must be 1-{MAX_FORK}, got {count}"),
        ));
    }
    let mut body = json!({ "count": count });
    if let Some(t) = a.timeout_secs {
        super::args::in_range("timeout_secs", t, MAX_TIMEOUT_SECS)?;
        body["timeout"] = json!(t);
    }
    ctx.progress(format!("forking {} ×{count}", a.sandbox_id))
        .await;
    let path = format!("/sandboxes/{}/fork", enc(&a.sandbox_id));
    let v = ctx.client.call(Method::POST, &path, Some(body)).await?;
    let mut ids = Vec::new();
    let mut errors = Vec::new();
    for child in v.as_array().into_iter().flatten() {
        match child["sandbox"]["sandboxID"].as_str() {
            Some(id) => ids.push(id.to_string()),
            None => errors.push(child["error"]["message"].as_str().unwrap_or("").to_string()),
        }
    }
    if ids.is_empty() {
        return Err(ToolError::failed(format!(
            "no fork of {} started: {}",
            a.sandbox_id,
            errors.join("; ")
        )));
    }
    Ok(done(
        format!("forked {} into {}", a.sandbox_id, ids.join(", ")),
        json!({"sandbox_id": a.sandbox_id, "children": ids, "errors": errors}),
    ))
}
