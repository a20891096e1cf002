//! A node's templates in object storage. Asked by a replica (another node is to start a
//! template only this one holds), the node packs the template's root filesystem into one tar
//! archive, stores it in the bucket as content-addressed chunks and records it in etcd with
//! the template's metadata ([`TemplateFilesDoc`]). A create of a template the node lacks
//! fetches that archive (the chunks it does not have cached), unpacks it into the template
//! store's staging space and adopts it as the template's current version before the create
//! runs; from then on the node holds the template and reports it.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Path as UrlPath, State};
use axum::Json;
use kiln_server::store::now_ms;
use kiln_server::templates::{check_name, TemplateInfo};
use kiln_server::{ApiError, Error};
use kiln_template::{Store, Template};

use super::NodeApi;
use crate::objects::{ChunkCache, ChunkStore};
use crate::template_files::{name_of, TemplateFilesDoc};

/// `POST /internal/v1/templates/{name}/share`: stores template `name` in the bucket (unless the
/// bucket has this build already) and answers where.
pub(super) async fn share_route(
    State(n): State<Arc<NodeApi>>,
    UrlPath(name): UrlPath<String>,
) -> Result<Json<TemplateFilesDoc>, ApiError> {
    Ok(Json(share(&n, &name).await?))
}

/// Template `name`'s files in the bucket: the record of this build when there is one, else
/// stored now.
pub(super) async fn share(n: &NodeApi, name: &str) -> Result<TemplateFilesDoc, Error> {
    check_name(name)?;
    let (Some(mover), Some(store)) = (&n.mover, &n.templates) else {
        return Err(Error::Conflict(format!(
            "node {} has no object storage to share template \"{name}\" through",
            n.name
        )));
    };
    let info = n.service.template(name).await?.info;
    let _one = n.template_files.lock().await;
    if let Some(doc) = recorded(n, name).await? {
        if doc.key == info.key {
            return Ok(doc);
        }
    }
    let started = Instant::now();
    let meta = serde_json::to_value(meta_of(&info, store)).map_err(internal)?;
    let gc_before = crate::gc::round_mark(&n.etcd)
        .await
        .map_err(|e| unavailable("reading the garbage collection's state", e))?;
    let scratch = store.staging_dir(name).map_err(internal)?;
    let archive = scratch.join("rootfs.tar");
    let packed = {
        let (rootfs, archive) = (info.rootfs.clone(), archive.clone());
        tokio::task::spawn_blocking(move || pack(&rootfs, &archive)).await
    };
    let put =
        match packed {
            Ok(Ok(())) => mover.chunks.put_file(&archive).await.map_err(|e| {
                unavailable(&format!("storing template \"{name}\" in object storage"), e)
            }),
            Ok(Err(e)) => Err(internal(e)),
            Err(e) => Err(internal(e)),
        };
    let put = match put {
        Ok(put) => put,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&scratch);
            return Err(e);
        }
    };
    let doc = TemplateFilesDoc {
        name: name.to_string(),
        key: info.key.clone(),
        meta,
        manifest: put.id,
        bytes: put.manifest.size,
        bytes_uploaded: put.bytes_uploaded,
        node: n.name.clone(),
        at_ms: now_ms(),
        upload_ms: started.elapsed().as_millis() as u64,
    };
    let recorded = n
        .etcd
        .put_template_files(&doc)
        .await
        .map_err(|e| unavailable("recording a template's files", e));
    // Chunks this upload found in the bucket may have been collected meanwhile.
    let settled = match recorded {
        Ok(()) => {
            let files = [(archive.clone(), doc.manifest.clone())];
            crate::gc::settle(&n.etcd, &mover.chunks, &gc_before, &files)
                .await
                .map(drop)
                .map_err(|e| unavailable("checking an upload against a garbage collection", e))
        }
        Err(e) => Err(e),
    };
    let _ = std::fs::remove_dir_all(&scratch);
    settled?;
    tracing::info!(template = name, key = %doc.key, mib = doc.bytes >> 20,
        uploaded_mib = doc.bytes_uploaded >> 20, ms = doc.upload_ms, "template stored in object storage");
    Ok(doc)
}

/// Makes sure this node holds the template of `template_id` (`name` or `name:tag`) before a
/// sandbox of it starts here: when it does not and the cluster stored the template in the
/// bucket, fetches and adopts it. A node without object storage, or a template nobody stored,
/// is left as it is (the create then says the template is not here).
pub(super) async fn ensure(n: &NodeApi, template_id: &str) -> Result<(), Error> {
    let (Some(mover), Some(store)) = (&n.mover, &n.templates) else {
        return Ok(());
    };
    let name = name_of(template_id);
    if check_name(name).is_err() || n.service.template(name).await.is_ok() {
        return Ok(());
    }
    let _one = n.template_files.lock().await;
    if n.service.template(name).await.is_ok() {
        return Ok(());
    }
    let Some(doc) = recorded(n, name).await? else {
        return Ok(());
    };
    let started = Instant::now();
    let got = fetch(&mover.chunks, &mover.cache, store, &doc).await;
    match &got {
        Ok(()) => tracing::info!(template = name, key = %doc.key, mib = doc.bytes >> 20,
            ms = started.elapsed().as_millis() as u64, "template fetched from object storage"),
        Err(e) => tracing::warn!(template = name, error = %e, "fetching a template"),
    }
    got
}

