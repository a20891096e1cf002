//! `run_code`: code in a code-interpreter sandbox (`code-interpreter-v1`), through the
//! interpreter's `POST /execute` on port 49999 (the API `e2b-code-interpreter` speaks). Text
//! results come back as text, PNG/JPEG results (matplotlib figures …) as MCP image content.

use std::time::Duration;

use reqwest::Method;
use rmcp::model::{CallToolResult, ContentBlock};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};

use super::args::{non_empty, ToolError, ToolResult};
use super::ctx::Ctx;

/// The code interpreter's port in the sandbox.
const PORT: u16 = 49999;
const DEFAULT_TIMEOUT_SECS: u64 = 300;
const MAX_TIMEOUT_SECS: u64 = 3600;
const LANGUAGES: &[&str] = &["python", "javascript", "typescript", "bash", "r", "java"];

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CodeArgs {
    /// A sandbox of the `code-interpreter-v1` template.
    sandbox_id: String,
    /// The code to run (a notebook cell: its last expression is its result).
    code: String,
    /// `python` (default), `javascript`, `typescript`, `bash`, `r` or `java`.
    #[serde(default)]
    language: Option<String>,
    /// Seconds before the run is abandoned (default 300, at most 3600).
    #[serde(default)]
    timeout_secs: Option<u64>,
}

/// What one run produced, in the order it came.
#[derive(Default)]
struct Run {
    content: Vec<ContentBlock>,
    stdout: String,
    stderr: String,
    results: Vec<Value>,
    error: Option<Value>,
}

impl Run {
    /// Takes one NDJSON event of the interpreter.
    fn take(&mut self, ev: Value) {
        match ev["type"].as_str() {
            Some("stdout") => self.stdout.push_str(ev["text"].as_str().unwrap_or("")),
            Some("stderr") => self.stderr.push_str(ev["text"].as_str().unwrap_or("")),
            Some("result") => {
                for (field, mime) in [("png", "image/png"), ("jpeg", "image/jpeg")] {
                    if let Some(data) = ev[field].as_str() {
                        self.content.push(ContentBlock::image(data, mime));
                    }
                }
                // One text form per result: the richest a model reads well.
                let text = ["text", "markdown", "json", "html", "svg", "latex"]
                    .iter()
                    .find_map(|f| match &ev[*f] {
                        Value::Null => None,
                        Value::String(s) => Some(s.clone()),
                        other => Some(other.to_string()),
                    });
                if let Some(t) = text {
                    self.content.push(ContentBlock::text(t));
                }
                let mut summary = serde_json::Map::new();
                for (k, v) in ev.as_object().into_iter().flatten() {
                    // Images are in the content already; keep the record small.
                    if !matches!(k.as_str(), "png" | "jpeg" | "pdf" | "type") {
                        summary.insert(k.clone(), v.clone());
                    }
                }
                self.results.push(Value::Object(summary));
            }
            Some("error") => self.error = Some(ev),
            _ => {}
        }
    }

    fn finish(mut self) -> CallToolResult {
        let mut head = Vec::new();
        if !self.stdout.is_empty() {
            head.push(ContentBlock::text(format!("stdout:\n{}", self.stdout)));
        }
        if !self.stderr.is_empty() {
            head.push(ContentBlock::text(format!("stderr:\n{}", self.stderr)));
        }
        if let Some(e) = &self.error {
            head.push(ContentBlock::text(format!(
                "{}: {}\n{}",
                e["name"].as_str().unwrap_or("Error"),
                e["value"].as_str().unwrap_or(""),
                e["traceback"].as_str().unwrap_or("")
            )));
        }
        head.append(&mut self.content);
        if head.is_empty() {
            head.push(ContentBlock::text("(no output)"));
        }
        let structured = json!({
            "stdout": self.stdout, "stderr": self.stderr, "results": self.results,
            "error": self.error,
        });
        let mut r = if self.error.is_some() {
            CallToolResult::error(head)
        } else {
            CallToolResult::success(head)
        };
        r.structured_content = Some(structured);
        r
    }
}

pub async fn run(ctx: &Ctx, a: CodeArgs) -> ToolResult<CallToolResult> {
    non_empty("code", &a.code)?;
    if let Some(l) = &a.language {
        if !LANGUAGES.contains(&l.as_str()) {
            return Err(ToolError::arg(
                "language",
                format!("{l:?}: use one of {}", LANGUAGES.join(", ")),
            ));
        }
    }
    let secs = a.timeout_secs.unwrap_or(DEFAULT_TIMEOUT_SECS);
    super::args::in_range("timeout_secs", secs, MAX_TIMEOUT_SECS)?;
    let sbx = ctx.sandbox(&a.sandbox_id).await?;
    let mut body = json!({ "code": a.code });
    if let Some(l) = &a.language {
        body["language"] = json!(l);
    }
    let make = || {
        let req = ctx
            .client
            .port_request(Method::POST, &sbx.id, PORT, "/execute")
            .json(&body)
            .timeout(Duration::from_secs(secs));
        match &sbx.envd_token {
            Some(t) => req.header("x-access-token", t),
            None => req,
        }
    };
    let unreachable = |e: &dyn std::fmt::Display| {
        ToolError::failed(format!(
            "the code interpreter of sandbox {} did not answer ({e}); is it a \
             code-interpreter-v1 sandbox?",
            sbx.id
        ))
    };
    let mut resp = ctx.send_to_port(make).await.map_err(|e| unreachable(&e))?;
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        return Err(unreachable(&format!("{status}: {}", text.trim())));
    }
    let mut run = Run::default();
    let mut buf = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| ToolError::failed(format!("reading the interpreter's output: {e}")))?
    {
        buf.extend_from_slice(&chunk);
        while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let Ok(ev) = serde_json::from_slice::<Value>(&line) else {
                continue;
            };
            if let Some(t) = ev["text"]
                .as_str()
                .filter(|_| matches!(ev["type"].as_str(), Some("stdout") | Some("stderr")))
            {
                ctx.progress(t.to_string()).await;
            }
            run.take(ev);
        }
    }
    Ok(run.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_become_text_and_images() {
        let mut r = Run::default();
        r.take(json!({"type": "stdout", "text": "hi\n"}));
        r.take(
            json!({"type": "result", "text": "<Figure>", "png": "iVBOR", "is_main_result": false}),
        );
        r.take(json!({"type": "result", "text": "42", "is_main_result": true}));
        let out = r.finish();
        assert_eq!(out.is_error, Some(false));
        let kinds: Vec<&str> = out
            .content
            .iter()
            .map(|c| {
                if c.as_image().is_some() {
                    "image"
                } else {
                    c.as_text().map(|t| t.text.as_str()).unwrap_or("?")
                }
            })
            .collect();
        assert_eq!(kinds, ["stdout:\nhi\n", "image", "<Figure>", "42"]);
        let s = out.structured_content.unwrap();
        assert!(s["results"][0].get("png").is_none());
        assert_eq!(s["results"][1]["text"], "42");
    }

    #[test]
    fn an_exception_is_a_tool_error() {
        let mut r = Run::default();
        r.take(
            json!({"type": "error", "name": "ZeroDivisionError", "value": "division by zero",
                      "traceback": "Traceback …"}),
        );
        let out = r.finish();
        assert_eq!(out.is_error, Some(true));
        let t = out.content[0].as_text().unwrap().text.clone();
        assert!(t.starts_with("ZeroDivisionError: division by zero"), "{t}");
    }
}
