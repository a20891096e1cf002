//! `GET /templates` and `GET /templates/{templateID}`.

use axum::extract::{Path, State};
use axum::Json;
use serde_json::Value;

use super::wire::template_json;
use super::{ApiResult, St};

pub async fn list_templates(State(st): St) -> ApiResult<Json<Vec<Value>>> {
    let list = st.manager.templates().await?;
    Ok(Json(list.iter().map(template_json).collect()))
}

pub async fn get_template(State(st): St, Path(name): Path<String>) -> ApiResult<Json<Value>> {
    Ok(Json(template_json(&st.manager.template(&name).await?)))
}
