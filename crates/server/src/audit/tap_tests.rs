//! Unit tests of the proxy tap's parsing.

use super::*;

#[test]
fn multipart_payload_is_the_part_without_framing() {
    let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n\
Content-Type: application/octet-stream\r\n\r\nhello world\r\n--XyZ--\r\n";
    let u = Upload::default();
    *u.edges.lock().unwrap() = (body.to_vec(), body.to_vec());
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
        assert_eq!(t.fields["cmd"], "/bin/bash");
        assert_eq!(t.fields["args"], json!(["-c", "echo hi"]));
        assert_eq!(t.fields["envNames"], json!(["SECRET"]), "names only");
        assert!(!t.fields.values().any(|v| v == "value"));
        assert_eq!(t.fields["cwd"], "/tmp");
    }
}
