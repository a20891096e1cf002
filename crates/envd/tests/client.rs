//! EnvdClient against a scripted envd served over an in-memory duplex stream (a custom
//! `Connector`, proving the client does not care about the transport) and over a Unix socket.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use kiln_envd::{BoxIo, Connector, EnvdClient, EnvdError, ProcessEvent};
use kiln_proto::connect::{Code, ErrorBody};
use kiln_proto::framing;
use kiln_proto::process as pb;
use prost::Message;

type Seen = Arc<Mutex<Vec<Request<Bytes>>>>;
type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// The scripted envd: answers by path and records every request it got.
async fn envd(req: Request<Incoming>, seen: Seen) -> Response<Body> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    let path = parts.uri.path().to_string();
    seen.lock()
        .unwrap()
        .push(Request::from_parts(parts, body.clone()));
    let full = |s: StatusCode, b: &[u8]| {
        Response::builder()
            .status(s)
            .body(Full::new(Bytes::copy_from_slice(b)).boxed())
            .unwrap()
    };
    match path.as_str() {
        "/health" => full(StatusCode::NO_CONTENT, b""),
        "/metrics" => full(
            StatusCode::OK,
            br#"{"ts":5,"cpu_count":2,"cpu_used_pct":1.5,"mem_total":10,"mem_used":4,"mem_total_mib":0,"mem_used_mib":0,"disk_used":1,"disk_total":9}"#,
        ),
        "/files" => full(StatusCode::NOT_FOUND, br#"{"code":404,"message":"no such file"}"#),
        "/process.Process/SendInput" => full(
            StatusCode::NOT_FOUND,
            br#"{"code":"not_found","message":"process with pid 7 not found"}"#,
        ),
        "/process.Process/Start" => {
            // The answer in awkward pieces: each envelope split across two HTTP chunks.
            let ev = |e| {
                pb::StartResponse {
                    event: Some(pb::ProcessEvent { event: Some(e) }),
                }
                .encode_to_vec()
            };
            use pb::process_event::{data_event::Output, DataEvent, EndEvent, Event, StartEvent};
            let mut wire = Vec::new();
            for m in [
                ev(Event::Start(StartEvent { pid: 42 })),
                ev(Event::Keepalive(Default::default())),
                ev(Event::Data(DataEvent {
                    output: Some(Output::Stdout(b"out".to_vec())),
                })),
                ev(Event::Data(DataEvent {
                    output: Some(Output::Stderr(b"err".to_vec())),
                })),
                ev(Event::End(EndEvent {
                    exit_code: 3,
                    exited: true,
                    status: "exit status 3".into(),
                    error: None,
                })),
            ] {
                wire.extend_from_slice(&framing::encode(0, &m));
            }
            wire.extend_from_slice(&framing::end_stream(None));
            let chunks: Vec<Result<Frame<Bytes>, Infallible>> = wire
                .chunks(3)
                .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
                .collect();
            Response::new(StreamBody::new(futures::stream::iter(chunks)).boxed())
        }
        "/process.Process/Connect" => {
            let end = framing::end_stream(Some(ErrorBody {
                code: Code::NotFound,
                message: "process with tag \"x\" not found".into(),
            }));
            full(StatusCode::OK, &end)
        }
        _ => full(StatusCode::NOT_FOUND, b"nope"),
    }
}

fn serve<IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static>(
    io: IO,
    seen: Seen,
) {
    tokio::spawn(async move {
        let svc = hyper::service::service_fn(move |req| {
            let seen = seen.clone();
            async move { Ok::<_, Infallible>(envd(req, seen).await) }
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(io), svc)
            .await;
    });
}

/// Each connect() is a fresh in-memory pipe with the scripted envd on the other end.
struct Memory {
    seen: Seen,
}

#[async_trait::async_trait]
impl Connector for Memory {
    async fn connect(&self) -> std::io::Result<BoxIo> {
        let (client, server) = tokio::io::duplex(64 * 1024);
        serve(server, self.seen.clone());
        Ok(Box::new(client))
    }
    fn describe(&self) -> String {
        "memory".into()
    }
}

fn memory() -> (EnvdClient, Seen) {
    let seen = Seen::default();
    let c = EnvdClient::new(Arc::new(Memory { seen: seen.clone() }));
    (c, seen)
}

#[tokio::test]
async fn headers_token_and_basic_user_on_every_request() {
    let (c, seen) = memory();
    let c = c
        .with_access_token(Some("tok".into()))
        .with_header("E2b-Sandbox-Id", "sbx1".into())
        .with_header("host", "kiln.example:3000".into());
    c.health().await.unwrap();
    let m = c.metrics().await.unwrap();
    assert_eq!((m.ts, m.cpu_count, m.disk_total), (5, 2, 9));
    let e = c.read_file("/no/such", Some("user")).await.unwrap_err();
    assert!(
        matches!(&e, EnvdError::Status { status: 404, message } if message == "no such file"),
        "{e}"
    );
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 3);
    for r in seen.iter() {
        assert_eq!(r.headers()["e2b-sandbox-id"], "sbx1");
        assert_eq!(r.headers()["host"], "kiln.example:3000");
        assert_eq!(r.headers().get_all("host").iter().count(), 1);
        assert_eq!(r.headers()["x-access-token"], "tok");
    }
    assert_eq!(seen[2].uri().query(), Some("path=/no/such&username=user"));
    // Basic base64("user:")
    assert_eq!(seen[2].headers()["authorization"], "Basic dXNlcjo=");
}

