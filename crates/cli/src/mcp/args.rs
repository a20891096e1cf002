//! Tool arguments and tool errors: arguments are parsed into each tool's typed struct (the same
//! struct its input schema is generated from), and every failure names the argument it is about.

use rmcp::model::{CallToolResult, ContentBlock};
use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};

use crate::client::ClientError;

/// Why a tool call failed; it reaches the client as a tool error (`isError: true`) whose text
/// says what to change, as the MCP spec asks for input and execution errors.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// An argument is missing, unknown, of the wrong type or out of range.
    #[error("argument `{name}`: {message}")]
    Arg { name: String, message: String },
    /// The arguments were fine; kiln (or the sandbox) refused or failed.
    #[error("{0}")]
    Failed(String),
}

impl ToolError {
    pub fn arg(name: &str, message: impl Into<String>) -> Self {
        ToolError::Arg {
            name: name.to_string(),
            message: message.into(),
        }
    }

    pub fn failed(message: impl std::fmt::Display) -> Self {
        ToolError::Failed(message.to_string())
    }

    /// The tool result carrying this error.
    pub fn into_result(self) -> CallToolResult {
        let structured = match &self {
            ToolError::Arg { name, message } => {
                json!({"error": {"kind": "invalid_argument", "argument": name, "message": message}})
            }
            ToolError::Failed(m) => json!({"error": {"kind": "failed", "message": m}}),
        };
        let mut r = CallToolResult::error(vec![ContentBlock::text(self.to_string())]);
        r.structured_content = Some(structured);
        r
    }
}

impl From<ClientError> for ToolError {
    fn from(e: ClientError) -> Self {
        ToolError::Failed(e.to_string())
    }
}

impl From<kiln_envd::EnvdError> for ToolError {
    fn from(e: kiln_envd::EnvdError) -> Self {
        ToolError::Failed(e.to_string())
    }
}

pub type ToolResult<T> = Result<T, ToolError>;

/// The backquoted name in one of serde's messages (`missing field `x``, `unknown field `y``).
fn quoted(msg: &str) -> Option<&str> {
    let start = msg.find('`')? + 1;
    let len = msg[start..].find('`')?;
    Some(&msg[start..start + len])
}

/// Parses a tool's arguments into `T`; the error names the offending argument.
pub fn parse<T: DeserializeOwned>(args: Option<Map<String, Value>>) -> ToolResult<T> {
    let v = Value::Object(args.unwrap_or_default());
    serde_path_to_error::deserialize::<_, T>(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        if path != "." && !path.is_empty() {
            return ToolError::arg(&path, inner);
        }
        // Missing and unknown fields are reported at the level of the object itself.
        match quoted(&inner) {
            Some(name) if inner.starts_with("missing field") => ToolError::arg(name, "is required"),
            Some(name) if inner.starts_with("unknown field") => {
                let expected = inner.split_once(", ").map(|(_, rest)| rest).unwrap_or("");
                ToolError::arg(
                    name,
                    format!("is not an argument of this tool ({expected})"),
                )
            }
            _ => ToolError::Failed(format!("invalid arguments: {inner}")),
        }
    })
}

/// A sandbox path argument: absolute, no NUL.
pub fn abs_path(name: &str, p: &str) -> ToolResult<()> {
    if !p.starts_with('/') {
        return Err(ToolError::arg(
            name,
            format!("{p:?} is not an absolute path"),
        ));
    }
    if p.contains('\0') {
        return Err(ToolError::arg(name, "contains a NUL byte"));
    }
    Ok(())
}

/// A non-empty argument.
pub fn non_empty(name: &str, v: &str) -> ToolResult<()> {
    if v.trim().is_empty() {
        return Err(ToolError::arg(name, "must not be empty"));
    }
    Ok(())
}

/// `value` of argument `name` within 1..=`max` (a timeout in seconds, say).
pub fn in_range(name: &str, value: u64, max: u64) -> ToolResult<u64> {
    if value == 0 || value > max {
        return Err(ToolError::arg(
            name,
            format!("must be 1-{max}, got {value}"),
        ));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct A {
        sandbox_id: String,
        timeout_secs: Option<u64>,
    }

    fn args(v: Value) -> Option<Map<String, Value>> {
        v.as_object().cloned()
    }

    fn named(e: ToolError) -> (String, String) {
        match e {
            ToolError::Arg { name, message } => (name, message),
            other => panic!("not an argument error: {other}"),
        }
    }

    #[test]
    fn errors_name_the_argument() {
        let (n, m) = named(parse::<A>(args(json!({}))).unwrap_err());
        assert_eq!((n.as_str(), m.as_str()), ("sandbox_id", "is required"));
        let (n, m) =
            named(parse::<A>(args(json!({"sandbox_id": "x", "timeout_secs": "ten"}))).unwrap_err());
        assert_eq!(n, "timeout_secs");
        assert!(m.contains("invalid type"), "{m}");
        let (n, m) = named(parse::<A>(args(json!({"sandbox_id": "x", "bogus": 1}))).unwrap_err());
        assert_eq!(n, "bogus");
        assert!(m.contains("sandbox_id"), "{m}");
        let (n, _) = named(parse::<A>(args(json!({"sandbox_id": 5}))).unwrap_err());
        assert_eq!(n, "sandbox_id");
        assert!(parse::<A>(args(json!({"sandbox_id": "x"}))).is_ok());
    }

    #[test]
    fn error_results_carry_the_argument() {
        let r = ToolError::arg("path", "is not absolute").into_result();
        assert_eq!(r.is_error, Some(true));
        let s = r.structured_content.unwrap();
        assert_eq!(s["error"]["argument"], "path");
        assert!(abs_path("path", "rel/x").is_err() && abs_path("path", "/x").is_ok());
    }
}
