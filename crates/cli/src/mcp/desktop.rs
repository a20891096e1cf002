//! Desktop tools (screenshot, click, type, key, scroll) for sandboxes of the `desktop`
//! template, through its computer-use action API on port 49990 (`kiln-agent computer`, see
//! docs/rich-sandboxes.md). Screenshots come back as MCP image content.

use base64::Engine;
use reqwest::Method;
use rmcp::model::{CallToolResult, ContentBlock};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};

use super::args::{non_empty, ToolError, ToolResult};
use super::ctx::Ctx;
use crate::client::{ExecOptions, SandboxRef};
use kiln_envd::ProcessEvent;

/// The action API's port in the sandbox.
const PORT: u16 = 49990;
/// How long a new desktop's X server may take to answer.
const DISPLAY_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// The X display the template's services use.
const DISPLAY: &str = ":0";

/// Starts `cmd` (bash -l -c) in the sandbox and leaves it running.
async fn start_background(ctx: &Ctx, sbx: &SandboxRef, cmd: &str) -> ToolResult<()> {
    let envd = ctx.client.envd(sbx).await?;
    let envs = [("DISPLAY".to_string(), DISPLAY.to_string())].into();
    let req = kiln_envd::bash_request(cmd, envs, None, None);
    let mut events = envd.start(&req, None).await?;
    while let Some(ev) = events.next_event().await? {
        match ev {
            ProcessEvent::Started { .. } => return Ok(()),
            ProcessEvent::Exited { code, .. } => {
                return Err(ToolError::failed(format!(
                    "`{cmd}` exited at once ({code})"
                )))
            }
            _ => {}
        }
    }
    Err(ToolError::failed(format!("`{cmd}` did not start")))
}

