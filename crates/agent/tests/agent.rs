//! Integration tests: start the real `kiln-agent` binary on a temp Unix socket (and a random TCP
//! port) and drive it with `kiln_envd::EnvdClient` and raw HTTP (helpers in `common`).

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{envelope, json_envelopes, opts, raw, raw_h, start, DecodeMsg};
use kiln_envd::{EnvdClient, EnvdError};
use kiln_proto::envd::InitRequest;
use kiln_proto::filesystem as fspb;
use kiln_proto::process as pb;

#[tokio::test]
async fn run_collects_stdout_stderr_exit_code() {
    let (_a, c) = start().await;
    let out = c
        .run("echo out; echo err >&2; exit 3", opts())
        .await
        .unwrap();
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");
    assert_eq!(out.exit_code, 3);
}

#[tokio::test]
async fn run_env_cwd_and_init_env() {
    let (a, c) = start().await;
    c.init(&InitRequest {
        env_vars: Some(HashMap::from([("FROM_INIT".into(), "yes".into())])),
        ..Default::default()
    })
    .await
    .unwrap();
    let mut o = opts();
    o.envs.insert("FOO".into(), "bar baz".into());
    o.cwd = Some(a.dir.path().to_string_lossy().into_owned());
    let out = c.run("echo \"$FOO|$FROM_INIT|$(pwd)\"", o).await.unwrap();
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        format!("bar baz|yes|{}", a.dir.path().display())
    );
}

#[tokio::test]
async fn run_as_other_user() {
    let (_a, c) = start().await;
    if !kiln_testkit::needs().root("switching users").ok() {
        return;
    }
    let mut o = opts();
    o.user = Some("nobody".into());
    let out = c.run("id -un; echo $HOME", o).await.unwrap();
    let s = String::from_utf8(out.stdout).unwrap();
    assert!(s.starts_with("nobody\n"), "{s}");
    let mut o = opts();
    o.user = Some("no-such-user-kiln".into());
    let e = c.run("true", o).await.unwrap_err();
    assert_eq!(e.rpc_code(), Some("unauthenticated"), "{e}");
}

#[tokio::test]
async fn files_roundtrip_and_errors() {
    let (a, c) = start().await;
    let p = a.dir.path().join("sub/dir/file.bin");
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    c.write_file(p.to_str().unwrap(), data.clone(), None)
        .await
        .unwrap();
    assert_eq!(c.read_file(p.to_str().unwrap(), None).await.unwrap(), data);
    // overwrite with shorter content
    c.write_file(p.to_str().unwrap(), b"short".to_vec(), None)
        .await
        .unwrap();
    assert_eq!(
        c.read_file(p.to_str().unwrap(), None).await.unwrap(),
        b"short"
    );
    match c
        .read_file(a.dir.path().join("missing").to_str().unwrap(), None)
        .await
    {
        Err(EnvdError::Status { status: 404, .. }) => {}
        other => panic!("expected 404, got {other:?}"),
    }
    match c.read_file(a.dir.path().to_str().unwrap(), None).await {
        Err(EnvdError::Status { status: 400, .. }) => {}
        other => panic!("expected 400 for a directory, got {other:?}"),
    }
}

