//! The MCP server: rmcp's `ServerHandler` for kiln — server info and capabilities, the tool
//! catalog and calls, and sandbox files as resources. The kiln API key a call acts with is the
//! HTTP caller's (put there by the HTTP layer) or, over stdio, the one `kiln mcp` was given.

use rmcp::model::{
    CacheScope, CallToolRequestParams, CallToolResponse, ListResourceTemplatesResult,
    ListResourcesResult, ListToolsResult, PaginatedRequestParams, ReadResourceRequestParams,
    ReadResourceResponse, ReadResourceResult, Resource, ResourceTemplate, ServerCapabilities,
    ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};

use super::args::ToolError;
use super::ctx::Ctx;
use super::{files, tools};
use crate::client::Client;

/// The kiln API key of an authenticated HTTP request (an extension of its `http::Parts`).
#[derive(Clone)]
pub struct CallerKey(pub String);

#[derive(Clone)]
pub struct KilnMcp {
    /// The kiln server, with the key stdio calls use (none over HTTP).
    client: Client,
    tools: std::sync::Arc<Vec<Tool>>,
}

const INSTRUCTIONS: &str = "Tools for kiln sandboxes: disposable, isolated Linux machines. \
    create_sandbox starts one (template base, code-interpreter-v1 for run_code, desktop for the \
    desktop_* tools) and returns its sandbox_id; run_command, the file tools, run_code and the \
    desktop tools act in it; kill_sandbox ends it (it also ends by itself at its timeout). \
    Sandbox files are resources at kiln://sandbox/{sandbox_id}/file/{path}.";

impl KilnMcp {
    pub fn new(client: Client) -> KilnMcp {
        KilnMcp {
            client,
            tools: std::sync::Arc::new(tools::all()),
        }
    }

    /// The context of one call: the client acting for the caller.
    fn ctx(&self, rc: &RequestContext<RoleServer>) -> Ctx {
        let key = rc
            .extensions
            .get::<http::request::Parts>()
            .and_then(|p| p.extensions.get::<CallerKey>())
            .map(|k| k.0.clone());
        let client = match key {
            Some(k) => self.client.with_key(Some(k)),
            None => self.client.clone(),
        };
        Ctx::new(client, rc)
    }
}

impl ServerHandler for KilnMcp {
    fn get_info(&self) -> ServerConfig {
        let caps = ServerCapabilities::builder()
            .enable_tools()
            .enable_resources()
            .build();
        let mut info = ServerConfig::new(caps).with_instructions(INSTRUCTIONS);
        info.server_info = rmcp::model::Implementation::new("kiln", env!("CARGO_PKG_VERSION"));
        info
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        Ok(ListToolsResult::with_all_items(self.tools.to_vec()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.tools.iter().find(|t| t.name == name).cloned()
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let ctx = self.ctx(&context);
        let name = request.name.to_string();
        let run = tools::call(&ctx, &name, request.arguments);
        let outcome = tokio::select! {
            r = run => r,
            _ = context.ct.cancelled() => {
                return Err(McpError::internal_error(format!("{name} was cancelled"), None));
            }
        };
        match outcome {
            None => Err(McpError::invalid_params(
                format!("no tool named {name:?} (tools/list names them)"),
                None,
            )),
            Some(Ok(r)) => Ok(r.into()),
            Some(Err(e)) => {
                tracing::debug!(tool = %name, "tool error: {e}");
                Ok(e.into_result().into())
            }
        }
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, McpError> {
        // One resource per sandbox: its home directory (a directory reads as its listing).
        let ctx = self.ctx(&context);
        let list = ctx
            .client
            .get_json("/v2/sandboxes?state=running&limit=1000")
            .await
            .map_err(|e| McpError::internal_error(format!("listing sandboxes: {e}"), None))?;
        let resources = list
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s["sandboxID"].as_str())
            .map(|id| {
                Resource::new(files::uri(id, "/home/user"), format!("{id}:/home/user"))
                    .with_description(format!(
                        "the home directory of sandbox {id} (a JSON listing)"
                    ))
                    .with_mime_type("application/json")
            })
            .collect();
        // Sandboxes come and go, and every key sees its own team's.
        Ok(ListResourcesResult::with_all_items(resources)
            .with_ttl_ms(0)
            .with_cache_scope(CacheScope::Private))
    }

    async fn list_resource_templates(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, McpError> {
        let t = ResourceTemplate::new(files::URI_TEMPLATE, "sandbox-file")
            .with_title("A file or directory in a kiln sandbox")
            .with_description(
                "Text files read as text, other files as base64 blobs, directories as a JSON \
                 listing.",
            );
        Ok(ListResourceTemplatesResult::with_all_items(vec![t]))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, McpError> {
        let ctx = self.ctx(&context);
        match files::read_resource(&ctx, &request.uri).await {
            Ok(c) => Ok(ReadResourceResult::new(vec![c])
                .with_ttl_ms(0)
                .with_cache_scope(CacheScope::Private)
                .into()),
            Err(ToolError::Arg { name, message }) => {
                Err(McpError::invalid_params(format!("{name}: {message}"), None))
            }
            Err(e) => Err(McpError::resource_not_found(
                format!("{}: {e}", request.uri),
                None,
            )),
        }
    }
}