#[tokio::test]
async fn process_events_from_split_envelopes() {
    let (c, seen) = memory();
    let req = kiln_envd::bash_request("echo hi", Default::default(), None, Some((100, 30)));
    let mut st = c.start(&req, Some("root")).await.unwrap();
    let mut got = Vec::new();
    while let Some(ev) = st.next_event().await.unwrap() {
        got.push(ev);
    }
    assert_eq!(
        got,
        vec![
            ProcessEvent::Started { pid: 42 },
            ProcessEvent::Stdout(b"out".to_vec()),
            ProcessEvent::Stderr(b"err".to_vec()),
            ProcessEvent::Exited {
                code: 3,
                error: None
            },
        ]
    );
    // The request was one proto envelope of the StartRequest with the PTY size.
    {
        let seen = seen.lock().unwrap();
        let r = &seen[0];
        assert_eq!(r.headers()["content-type"], "application/connect+proto");
        let mut d = framing::EnvelopeDecoder::new(1 << 20);
        d.push(r.body());
        let f = d.next_frame().unwrap().unwrap();
        d.finish().unwrap();
        let sent = pb::StartRequest::decode(f.payload).unwrap();
        assert_eq!(sent.process.unwrap().args, vec!["-l", "-c", "echo hi"]);
        assert_eq!(sent.pty.unwrap().size.unwrap().cols, 100);
    }

    let (c, _) = memory();
    let out = c
        .run("echo hi", Default::default())
        .await
        .expect("run collects the same stream");
    assert_eq!(
        (out.stdout, out.stderr, out.exit_code),
        (b"out".to_vec(), b"err".to_vec(), 3)
    );
}

#[tokio::test]
async fn rpc_errors_keep_their_connect_code() {
    let (c, _) = memory();
    let e = c
        .send_input(7, b"x".to_vec(), true, None)
        .await
        .unwrap_err();
    assert_eq!(e.rpc_code(), Some("not_found"), "{e}");
    let sel = pb::ConnectRequest {
        process: Some(pb::ProcessSelector {
            selector: Some(pb::process_selector::Selector::Tag("x".into())),
        }),
    };
    let mut st = c
        .server_stream("/process.Process/Connect", &sel, None, None, None)
        .await
        .unwrap();
    let e = st.next_message().await.unwrap_err();
    assert_eq!(e.rpc_code(), Some("not_found"), "{e}");
    // After the end-stream message the stream stays ended.
    assert!(st.next_message().await.unwrap().is_none());
}

#[tokio::test]
async fn unix_socket_errors_never_show_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("secret-host-dir").join("envd.sock");
    let c = EnvdClient::unix(&sock);
    let e = c.health().await.unwrap_err();
    assert!(e.is_connect(), "{e}");
    assert!(!e.to_string().contains("secret-host-dir"), "{e}");
    // wait_ready turns "never reachable" into a timeout.
    let e = c.wait_ready(Duration::from_millis(50)).await.unwrap_err();
    assert!(matches!(e, EnvdError::Timeout(_)), "{e}");
    assert!(c.describe().contains("secret-host-dir"));

    // The same client works once something listens there.
    std::fs::create_dir_all(sock.parent().unwrap()).unwrap();
    let l = tokio::net::UnixListener::bind(&sock).unwrap();
    let seen = Seen::default();
    let s2 = seen.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            serve(s, s2.clone());
        }
    });
    c.wait_ready(Duration::from_secs(5)).await.unwrap();
    assert_eq!(seen.lock().unwrap()[0].uri().path(), "/health");
}