/// Starts the desktop of a new `desktop` sandbox as `e2b-desktop` does: Xvfb at `width` x
/// `height`, then the template's session (window manager and background).
pub async fn start_display(ctx: &Ctx, sbx: &SandboxRef, width: u32, height: u32) -> ToolResult<()> {
    ctx.progress(format!("starting the display ({width}x{height})"))
        .await;
    let xvfb = format!(
        "Xvfb {DISPLAY} -ac -screen 0 {width}x{height}x24 -retro -dpi 96 -nolisten tcp -nolisten unix"
    );
    start_background(ctx, sbx, &xvfb).await?;
    let probe = format!("xdpyinfo -display {DISPLAY} >/dev/null 2>&1");
    let deadline = tokio::time::Instant::now() + DISPLAY_WAIT;
    loop {
        let code = ctx
            .client
            .exec(sbx, &probe, &ExecOptions::default(), |_| {})
            .await?;
        if code == 0 {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            return Err(ToolError::failed(format!(
                "the display of sandbox {} did not come up within {DISPLAY_WAIT:?}",
                sbx.id
            )));
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    start_background(ctx, sbx, "startxfce4").await
}

fn unreachable(id: &str, e: impl std::fmt::Display) -> ToolError {
    ToolError::failed(format!(
        "the desktop of sandbox {id} did not answer ({e}); is it a desktop sandbox?"
    ))
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ScreenshotArgs {
    /// A sandbox of the `desktop` template.
    sandbox_id: String,
    /// `png` (default) or `jpeg`.
    #[serde(default)]
    format: Option<String>,
}

pub async fn screenshot(ctx: &Ctx, a: ScreenshotArgs) -> ToolResult<CallToolResult> {
    non_empty("sandbox_id", &a.sandbox_id)?;
    let (query, mime) = match a.format.as_deref() {
        None | Some("png") => ("", "image/png"),
        Some("jpeg") => ("?format=jpeg", "image/jpeg"),
        Some(other) => {
            return Err(ToolError::arg(
                "format",
                format!("{other:?}: use png or jpeg"),
            ))
        }
    };
    let sbx = ctx.sandbox(&a.sandbox_id).await?;
    let path = format!("/screenshot{query}");
    let resp = ctx
        .send_to_port(|| ctx.client.port_request(Method::GET, &sbx.id, PORT, &path))
        .await
        .map_err(|e| unreachable(&sbx.id, e))?;
    let status = resp.status();
    let bytes = resp.bytes().await.map_err(|e| unreachable(&sbx.id, e))?;
    if !status.is_success() {
        let body = String::from_utf8_lossy(&bytes);
        return Err(unreachable(&sbx.id, format!("{status}: {}", body.trim())));
    }
    let data = base64::engine::general_purpose::STANDARD.encode(&bytes);
    let mut r = CallToolResult::success(vec![ContentBlock::image(data, mime)]);
    r.structured_content = Some(json!({"format": mime, "bytes": bytes.len()}));
    Ok(r)
}

/// Runs `actions` (Anthropic's vocabulary) and answers with what they did, plus a screenshot
/// when asked.
async fn act(ctx: &Ctx, id: &str, actions: Value, shot: bool) -> ToolResult<CallToolResult> {
    let sbx = ctx.sandbox(id).await?;
    let body = json!({ "actions": actions, "screenshot": shot });
    let resp = ctx
        .send_to_port(|| {
            ctx.client
                .port_request(Method::POST, &sbx.id, PORT, "/actions")
                .json(&body)
        })
        .await
        .map_err(|e| unreachable(&sbx.id, e))?;
    let status = resp.status();
    let v: Value = resp.json().await.map_err(|e| unreachable(&sbx.id, e))?;
    if !status.is_success() {
        let msg = v["error"].as_str().unwrap_or("the action failed");
        return Err(ToolError::failed(format!("desktop action: {msg}")));
    }
    let cursor = &v["cursor"];
    let mut content = vec![ContentBlock::text(format!(
        "done; cursor at ({}, {})",
        cursor["x"], cursor["y"]
    ))];
    if let Some(data) = v["screenshot"]["data"].as_str() {
        let mime = match v["screenshot"]["format"].as_str() {
            Some("jpeg") => "image/jpeg",
            _ => "image/png",
        };
        content.push(ContentBlock::image(data, mime));
    }
    let mut r = CallToolResult::success(content);
    r.structured_content = Some(json!({
        "results": v["results"], "cursor": v["cursor"], "screen": v["screen"],
    }));
    Ok(r)
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ClickArgs {
    /// A sandbox of the `desktop` template.
    sandbox_id: String,
    /// Horizontal position in screen pixels.
    x: u32,
    /// Vertical position in screen pixels.
    y: u32,
    /// `left` (default), `right` or `middle`.
    #[serde(default)]
    button: Option<String>,
    /// Clicks (2: double click; default 1).
    #[serde(default)]
    count: Option<u32>,
    /// Answer with a screenshot taken after the click.
    #[serde(default)]
    screenshot: bool,
}

pub async fn click(ctx: &Ctx, a: ClickArgs) -> ToolResult<CallToolResult> {
    let button = a.button.unwrap_or_else(|| "left".into());
    if !matches!(button.as_str(), "left" | "right" | "middle") {
        return Err(ToolError::arg(
            "button",
            format!("{button:?}: use left, right or middle"),
        ));
    }
    let count = a.count.unwrap_or(1);
    if !(1..=3).contains(&count) {
        return Err(ToolError::arg("count", format!("must be 1-3, got {count}")));
    }
    let actions = json!([{ "action": "click", "coordinate": [a.x, a.y], "button": button,
                           "count": count }]);
    act(ctx, &a.sandbox_id, actions, a.screenshot).await
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TypeArgs {
    /// A sandbox of the `desktop` template.
    sandbox_id: String,
    /// Text to type into the focused window.
    text: String,
    /// Answer with a screenshot taken after typing.
    #[serde(default)]
    screenshot: bool,
}

pub async fn type_text(ctx: &Ctx, a: TypeArgs) -> ToolResult<CallToolResult> {
    if a.text.is_empty() {
        return Err(ToolError::arg("text", "must not be empty"));
    }
    let actions = json!([{ "action": "type", "text": a.text }]);
    act(ctx, &a.sandbox_id, actions, a.screenshot).await
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KeyArgs {
    /// A sandbox of the `desktop` template.
    sandbox_id: String,
    /// Key combination, e.g. `Return`, `ctrl+s`, `alt+Tab`.
    keys: String,
    /// Answer with a screenshot taken after the key press.
    #[serde(default)]
    screenshot: bool,
}

pub async fn key(ctx: &Ctx, a: KeyArgs) -> ToolResult<CallToolResult> {
    non_empty("keys", &a.keys)?;
    let actions = json!([{ "action": "key", "text": a.keys }]);
    act(ctx, &a.sandbox_id, actions, a.screenshot).await
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ScrollArgs {
    /// A sandbox of the `desktop` template.
    sandbox_id: String,
    /// `up`, `down`, `left` or `right`.
    direction: String,
    /// Wheel clicks (default 3, at most 50).
    #[serde(default)]
    amount: Option<u32>,
    /// Where to scroll (default: where the pointer is); give `x` and `y` together.
    #[serde(default)]
    x: Option<u32>,
    #[serde(default)]
    y: Option<u32>,
    /// Answer with a screenshot taken after scrolling.
    #[serde(default)]
    screenshot: bool,
}

pub async fn scroll(ctx: &Ctx, a: ScrollArgs) -> ToolResult<CallToolResult> {
    if !matches!(a.direction.as_str(), "up" | "down" | "left" | "right") {
        return Err(ToolError::arg(
            "direction",
            format!("{:?}: use up, down, left or right", a.direction),
        ));
    }
    let amount = a.amount.unwrap_or(3);
    if !(1..=50).contains(&amount) {
        return Err(ToolError::arg(
            "amount",
            format!("must be 1-50, got {amount}"),
        ));
    }
    let mut action = json!({ "action": "scroll", "scroll_direction": a.direction,
                             "scroll_amount": amount });
    match (a.x, a.y) {
        (Some(x), Some(y)) => action["coordinate"] = json!([x, y]),
        (None, None) => {}
        (Some(_), None) => return Err(ToolError::arg("y", "is required when x is given")),
        (None, Some(_)) => return Err(ToolError::arg("x", "is required when y is given")),
    }
    act(ctx, &a.sandbox_id, json!([action]), a.screenshot).await
}
