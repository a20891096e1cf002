//! Unit tests of the proxy tap's parsing.

use super::*;
use crate::audit::tap_record::EDGE;

#[test]
fn multipart_payload_is_the_part_without_framing() {
    let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n\
Content-Type: application/octet-stream\r\n\r\nhello world\r\n--XyZ--\r\n";
    let u = Upload::whole(body);
    assert_eq!(multipart_payload("XyZ", &u, body.len() as u64), Some(11));
    assert_eq!(multipart_payload("nope", &u, body.len() as u64), None);
}

#[test]
fn query_user_and_codes() {
    let uri: Uri = "/files?path=%2Fhome%2Fuser%2Fa%20b.txt&username=root"
        .parse()
        .unwrap();
    assert_eq!(
        query_param(&uri, "path").as_deref(),
        Some("/home/user/a b.txt")
    );
    assert_eq!(query_param(&uri, "username").as_deref(), Some("root"));
    assert_eq!(query_param(&uri, "x"), None);
    let mut h = HeaderMap::new();
    assert_eq!(basic_user(&h), None);
    h.insert(header::AUTHORIZATION, "Basic dXNlcjo=".parse().unwrap());
    assert_eq!(basic_user(&h).as_deref(), Some("user"));
    assert_eq!(code_of(StatusCode::OK), "ok");
    assert_eq!(code_of(StatusCode::FORBIDDEN), "permission_denied");
    assert_eq!(files_result(StatusCode::NOT_FOUND), "not_found");
    assert_eq!(files_result(StatusCode::INSUFFICIENT_STORAGE), "no_space");
    assert_eq!(files_result(StatusCode::IM_A_TEAPOT), "http_418");
}

#[test]
fn start_requests_are_read_from_json_and_proto_envelopes() {
    let req = pb::StartRequest {
        process: Some(pb::ProcessConfig {
            cmd: "/bin/bash".into(),
            args: vec!["-c".into(), "echo hi".into()],
            envs: [("SECRET".to_string(), "value".to_string())].into(),
            cwd: Some("/tmp".into()),
        }),
        pty: None,
        tag: None,
        stdin: Some(false),
    };
    for (ct, payload) in [
        (
            "application/connect+proto",
            prost::Message::encode_to_vec(&req),
        ),
        (
            "application/connect+json",
            serde_json::to_vec(&req).unwrap(),
        ),
    ] {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, ct.parse().unwrap());
        let log = AuditLog(Some(Arc::new(super::super::tests_support::inner())));
        let uri: Uri = "/process.Process/Start".parse().unwrap();
        let mut t = Tap::begin(&log, "s", &Method::POST, &uri, &h).unwrap();
        t.request(&kiln_proto::framing::encode(0, &payload));
        assert_eq!(t.rec.fields["cmd"], "/bin/bash");
        assert_eq!(t.rec.fields["args"], json!(["-c", "echo hi"]));
        assert_eq!(t.rec.fields["envNames"], json!(["SECRET"]), "names only");
        assert!(!t.rec.fields.values().any(|v| v == "value"));
        assert_eq!(t.rec.fields["cwd"], "/tmp");
    }
}

#[test]
fn a_streamed_upload_keeps_its_first_and_last_bytes() {
    let body: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
    for frame in [1usize, 100, 4096, EDGE, EDGE + 1, 30_000, 100_000] {
        let u = Upload::default();
        for c in body.chunks(frame) {
            u.push(&bytes::Bytes::copy_from_slice(c));
        }
        assert_eq!(u.bytes.load(Ordering::Relaxed), body.len() as u64);
        assert_eq!(u.head(), body[..EDGE].to_vec(), "frames of {frame}");
        assert_eq!(
            u.tail(),
            body[body.len() - EDGE..].to_vec(),
            "frames of {frame}"
        );
    }
    let small = Upload::default();
    small.push(&bytes::Bytes::from_static(b"abc"));
    small.push(&bytes::Bytes::from_static(b"de"));
    assert_eq!(
        (small.head(), small.tail()),
        (b"abcde".to_vec(), b"abcde".to_vec())
    );
    let whole = Upload::whole(&body);
    assert_eq!(whole.head(), body[..EDGE].to_vec());
    assert_eq!(whole.tail(), body[body.len() - EDGE..].to_vec());
}
