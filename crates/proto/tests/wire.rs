//! The generated types speak the same proto3 JSON and binary wire format as the e2b SDK.

use kiln_proto::filesystem as fspb;
use kiln_proto::process as pb;
use prost::Message;

#[test]
fn start_request_json_as_the_sdk_sends_it() {
    // Shape produced by the SDK's `StartRequest(...).to_json()`.
    let j = r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"},"cwd":"/tmp"},"stdin":false,"tag":"t"}"#;
    let r: pb::StartRequest = serde_json::from_str(j).unwrap();
    let p = r.process.unwrap();
    assert_eq!(p.args, vec!["-l", "-c", "echo hi"]);
    assert_eq!(p.envs.get("A").map(String::as_str), Some("1"));
    assert_eq!(p.cwd.as_deref(), Some("/tmp"));
    assert_eq!(r.stdin, Some(false));
    assert_eq!(r.tag.as_deref(), Some("t"));
}

#[test]
fn process_event_json_uses_base64_bytes_and_camel_case() {
    let ev = pb::StartResponse {
        event: Some(pb::ProcessEvent {
            event: Some(pb::process_event::Event::Data(
                pb::process_event::DataEvent {
                    output: Some(pb::process_event::data_event::Output::Stdout(
                        b"hi\n".to_vec(),
                    )),
                },
            )),
        }),
    };
    assert_eq!(
        serde_json::to_string(&ev).unwrap(),
        r#"{"event":{"data":{"stdout":"aGkK"}}}"#
    );
    let end = pb::process_event::EndEvent {
        exit_code: -1,
        exited: false,
        status: "signal: killed".into(),
        error: None,
    };
    assert_eq!(
        serde_json::to_string(&end).unwrap(),
        r#"{"exitCode":-1,"status":"signal: killed"}"#
    );
}

#[test]
fn selector_and_signal_enum_json() {
    let r: pb::SendSignalRequest =
        serde_json::from_str(r#"{"process":{"pid":42},"signal":"SIGNAL_SIGKILL"}"#).unwrap();
    assert_eq!(r.signal, pb::Signal::Sigkill as i32);
    assert_eq!(
        r.process.unwrap().selector,
        Some(pb::process_selector::Selector::Pid(42))
    );
    // numeric enum values are accepted too
    let r: pb::SendSignalRequest =
        serde_json::from_str(r#"{"process":{"tag":"x"},"signal":15}"#).unwrap();
    assert_eq!(r.signal, pb::Signal::Sigterm as i32);
}

#[test]
fn entry_info_json_and_binary_field_numbers() {
    let e = fspb::EntryInfo {
        name: "f".into(),
        r#type: fspb::FileType::File as i32,
        path: "/f".into(),
        size: 5,
        modified_time: Some(pbjson_types::Timestamp {
            seconds: 0,
            nanos: 0,
        }),
        ..Default::default()
    };
    let v: serde_json::Value = serde_json::to_value(&e).unwrap();
    assert_eq!(v["type"], "FILE_TYPE_FILE");
    assert_eq!(v["size"], "5"); // int64 is a string in proto3 JSON
    assert_eq!(v["modifiedTime"], "1970-01-01T00:00:00+00:00");
    // field 1 (name) = tag 0x0a, field 2 (type) = 0x10, field 3 (path) = 0x1a, field 4 (size) = 0x20
    let b = e.encode_to_vec();
    assert_eq!(&b[..3], &[0x0a, 1, b'f']);
    assert_eq!(&b[3..5], &[0x10, 1]);
    assert_eq!(&b[5..8], &[0x1a, 2, b'/']);
}

#[test]
fn init_request_field_names() {
    let r = kiln_proto::envd::InitRequest {
        env_vars: Some([("A".to_string(), "1".to_string())].into()),
        access_token: Some("t".into()),
        default_user: Some("user".into()),
        default_workdir: Some("/home/user".into()),
        timestamp: Some("2024-01-01T00:00:00Z".into()),
        hyperloop_ip: None,
        extra_cas: Some(vec!["PEM".into()]),
    };
    let v = serde_json::to_value(&r).unwrap();
    for k in [
        "envVars",
        "accessToken",
        "defaultUser",
        "defaultWorkdir",
        "timestamp",
        "kilnExtraCas",
    ] {
        assert!(v.get(k).is_some(), "missing {k} in {v}");
    }
}

#[test]
fn unknown_json_fields_are_ignored_for_forward_compatibility() {
    let r: fspb::ListDirRequest =
        serde_json::from_str(r#"{"path":"/x","depth":2,"someFutureField":true}"#).unwrap();
    assert_eq!((r.path.as_str(), r.depth), ("/x", 2));
}
