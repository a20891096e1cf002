//! What an execution streams to the client: E2B's NDJSON lines (`stdout`, `stderr`, `result`,
//! `error`, `number_of_executions`), built from the kernel's iopub messages.

use serde_json::{json, Map, Value};

use super::wire::Message;

/// MIME type of the structured chart our startup script attaches to matplotlib figures.
pub const CHART_MIME: &str = "application/vnd.kiln.chart+json";
/// MIME type of the column data our startup script attaches to pandas DataFrames.
pub const DATA_MIME: &str = "application/vnd.kiln.data+json";

/// One output of an execution.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Stdout(String),
    Stderr(String),
    /// A MIME bundle, already mapped to E2B's result fields.
    Result(Map<String, Value>),
    Error {
        name: String,
        value: String,
        traceback: String,
    },
    Count(i64),
    /// The service could not run the code at all (not a user error).
    Internal(String),
}

/// E2B's field name for each MIME type it knows; others go to `extra`.
fn field_for(mime: &str) -> Option<&'static str> {
    Some(match mime {
        "text/plain" => "text",
        "text/html" => "html",
        "text/markdown" => "markdown",
        "image/svg+xml" => "svg",
        "image/png" => "png",
        "image/jpeg" => "jpeg",
        "application/pdf" => "pdf",
        "text/latex" => "latex",
        "application/json" => "json",
        "application/javascript" => "javascript",
        DATA_MIME => "data",
        CHART_MIME => "chart",
        _ => return None,
    })
}

/// Map a Jupyter MIME bundle to E2B's result object.
pub fn result_from_bundle(data: &Map<String, Value>, is_main: bool) -> Map<String, Value> {
    let mut out = Map::new();
    let mut extra = Map::new();
    for (mime, v) in data {
        // Jupyter may send multi-line text as a list of lines.
        let v = match v {
            Value::Array(a) if a.iter().all(Value::is_string) => Value::String(
                a.iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .concat(),
            ),
            v => v.clone(),
        };
        // Binary formats are base64; kernels may wrap it in newlines.
        let v = match (mime.as_str(), v) {
            ("image/png" | "image/jpeg" | "application/pdf", Value::String(s)) => {
                Value::String(s.split_whitespace().collect())
            }
            (_, v) => v,
        };
        match field_for(mime) {
            Some(f) => {
                out.insert(f.into(), v);
            }
            None => {
                extra.insert(mime.clone(), v);
            }
        }
    }
    out.insert("is_main_result".into(), Value::Bool(is_main));
    if !extra.is_empty() {
        out.insert("extra".into(), Value::Object(extra));
    }
    out
}

impl Event {
    /// The event an iopub message stands for (None: not an output).
    pub fn from_iopub(m: &Message) -> Option<Event> {
        let c = &m.content;
        match m.msg_type() {
            "stream" => {
                let text = c["text"].as_str().unwrap_or_default().to_string();
                Some(if c["name"] == "stderr" {
                    Event::Stderr(text)
                } else {
                    Event::Stdout(text)
                })
            }
            "execute_result" | "display_data" => {
                let data = c["data"].as_object()?;
                Some(Event::Result(result_from_bundle(
                    data,
                    m.msg_type() == "execute_result",
                )))
            }
            "error" => Some(Event::Error {
                name: c["ename"].as_str().unwrap_or_default().to_string(),
                value: c["evalue"].as_str().unwrap_or_default().to_string(),
                traceback: c["traceback"]
                    .as_array()
                    .map(|t| {
                        t.iter()
                            .filter_map(Value::as_str)
                            .collect::<Vec<_>>()
                            .join("\n")
                    })
                    .unwrap_or_default(),
            }),
            _ => None,
        }
    }

    /// The NDJSON line for this event (with the trailing newline).
    pub fn to_line(&self) -> String {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or_default();
        let v = match self {
            Event::Stdout(t) => json!({"type": "stdout", "text": t, "timestamp": ts}),
            Event::Stderr(t) => json!({"type": "stderr", "text": t, "timestamp": ts}),
            Event::Result(r) => {
                let mut r = r.clone();
                r.insert("type".into(), "result".into());
                Value::Object(r)
            }
            Event::Error {
                name,
                value,
                traceback,
            } => json!({"type": "error", "name": name, "value": value, "traceback": traceback}),
            Event::Count(n) => json!({"type": "number_of_executions", "execution_count": n}),
            Event::Internal(msg) => {
                json!({"type": "error", "name": "InterpreterError", "value": msg, "traceback": msg})
            }
        };
        let mut s = v.to_string();
        s.push('\n');
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundle_mapping() {
        let data = json!({
            "text/plain": "<Figure>", "image/png": "iVB\nOR\n", CHART_MIME: {"type": "line"},
            "application/x-custom": ["a", "b"],
        });
        let r = result_from_bundle(data.as_object().unwrap(), false);
        assert_eq!(r["text"], "<Figure>");
        assert_eq!(r["png"], "iVBOR");
        assert_eq!(r["chart"]["type"], "line");
        assert_eq!(r["is_main_result"], false);
        assert_eq!(r["extra"]["application/x-custom"], "ab");
    }

    #[test]
    fn lines() {
        let l = Event::Count(3).to_line();
        assert!(l.ends_with('\n'));
        let v: Value = serde_json::from_str(&l).unwrap();
        assert_eq!(
            v,
            json!({"type": "number_of_executions", "execution_count": 3})
        );
        let v: Value = serde_json::from_str(&Event::Stdout("x".into()).to_line()).unwrap();
        assert_eq!(v["type"], "stdout");
        assert!(v["timestamp"].as_u64().unwrap() > 0);
    }
}
