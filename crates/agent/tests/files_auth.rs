//! `/files` and filesystem RPC edges: signed URLs bind the user, the path and every multipart
//! file name; removing a missing path succeeds as in E2B; a symlink's info is its target's.

mod common;

use std::os::unix::fs::MetadataExt;

use common::{raw, raw_h, start};
use kiln_proto::envd::InitRequest;
use kiln_proto::filesystem as fspb;

const TOKEN: &str = "s3cret";

fn signed(path: &str, op: &str, user: &str) -> String {
    let sig = kiln_agent::file_url_signature(path, op, user, TOKEN, None);
    let mut q = format!(
        "/files?path={}&signature={}",
        kiln_envd::urlencode(path),
        kiln_envd::urlencode(&sig)
    );
    if !user.is_empty() {
        q.push_str(&format!("&username={}", kiln_envd::urlencode(user)));
    }
    q
}

fn basic(user: &str) -> String {
    use base64::Engine;
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{user}:"))
    )
}

#[tokio::test]
async fn signed_url_with_empty_user_ignores_an_authorization_header() {
    if !kiln_testkit::needs().root("acting as another user").ok() {
        return;
    }
    let (a, c) = start().await;
    c.init(&InitRequest {
        access_token: Some(TOKEN.into()),
        ..Default::default()
    })
    .await
    .unwrap();
    // The agent runs as root: the default user of an empty `username` is root. A header naming
    // `nobody` must not change who the signed request acts as.
    let p = a.dir.path().join("signed-upload.txt");
    let ps = p.to_str().unwrap();
    let auth = basic("nobody");
    let (s, b) = raw_h(
        &a,
        "POST",
        &signed(ps, "write", ""),
        "application/octet-stream",
        &[("authorization", &auth)],
        b"data",
    )
    .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(std::fs::metadata(&p).unwrap().uid(), 0);
    let (s, b) = raw_h(
        &a,
        "GET",
        &signed(ps, "read", ""),
        "",
        &[("authorization", &auth)],
        b"",
    )
    .await;
    assert_eq!((s, b.as_slice()), (200, b"data".as_slice()));
    // A signature made for the empty user does not work for a named one, and vice versa.
    let wrong = signed(ps, "read", "").replace("/files?", "/files?username=nobody&");
    assert_eq!(raw(&a, "GET", &wrong, "", b"").await.0, 401);
    let (s, _) = raw(&a, "GET", &signed(ps, "write", ""), "", b"").await;
    assert_eq!(s, 401, "a write signature must not allow reads");
}

#[tokio::test]
async fn signed_multipart_upload_writes_only_the_signed_path() {
    let (a, c) = start().await;
    c.init(&InitRequest {
        access_token: Some(TOKEN.into()),
        ..Default::default()
    })
    .await
    .unwrap();
    let p = a.dir.path().join("signed.txt");
    let evil = a.dir.path().join("not-signed.txt");
    let body = format!(
        "--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"first.txt\"\r\n\r\none\r\n\
         --XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{}\"\r\n\r\ntwo\r\n--XyZ--\r\n",
        evil.display()
    );
    let (s, b) = raw(
        &a,
        "POST",
        &signed(p.to_str().unwrap(), "write", ""),
        "multipart/form-data; boundary=XyZ",
        body.as_bytes(),
    )
    .await;
    assert_eq!(s, 401, "{}", String::from_utf8_lossy(&b));
    assert!(String::from_utf8_lossy(&b).contains("signature"));
    assert!(!evil.exists(), "a part outside the signature was written");
    assert_eq!(std::fs::read(&p).unwrap(), b"one");

    // With the token itself, later parts still go to their own file names (unchanged).
    let (s, b) = raw_h(
        &a,
        "POST",
        &format!("/files?path={}", kiln_envd::urlencode(p.to_str().unwrap())),
        "multipart/form-data; boundary=XyZ",
        &[("x-access-token", TOKEN)],
        body.as_bytes(),
    )
    .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(std::fs::read(&evil).unwrap(), b"two");
}

#[tokio::test]
async fn removing_a_missing_path_succeeds() {
    let (a, c) = start().await;
    let missing = a.dir.path().join("never-existed");
    let _: fspb::RemoveResponse = c
        .unary(
            "/filesystem.Filesystem/Remove",
            &fspb::RemoveRequest {
                path: missing.to_string_lossy().into(),
            },
            None,
        )
        .await
        .expect("removing a missing path succeeds");
    // Other errors still are errors: a path below a regular file.
    let file = a.dir.path().join("plain");
    std::fs::write(&file, b"x").unwrap();
    let e = c
        .unary::<_, fspb::RemoveResponse>(
            "/filesystem.Filesystem/Remove",
            &fspb::RemoveRequest {
                path: file.join("below").to_string_lossy().into(),
            },
            None,
        )
        .await
        .unwrap_err();
    assert_eq!(e.rpc_code(), Some("invalid_argument"), "{e}");
    assert!(file.exists());
}

#[tokio::test]
async fn stat_of_a_symlink_reports_the_target() {
    let (a, c) = start().await;
    let target = a.dir.path().join("target.bin");
    std::fs::write(&target, b"twelve bytes").unwrap();
    std::fs::set_permissions(&target, std::os::unix::fs::PermissionsExt::from_mode(0o640)).unwrap();
    let old = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
    std::fs::File::options()
        .write(true)
        .open(&target)
        .unwrap()
        .set_modified(old)
        .unwrap();
    let link = a.dir.path().join("link.bin");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let stat = |p: &std::path::Path| {
        let c = c.clone();
        let path = p.to_string_lossy().into_owned();
        async move {
            let r: fspb::StatResponse = c
                .unary(
                    "/filesystem.Filesystem/Stat",
                    &fspb::StatRequest { path },
                    None,
                )
                .await
                .unwrap();
            r.entry.unwrap()
        }
    };
    let t = stat(&target).await;
    let l = stat(&link).await;
    assert!(l.is_symlink && !t.is_symlink);
    assert_eq!(
        l.symlink_target.as_deref(),
        Some(std::fs::canonicalize(&target).unwrap().to_str().unwrap())
    );
    assert_eq!(
        (l.name.as_str(), l.path.as_str()),
        ("link.bin", link.to_str().unwrap())
    );
    assert_eq!(l.r#type, fspb::FileType::File as i32);
    assert_eq!(
        (l.size, l.mode, l.permissions.as_str()),
        (12, 0o640, "-rw-r-----")
    );
    assert_eq!((&l.owner, &l.group), (&t.owner, &t.group));
    assert_eq!(l.modified_time.unwrap().seconds, 1_000_000_000);

    // A dangling link still answers, as a file described by the link itself.
    let dangling = a.dir.path().join("dangling");
    std::os::unix::fs::symlink(a.dir.path().join("gone"), &dangling).unwrap();
    let d = stat(&dangling).await;
    assert!(d.is_symlink);
    assert_eq!(d.r#type, fspb::FileType::File as i32);
}