#[tokio::test]
async fn access_token_required_after_init() {
    let (a, c) = start().await;
    c.init(&InitRequest {
        access_token: Some("s3cret".into()),
        ..Default::default()
    })
    .await
    .unwrap();
    c.health().await.unwrap();
    let e = c.run("true", opts()).await.unwrap_err();
    assert!(
        matches!(&e, EnvdError::Rpc { code, .. } if code == "unauthenticated"),
        "{e}"
    );
    let e = c.read_file("/etc/hostname", None).await.unwrap_err();
    assert!(matches!(e, EnvdError::Status { status: 401, .. }), "{e}");
    let authed =
        EnvdClient::tcp(([127, 0, 0, 1], a.port).into()).with_access_token(Some("s3cret".into()));
    assert_eq!(authed.run("echo ok", opts()).await.unwrap().stdout, b"ok\n");
    // signed URL, computed like the SDK does
    let path = a.dir.path().join("signed.txt");
    authed
        .write_file(path.to_str().unwrap(), b"signed".to_vec(), None)
        .await
        .unwrap();
    let sig = kiln_agent::file_url_signature(path.to_str().unwrap(), "read", "", "s3cret", None);
    let (status, body) = raw(
        &a,
        "GET",
        &format!(
            "/files?path={}&signature={}",
            kiln_envd::urlencode(path.to_str().unwrap()),
            kiln_envd::urlencode(&sig)
        ),
        "",
        b"",
    )
    .await;
    assert_eq!((status, body.as_slice()), (200, b"signed".as_slice()));
    let (status, _) = raw(
        &a,
        "GET",
        &format!(
            "/files?path={}&signature=v1_bogus",
            kiln_envd::urlencode(path.to_str().unwrap())
        ),
        "",
        b"",
    )
    .await;
    assert_eq!(status, 401);
}

