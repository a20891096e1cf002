//! The tool catalog: each tool's name, description, hints and input schema (generated from
//! its argument struct), and the dispatch from a `tools/call` to the tool's function.

use std::future::Future;

use rmcp::model::{CallToolResult, JsonObject, Tool, ToolAnnotations};
use schemars::JsonSchema;
use serde::de::DeserializeOwned;

use super::args::{parse, ToolResult};
use super::ctx::Ctx;
use super::{code, desktop, exec, files, lifecycle};

/// What a tool does to the world, for the client's hints.
#[derive(Clone, Copy)]
enum Effect {
    /// Reads only.
    Reads,
    /// Changes things without destroying any.
    Changes,
    /// May destroy something (a sandbox, a file's old content).
    Destroys,
}

fn tool<T: JsonSchema + 'static>(name: &'static str, description: &'static str, e: Effect) -> Tool {
    let schema = rmcp::handler::server::common::schema_for_input::<T>()
        .unwrap_or_else(|err| panic!("input schema of {name}: {err}"));
    let hints = match e {
        Effect::Reads => ToolAnnotations::new().read_only(true),
        Effect::Changes => ToolAnnotations::new().read_only(false).destructive(false),
        Effect::Destroys => ToolAnnotations::new().read_only(false).destructive(true),
    };
    // Sandboxes reach the network only as their own policy allows; the tools themselves talk
    // to one kiln server.
    Tool::new(name, description, schema).with_annotations(hints.open_world(false))
}

/// Every tool, in the order `tools/list` shows them.
pub fn all() -> Vec<Tool> {
    use Effect::*;
    vec![
        tool::<lifecycle::CreateArgs>(
            "create_sandbox",
            "Create a sandbox (an isolated Linux machine) from a template, with an optional \
             timeout and network policy. Returns its sandbox_id.",
            Changes,
        ),
        tool::<lifecycle::ListArgs>(
            "list_sandboxes",
            "List the running and paused sandboxes this API key can see.",
            Reads,
        ),
        tool::<lifecycle::IdArgs>("kill_sandbox", "Kill a sandbox and delete it.", Destroys),
        tool::<lifecycle::IdArgs>(
            "pause_sandbox",
            "Pause a sandbox, keeping its memory and disk; resume_sandbox continues it.",
            Changes,
        ),
        tool::<lifecycle::ResumeArgs>("resume_sandbox", "Resume a paused sandbox.", Changes),
        tool::<lifecycle::ForkArgs>(
            "fork_sandbox",
            "Copy a running sandbox (memory, processes and disk) into new sandboxes.",
            Changes,
        ),
        tool::<exec::RunArgs>(
            "run_command",
            "Run a shell command (bash -l -c) in a sandbox and return its exit code, stdout \
             and stderr. Output is also sent as progress notifications while it runs.",
            Destroys,
        ),
        tool::<files::PathArgs>("read_file", "Read a UTF-8 text file from a sandbox.", Reads),
        tool::<files::WriteArgs>(
            "write_file",
            "Write a UTF-8 text file in a sandbox (replacing it; parents are created).",
            Destroys,
        ),
        tool::<files::ListArgs>(
            "list_files",
            "List a directory of a sandbox (to a depth of 1-5).",
            Reads,
        ),
        tool::<files::UploadArgs>(
            "upload_file",
            "Write any file in a sandbox from base64 content.",
            Destroys,
        ),
        tool::<files::PathArgs>(
            "download_file",
            "Read any file from a sandbox as base64 content.",
            Reads,
        ),
        tool::<code::CodeArgs>(
            "run_code",
            "Run code in a code-interpreter sandbox (template code-interpreter-v1; state \
             persists between calls like a notebook). Returns stdout, stderr, text results and \
             images (charts) as image content.",
            Destroys,
        ),
        tool::<desktop::ScreenshotArgs>(
            "desktop_screenshot",
            "Take a screenshot of a desktop sandbox (template desktop).",
            Reads,
        ),
        tool::<desktop::ClickArgs>(
            "desktop_click",
            "Click at a screen position of a desktop sandbox.",
            Changes,
        ),
        tool::<desktop::TypeArgs>(
            "desktop_type",
            "Type text into the focused window of a desktop sandbox.",
            Changes,
        ),
        tool::<desktop::KeyArgs>(
            "desktop_key",
            "Press a key combination (e.g. ctrl+s, Return) in a desktop sandbox.",
            Changes,
        ),
        tool::<desktop::ScrollArgs>(
            "desktop_scroll",
            "Scroll the mouse wheel in a desktop sandbox.",
            Changes,
        ),
    ]
}

/// Parses the arguments into the tool's struct and runs it.
async fn with<T, F, Fut>(args: Option<JsonObject>, f: F) -> ToolResult<CallToolResult>
where
    T: DeserializeOwned,
    F: FnOnce(T) -> Fut,
    Fut: Future<Output = ToolResult<CallToolResult>>,
{
    f(parse(args)?).await
}

/// Runs tool `name`; `None` when there is no such tool.
pub async fn call(
    ctx: &Ctx,
    name: &str,
    args: Option<JsonObject>,
) -> Option<ToolResult<CallToolResult>> {
    Some(match name {
        "create_sandbox" => with(args, |a| lifecycle::create(ctx, a)).await,
        "list_sandboxes" => with(args, |a| lifecycle::list(ctx, a)).await,
        "kill_sandbox" => with(args, |a| lifecycle::kill(ctx, a)).await,
        "pause_sandbox" => with(args, |a| lifecycle::pause(ctx, a)).await,
        "resume_sandbox" => with(args, |a| lifecycle::resume(ctx, a)).await,
        "fork_sandbox" => with(args, |a| lifecycle::fork(ctx, a)).await,
        "run_command" => with(args, |a| exec::run(ctx, a)).await,
        "read_file" => with(args, |a| files::read(ctx, a)).await,
        "write_file" => with(args, |a| files::write(ctx, a)).await,
        "list_files" => with(args, |a| files::list(ctx, a)).await,
        "upload_file" => with(args, |a| files::upload(ctx, a)).await,
        "download_file" => with(args, |a| files::download(ctx, a)).await,
        "run_code" => with(args, |a| code::run(ctx, a)).await,
        "desktop_screenshot" => with(args, |a| desktop::screenshot(ctx, a)).await,
        "desktop_click" => with(args, |a| desktop::click(ctx, a)).await,
        "desktop_type" => with(args, |a| desktop::type_text(ctx, a)).await,
        "desktop_key" => with(args, |a| desktop::key(ctx, a)).await,
        "desktop_scroll" => with(args, |a| desktop::scroll(ctx, a)).await,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_tool_has_an_object_schema_and_a_unique_name() {
        let tools = super::all();
        let mut names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
        names.sort();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "duplicate tool names");
        for t in &tools {
            assert_eq!(t.input_schema["type"], "object", "{}", t.name);
        }
        let create = tools.iter().find(|t| t.name == "create_sandbox").unwrap();
        let props = create.input_schema["properties"].as_object().unwrap();
        for p in [
            "template",
            "timeout_secs",
            "allow_internet",
            "allow_out",
            "deny_out",
        ] {
            assert!(props.contains_key(p), "create_sandbox lacks {p}");
        }
        let run = tools.iter().find(|t| t.name == "run_command").unwrap();
        let required = run.input_schema["required"].as_array().unwrap();
        assert!(required.contains(&"sandbox_id".into()) && required.contains(&"command".into()));
    }
}
