//! The history of a template's tags (migration 14, `tpl_tag_assignments`): every time a tag
//! was pointed at a build, in order. E2B's tag groups and a tag's assignments list the ones
//! whose build is ready, newest first.

use rusqlite::params;

use super::tplbuild_sql::BuildsDb;
use super::Result;

/// One assignment of a tag to a ready build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AssignmentRow {
    /// Order of the assignments (a later one has a larger `seq`).
    pub seq: i64,
    pub id: String,
    pub tag: String,
    pub build_id: String,
    pub assigned_at_ms: i64,
    pub build_created_at_ms: i64,
    pub build_finished_at_ms: Option<i64>,
}

impl BuildsDb {
    /// The assignments of a template's tags (of `tag` only when given) whose build is ready,
    /// newest first, those before `before_seq` when given, at most `limit`.
    pub async fn assignments(
        &self,
        template_id: &str,
        tag: Option<&str>,
        before_seq: Option<i64>,
        limit: u32,
    ) -> Result<Vec<AssignmentRow>> {
        let (id, tag) = (template_id.to_string(), tag.map(str::to_string));
        self.run(move |c| {
            let mut st = c.prepare_cached(
                "SELECT a.seq, a.id, a.tag, a.build_id, a.assigned_at, b.created_at,
                   b.finished_at
                 FROM tpl_tag_assignments a JOIN tpl_builds b ON b.id = a.build_id
                 WHERE a.template_id = ?1 AND b.status = 'ready'
                   AND (?2 IS NULL OR a.tag = ?2) AND (?3 IS NULL OR a.seq < ?3)
                 ORDER BY a.seq DESC LIMIT ?4",
            )?;
            let rows = st.query_map(params![id, tag, before_seq, limit], |r| {
                Ok(AssignmentRow {
                    seq: r.get(0)?,
                    id: r.get(1)?,
                    tag: r.get(2)?,
                    build_id: r.get(3)?,
                    assigned_at_ms: r.get(4)?,
                    build_created_at_ms: r.get(5)?,
                    build_finished_at_ms: r.get(6)?,
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
    use crate::store::BuildRow;

    #[tokio::test]
    async fn assignments_are_kept_per_tag_newest_first_for_ready_builds() {
        let db = BuildsDb::open_in_memory().unwrap();
        let t = db
            .ensure_template("red", "app", "tid", None, None, 1)
            .await
            .unwrap();
        for (id, status) in [("b1", "ready"), ("b2", "ready"), ("b3", "error")] {
            let b = BuildRow {
                id: id.into(),
                template_id: t.id.clone(),
                status: status.into(),
                created_at_ms: 2,
                ..Default::default()
            };
            db.insert_build(&b).await.unwrap();
        }
        db.assign_tags(&t.id, &["v1".into(), "prod".into()], "b1", 10)
            .await
            .unwrap();
        db.assign_tags(&t.id, &["prod".into()], "b2", 20)
            .await
            .unwrap();
        db.assign_tags(&t.id, &["prod".into()], "b3", 30)
            .await
            .unwrap();
        let prod = db.assignments(&t.id, Some("prod"), None, 10).await.unwrap();
        let builds: Vec<_> = prod.iter().map(|a| a.build_id.as_str()).collect();
        assert_eq!(
            builds,
            ["b2", "b1"],
            "newest first, the error build left out"
        );
        let page2 = db
            .assignments(&t.id, Some("prod"), Some(prod[0].seq), 10)
            .await
            .unwrap();
        assert_eq!(page2.len(), 1);
        assert_eq!(
            db.assignments(&t.id, None, None, 10).await.unwrap().len(),
            3
        );
        db.remove_tags(&t.id, &["prod".into()]).await.unwrap();
        assert!(db
            .assignments(&t.id, Some("prod"), None, 10)
            .await
            .unwrap()
            .is_empty());
    }
}