#[tokio::test]
async fn bad_input_gets_connect_errors_and_agent_survives() {
    let (a, c) = start().await;
    let (s, b) = raw(
        &a,
        "POST",
        "/process.Process/List",
        "application/json",
        b"{not json",
    )
    .await;
    assert_eq!(s, 400);
    assert!(String::from_utf8_lossy(&b).contains("invalid_argument"));
    let (s, _) = raw(
        &a,
        "POST",
        "/filesystem.Filesystem/Stat",
        "application/proto",
        &[0xff, 0xff, 0xff],
    )
    .await;
    assert_eq!(s, 400);
    let (s, b) = raw(
        &a,
        "POST",
        "/process.Process/Nope",
        "application/json",
        b"{}",
    )
    .await;
    assert_eq!(s, 501);
    assert!(String::from_utf8_lossy(&b).contains("unimplemented"));
    let (s, b) = raw(
        &a,
        "POST",
        "/process.Process/SendSignal",
        "application/json",
        br#"{"process":{"pid":999999},"signal":"SIGNAL_SIGKILL"}"#,
    )
    .await;
    assert_eq!(s, 404, "{}", String::from_utf8_lossy(&b));
    assert!(String::from_utf8_lossy(&b).contains("not_found"));
    // streaming call with a truncated envelope
    let (s, b) = raw(
        &a,
        "POST",
        "/process.Process/Start",
        "application/connect+json",
        &[0, 0, 0, 0, 50, b'{'],
    )
    .await;
    assert_eq!(s, 200);
    assert!(
        String::from_utf8_lossy(&b).contains("invalid_argument"),
        "{}",
        String::from_utf8_lossy(&b)
    );
    // client that disconnects mid-stream
    {
        let req = pb::StartRequest {
            process: Some(pb::ProcessConfig {
                cmd: "/bin/sh".into(),
                args: vec!["-c".into(), "yes".into()],
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut st = c
            .server_stream("/process.Process/Start", &req, None, None, None)
            .await
            .unwrap();
        st.next_message().await.unwrap();
        st.next_message().await.unwrap();
        let list: pb::ListResponse = c
            .unary("/process.Process/List", &pb::ListRequest {}, None)
            .await
            .unwrap();
        let pid = list
            .processes
            .iter()
            .find(|p| {
                p.config
                    .as_ref()
                    .map(|c| c.args.contains(&"yes".to_string()))
                    .unwrap_or(false)
            })
            .unwrap()
            .pid;
        drop(st);
        tokio::time::sleep(Duration::from_millis(200)).await;
        // the unobserved process keeps running without blocking; kill it
        let _: pb::SendSignalResponse = c
            .unary(
                "/process.Process/SendSignal",
                &pb::SendSignalRequest {
                    process: Some(pb::ProcessSelector {
                        selector: Some(pb::process_selector::Selector::Pid(pid)),
                    }),
                    signal: pb::Signal::Sigkill as i32,
                },
                None,
            )
            .await
            .unwrap();
    }
    assert_eq!(
        c.run("echo still-here", opts()).await.unwrap().stdout,
        b"still-here\n"
    );
}

#[tokio::test]
async fn background_reconnect_and_kill_status() {
    let (_a, c) = start().await;
    let req = pb::StartRequest {
        process: Some(pb::ProcessConfig {
            cmd: "/bin/bash".into(),
            args: vec![
                "-c".into(),
                "for i in 1 2 3 4 5 6 7 8 9 10; do echo tick$i; sleep 0.2; done; sleep 30".into(),
            ],
            ..Default::default()
        }),
        tag: Some("bg".into()),
        stdin: Some(false),
        ..Default::default()
    };
    let mut st = c
        .server_stream("/process.Process/Start", &req, None, None, None)
        .await
        .unwrap();
    let first = pb::StartResponse::decode_msg(st.next_message().await.unwrap().unwrap());
    let pid = match first.event.unwrap().event.unwrap() {
        pb::process_event::Event::Start(s) => s.pid,
        e => panic!("expected start, got {e:?}"),
    };
    drop(st);
    // re-attach by tag
    let creq = pb::ConnectRequest {
        process: Some(pb::ProcessSelector {
            selector: Some(pb::process_selector::Selector::Tag("bg".into())),
        }),
    };
    let mut st = c
        .server_stream("/process.Process/Connect", &creq, None, None, None)
        .await
        .unwrap();
    let mut saw_tick = false;
    while let Some(m) = st.next_message().await.unwrap() {
        let r = pb::ConnectResponse::decode_msg(m);
        if let Some(pb::process_event::Event::Data(d)) = r.event.and_then(|e| e.event) {
            if let Some(pb::process_event::data_event::Output::Stdout(b)) = d.output {
                if String::from_utf8_lossy(&b).contains("tick") {
                    saw_tick = true;
                    break;
                }
            }
        }
    }
    assert!(saw_tick);
    let _: pb::SendSignalResponse = c
        .unary(
            "/process.Process/SendSignal",
            &pb::SendSignalRequest {
                process: Some(pb::ProcessSelector {
                    selector: Some(pb::process_selector::Selector::Pid(pid)),
                }),
                signal: pb::Signal::Sigkill as i32,
            },
            None,
        )
        .await
        .unwrap();
    let mut end = None;
    while let Some(m) = st.next_message().await.unwrap() {
        if let Some(pb::process_event::Event::End(e)) = pb::ConnectResponse::decode_msg(m)
            .event
            .and_then(|e| e.event)
        {
            end = Some(e);
        }
    }
    let end = end.expect("end event");
    assert!(!end.exited);
    assert_eq!(end.status, "signal: killed");
}

#[tokio::test]
async fn filesystem_rpcs_binary_protobuf() {
    let (a, c) = start().await;
    let root = a.dir.path().join("fs");
    let r: fspb::MakeDirResponse = c
        .unary(
            "/filesystem.Filesystem/MakeDir",
            &fspb::MakeDirRequest {
                path: root.join("a/b").to_string_lossy().into(),
            },
            None,
        )
        .await
        .unwrap();
    assert_eq!(r.entry.unwrap().r#type, fspb::FileType::Directory as i32);
    let e = c
        .unary::<_, fspb::MakeDirResponse>(
            "/filesystem.Filesystem/MakeDir",
            &fspb::MakeDirRequest {
                path: root.join("a/b").to_string_lossy().into(),
            },
            None,
        )
        .await
        .unwrap_err();
    assert_eq!(e.rpc_code(), Some("already_exists"));
    c.write_file(
        root.join("a/b/f.txt").to_str().unwrap(),
        b"x".to_vec(),
        None,
    )
    .await
    .unwrap();
    let l: fspb::ListDirResponse = c
        .unary(
            "/filesystem.Filesystem/ListDir",
            &fspb::ListDirRequest {
                path: root.to_string_lossy().into(),
                depth: 1,
            },
            None,
        )
        .await
        .unwrap();
    assert_eq!(
        l.entries
            .iter()
            .map(|e| e.name.as_str())
            .collect::<Vec<_>>(),
        vec!["a"]
    );
    let l: fspb::ListDirResponse = c
        .unary(
            "/filesystem.Filesystem/ListDir",
            &fspb::ListDirRequest {
                path: root.to_string_lossy().into(),
                depth: 3,
            },
            None,
        )
        .await
        .unwrap();
    assert_eq!(l.entries.len(), 3);
    let m: fspb::MoveResponse = c
        .unary(
            "/filesystem.Filesystem/Move",
            &fspb::MoveRequest {
                source: root.join("a/b/f.txt").to_string_lossy().into(),
                destination: root.join("g.txt").to_string_lossy().into(),
            },
            None,
        )
        .await
        .unwrap();
    assert_eq!(m.entry.unwrap().size, 1);
    let _: fspb::RemoveResponse = c
        .unary(
            "/filesystem.Filesystem/Remove",
            &fspb::RemoveRequest {
                path: root.join("a").to_string_lossy().into(),
            },
            None,
        )
        .await
        .unwrap();
    let e = c
        .unary::<_, fspb::StatResponse>(
            "/filesystem.Filesystem/Stat",
            &fspb::StatRequest {
                path: root.join("a").to_string_lossy().into(),
            },
            None,
        )
        .await
        .unwrap_err();
    assert_eq!(e.rpc_code(), Some("not_found"));
}

#[tokio::test]
async fn sigterm_stops_agent_and_children() {
    let (mut a, c) = start().await;
    let req = pb::StartRequest {
        process: Some(pb::ProcessConfig {
            cmd: "/bin/sleep".into(),
            args: vec!["60".into()],
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut st = c
        .server_stream("/process.Process/Start", &req, None, None, None)
        .await
        .unwrap();
    let pid = match pb::StartResponse::decode_msg(st.next_message().await.unwrap().unwrap())
        .event
        .unwrap()
        .event
        .unwrap()
    {
        pb::process_event::Event::Start(s) => s.pid,
        e => panic!("{e:?}"),
    };
    // SAFETY: sending SIGTERM to the agent we started.
    unsafe { libc::kill(a.child.id() as i32, libc::SIGTERM) };
    let start = std::time::Instant::now();
    loop {
        if let Some(st) = a.child.try_wait().unwrap() {
            assert!(st.success(), "agent exit status {st:?}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "agent did not stop on SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // the child was terminated (it is reaped by us or gone)
    // SAFETY: probing a pid with signal 0.
    let alive = unsafe { libc::kill(pid as i32, 0) } == 0
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z");
    assert!(!alive, "child {pid} survived agent shutdown");
}

#[tokio::test]
async fn keepalive_events_and_json_streaming() {
    let (a, _c) = start().await;
    let msg =
        br#"{"process":{"cmd":"/bin/sh","args":["-c","sleep 2.5; echo done"]},"stdin":false}"#;
    let env = envelope(msg);
    let (s, body) = raw_h(
        &a,
        "POST",
        "/process.Process/Start",
        "application/connect+json",
        &[("keepalive-ping-interval", "1")],
        &env,
    )
    .await;
    assert_eq!(s, 200);
    let mut kinds = Vec::new();
    for (flags, v) in json_envelopes(&body) {
        if flags & 2 != 0 {
            assert!(v.get("error").is_none(), "stream ended with error: {v}");
            kinds.push("END_STREAM".to_string());
        } else {
            kinds.push(
                v["event"]
                    .as_object()
                    .unwrap()
                    .keys()
                    .next()
                    .unwrap()
                    .clone(),
            );
        }
    }
    assert_eq!(kinds.first().map(String::as_str), Some("start"));
    assert!(
        kinds.iter().filter(|k| *k == "keepalive").count() >= 2,
        "{kinds:?}"
    );
    assert_eq!(
        &kinds[kinds.len() - 2..],
        &["end".to_string(), "END_STREAM".to_string()]
    );
}

/// A server-streaming call whose request body ends only after the answer has started (as the
/// SDK's streaming client may do under load) still delivers the whole answer, 3 MB of output,
/// with its end-of-stream message.
#[tokio::test]
async fn late_request_end_does_not_reset_a_long_stream() {
    use base64::Engine;
    use std::io::{Read, Write};

    let (agent, _c) = start().await;
    let sock = agent.sock.clone();
    let total = tokio::task::spawn_blocking(move || {
        let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let msg = serde_json::json!({"process": {"cmd": "/bin/bash", "args": ["-c",
            "echo start; sleep 0.3; head -c 3000000 /dev/zero | tr '\\0' a"]}})
        .to_string();
        let env = envelope(msg.as_bytes());
        let head = "POST /process.Process/Start HTTP/1.1\r\nHost: agent\r\nContent-Type: application/connect+json\r\nConnect-Protocol-Version: 1\r\nTransfer-Encoding: chunked\r\n\r\n";
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(format!("{:x}\r\n", env.len()).as_bytes()).unwrap();
        s.write_all(&env).unwrap();
        s.write_all(b"\r\n").unwrap();

        let mut raw = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        let mut sent_end = false;
        loop {
            let n = s.read(&mut buf).unwrap_or_else(|e| {
                panic!("reading the stream failed after {} bytes: {e}", raw.len())
            });
            if n == 0 {
                break;
            }
            raw.extend_from_slice(&buf[..n]);
            if !sent_end && raw.windows(5).any(|w| w == b"start" || w == b"c3Rhc") {
                // The answer has begun: only now end the request body.
                s.write_all(b"0\r\n\r\n").unwrap();
                sent_end = true;
            }
            // Stop once the chunked answer has ended.
            if raw.ends_with(b"\r\n0\r\n\r\n") {
                break;
            }
        }
        assert!(sent_end, "never saw the start of the answer");
        // De-chunk, then walk the envelopes and add up stdout bytes.
        let body_start = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        let head = String::from_utf8_lossy(&raw[..body_start]).to_string();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let mut body = Vec::new();
        let mut rest = &raw[body_start..];
        loop {
            let line_end = rest.windows(2).position(|w| w == b"\r\n").unwrap();
            let size = usize::from_str_radix(std::str::from_utf8(&rest[..line_end]).unwrap(), 16).unwrap();
            rest = &rest[line_end + 2..];
            if size == 0 {
                break;
            }
            body.extend_from_slice(&rest[..size]);
            rest = &rest[size + 2..];
        }
        let mut stdout = 0usize;
        let mut ended = false;
        for (flags, m) in json_envelopes(&body) {
            if flags & 2 != 0 {
                ended = true;
                assert!(m.get("error").is_none(), "stream ended with an error: {m}");
            } else if let Some(d) = m.pointer("/event/data/stdout").and_then(|v| v.as_str()) {
                stdout += base64::engine::general_purpose::STANDARD.decode(d).unwrap().len();
            }
        }
        assert!(ended, "no end-of-stream message");
        stdout
    })
    .await
    .unwrap();
    assert_eq!(total, "start\n".len() + 3_000_000);
}

/// A program a command leaves running (an application a launcher started) may write to the
/// command's stdout after the command ended: it must not die of a closed pipe.
#[tokio::test]
async fn a_background_child_outlives_its_command_and_may_still_write() {
    let (_a, c) = start().await;
    let dir = tempfile::tempdir().unwrap();
    let done = dir.path().join("done");
    let script = format!(
        "(sleep 0.5; echo late; echo late >&2; touch {}) & echo started",
        done.display()
    );
    let out = c.run(&script, opts()).await.unwrap();
    assert_eq!(
        (out.exit_code, out.stdout.as_slice()),
        (0, &b"started\n"[..])
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the background child died writing to its finished command's output"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