async fn fetch(
    chunks: &ChunkStore,
    cache: &ChunkCache,
    store: &Store,
    doc: &TemplateFilesDoc,
) -> Result<(), Error> {
    let staged = store.staging_dir(&doc.name).map_err(internal)?;
    let archive = staged.join("rootfs.tar");
    let fetching = cache.fetching().await;
    let got = chunks.get_file(&doc.manifest, &archive, cache.dir()).await;
    drop(fetching);
    if let Err(e) = got {
        let _ = std::fs::remove_dir_all(&staged);
        return Err(unavailable(
            &format!("fetching template \"{}\" from object storage", doc.name),
            e,
        ));
    }
    let (store, doc) = (store.clone(), doc.clone());
    let adopted = tokio::task::spawn_blocking(move || -> Result<(), String> {
        let unpacked = unpack(&archive, &staged.join("rootfs"))
            .and_then(|()| std::fs::remove_file(&archive))
            .and_then(|()| {
                let json = serde_json::to_vec_pretty(&doc.meta).map_err(std::io::Error::other)?;
                std::fs::write(staged.join("template.json"), json)
            });
        if let Err(e) = unpacked {
            let _ = std::fs::remove_dir_all(&staged);
            return Err(e.to_string());
        }
        store
            .adopt(&staged, &doc.name, &doc.key)
            .map(drop)
            .map_err(|e| e.to_string())
    })
    .await
    .map_err(internal)?;
    adopted.map_err(|e| Error::internal(format!("adopting a fetched template: {e}")))
}

async fn recorded(n: &NodeApi, name: &str) -> Result<Option<TemplateFilesDoc>, Error> {
    n.etcd
        .template_files(name)
        .await
        .map_err(|e| unavailable("reading where a template's files are", e))
}

/// What another node records of `info` as its `template.json`: the store's own record of a
/// build from the store, else one made of what the template says of itself.
fn meta_of(info: &TemplateInfo, store: &Store) -> Template {
    if let Ok(Some(t)) = store.get(&info.name, &info.key) {
        return t;
    }
    Template {
        name: info.name.clone(),
        key: info.key.clone(),
        recipe_hash: info.key.clone(),
        base_stage: None,
        agent_sha256: String::new(),
        dir: Default::default(),
        rootfs: Default::default(),
        ext4: Default::default(),
        user: info.user.clone(),
        workdir: info.workdir.clone(),
        env: info.env.clone(),
        start_cmd: info.start_cmd.clone(),
        ready_cmd: info.ready_cmd.clone(),
        memory_mb: info.memory_mb,
        disk_mb: info.disk_mb,
        built_at_unix: info.built_at_unix,
        size_bytes: info.size_bytes,
        build_secs: 0.0,
    }
}

/// The tree at `rootfs` as a tar archive at `out`: owners by number, modes, extended
/// attributes, links as links.
fn pack(rootfs: &Path, out: &Path) -> std::io::Result<()> {
    let mut c = Command::new("tar");
    c.arg("--create").arg("--file").arg(out);
    c.args(["--numeric-owner", "--xattrs", "--xattrs-include=*"]);
    c.arg("-C").arg(rootfs).arg(".");
    run(c, "packing a template")
}

/// The archive at `archive` unpacked into `into` (made here) with owners, modes and
/// extended attributes as archived.
fn unpack(archive: &Path, into: &Path) -> std::io::Result<()> {
    std::fs::create_dir(into)?;
    let mut c = Command::new("tar");
    c.arg("--extract").arg("--file").arg(archive);
    c.args([
        "--numeric-owner",
        "--same-owner",
        "--same-permissions",
        "--xattrs",
        "--xattrs-include=*",
    ]);
    c.arg("-C").arg(into);
    run(c, "unpacking a template")
}

fn run(mut c: Command, what: &str) -> std::io::Result<()> {
    let out = c.output()?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let last = err.lines().last().unwrap_or("").to_string();
    Err(std::io::Error::other(format!(
        "{what}: tar exited with {}: {last}",
        out.status
    )))
}

fn internal(e: impl std::fmt::Display) -> Error {
    tracing::warn!(error = %e, "a template's files");
    Error::internal("handling a template's files on the node failed; see the node's log")
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> Error {
    tracing::warn!(error = %e, "{what}");
    Error::Unavailable(format!("{what}: object storage or etcd failed; retry"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packed_tree_unpacks_with_its_links_and_modes() {
        use std::os::unix::fs::{symlink, PermissionsExt};
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        std::fs::create_dir_all(root.join("usr/bin")).unwrap();
        std::fs::write(root.join("usr/bin/tool"), "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(
            root.join("usr/bin/tool"),
            std::fs::Permissions::from_mode(0o751),
        )
        .unwrap();
        symlink("usr/bin", root.join("bin")).unwrap();
        symlink("./tool", root.join("usr/bin/again")).unwrap();
        let archive = t.path().join("a.tar");
        pack(&root, &archive).unwrap();
        let into = t.path().join("out");
        unpack(&archive, &into).unwrap();
        let mode = std::fs::metadata(into.join("usr/bin/tool"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o751);
        assert_eq!(
            std::fs::read_link(into.join("bin")).unwrap(),
            Path::new("usr/bin")
        );
        assert_eq!(
            std::fs::read_link(into.join("usr/bin/again")).unwrap(),
            Path::new("./tool")
        );
        assert!(
            unpack(&archive, &into).is_err(),
            "unpacks only into a new directory"
        );
        let e = pack(&t.path().join("missing"), &t.path().join("b.tar")).unwrap_err();
        assert!(e.to_string().contains("packing a template"), "{e}");
    }
}
