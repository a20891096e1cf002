//! A template's recent builds (`tpl_builds`) as a list: what the console's Builds view shows
//! through [`crate::tplbuild::Builds::recent_builds`].

use rusqlite::params;

use super::tplbuild_sql::BuildsDb;
use super::Result;

/// One build of a template, as a list shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BuildSummary {
    #[serde(rename = "buildID")]
    pub build_id: String,
    pub status: String,
    pub tags: Vec<String>,
    /// Why a failed build failed.
    pub reason: Option<String>,
    pub created_at_ms: i64,
    pub finished_at_ms: Option<i64>,
}

/// Most builds a template's list shows.
pub const MAX_BUILDS: u32 = 50;

impl BuildsDb {
    /// The newest [`MAX_BUILDS`] builds of template `template_id` (its id, not a name),
    /// newest first.
    pub async fn recent_builds(&self, template_id: &str) -> Result<Vec<BuildSummary>> {
        let id = template_id.to_string();
        self.run(move |c| {
            let mut st = c.prepare_cached(
                "SELECT id, status, tags, reason, created_at, finished_at FROM tpl_builds
                 WHERE template_id = ?1 ORDER BY created_at DESC, id DESC LIMIT ?2",
            )?;
            let rows = st.query_map(params![id, MAX_BUILDS], |r| {
                let tags: String = r.get(2)?;
                Ok(BuildSummary {
                    build_id: r.get(0)?,
                    status: r.get(1)?,
                    tags: serde_json::from_str(&tags).unwrap_or_default(),
                    reason: r.get(3)?,
                    created_at_ms: r.get(4)?,
                    finished_at_ms: r.get(5)?,
                })
            })?;
            Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_templates_builds_newest_first() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kiln.db");
        drop(crate::store::SqliteStore::open(&path).unwrap());
        let builds = BuildsDb::open(&path).unwrap();
        for (id, at) in [("b1", 10), ("b2", 20)] {
            builds
                .insert_build(&crate::store::BuildRow {
                    id: id.into(),
                    template_id: "tpl".into(),
                    status: "waiting".into(),
                    tags: vec!["v1".into()],
                    created_at_ms: at,
                    ..Default::default()
                })
                .await
                .unwrap();
        }
        let got = builds.recent_builds("tpl").await.unwrap();
        let ids: Vec<&str> = got.iter().map(|b| b.build_id.as_str()).collect();
        assert_eq!(ids, ["b2", "b1"]);
        assert_eq!(got[0].tags, ["v1"]);
        assert!(builds.recent_builds("other").await.unwrap().is_empty());
    }
}
