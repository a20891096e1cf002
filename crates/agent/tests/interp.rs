//! The code interpreter service (`kiln-agent interp`) against the host's real IPython kernel
//! (Debian's python3-ipykernel, numpy, pandas, matplotlib; `KILN_INTERP_PYTHON` overrides the
//! interpreter). Requests are the ones `e2b-code-interpreter` sends.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use base64::Engine;
use kiln_agent::interp::{serve_on, Config, Contexts, KernelSpec};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

fn python() -> Option<PathBuf> {
    let py = std::env::var_os("KILN_INTERP_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/python3"));
    kiln_testkit::needs()
        .python_modules(
            &py,
            &["ipykernel", "matplotlib", "pandas"],
            "apt install python3-ipykernel python3-matplotlib python3-pandas",
        )
        .ok()
        .then_some(py)
}

struct Svc {
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

async fn start() -> Option<Svc> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KILN_AGENT_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
    let py = python()?;
    let dir = tempfile::tempdir().unwrap();
    let ctxs = Contexts::new(Config {
        kernel: KernelSpec {
            python: py,
            runtime_dir: dir.path().join("rt"),
        },
        default_cwd: dir.path().to_path_buf(),
        node: PathBuf::from("node"),
    });
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(serve_on(l, ctxs));
    Some(Svc { addr, _dir: dir })
}

/// Send a request (HTTP/1.0, so the body ends at close) and return status and body.
async fn request(addr: SocketAddr, method: &str, path: &str, body: Option<Value>) -> (u16, String) {
    let mut s = send(addr, method, path, body).await;
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, body.to_string())
}

async fn send(addr: SocketAddr, method: &str, path: &str, body: Option<Value>) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    s
}

/// Run code; return the NDJSON lines.
async fn exec(addr: SocketAddr, body: Value) -> Vec<Value> {
    let (status, out) = request(addr, "POST", "/execute", Some(body)).await;
    assert_eq!(status, 200, "{out}");
    out.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

fn of_type<'a>(lines: &'a [Value], t: &str) -> Vec<&'a Value> {
    lines.iter().filter(|l| l["type"] == t).collect()
}

fn stdout(lines: &[Value]) -> String {
    of_type(lines, "stdout")
        .iter()
        .map(|l| l["text"].as_str().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_state_results_errors_and_env() {
    let Some(svc) = start().await else { return };
    let a = svc.addr;
    let (s, b) = request(a, "GET", "/health", None).await;
    assert_eq!(s, 200, "{b}");

    let l = exec(a, json!({"code": "x = 41\nprint('hello')\nx + 1"})).await;
    assert_eq!(stdout(&l), "hello\n");
    let r = of_type(&l, "result");
    assert_eq!(r.len(), 1, "{l:?}");
    assert_eq!(r[0]["text"], "42");
    assert_eq!(r[0]["is_main_result"], true);
    let n = of_type(&l, "number_of_executions");
    let first = n[0]["execution_count"].as_i64().unwrap();
    assert!(of_type(&l, "stdout")[0]["timestamp"].as_u64().unwrap() > 0);

    // State persists; the count goes up.
    let l = exec(a, json!({"code": "x * 2"})).await;
    assert_eq!(of_type(&l, "result")[0]["text"], "82");
    assert_eq!(
        of_type(&l, "number_of_executions")[0]["execution_count"],
        first + 1
    );

    // Errors carry name, value and traceback.
    let l = exec(a, json!({"code": "def f():\n    return 1/0\nf()"})).await;
    let e = of_type(&l, "error");
    assert_eq!(e.len(), 1, "{l:?}");
    assert_eq!(e[0]["name"], "ZeroDivisionError");
    assert_eq!(e[0]["value"], "division by zero");
    let tb = e[0]["traceback"].as_str().unwrap();
    assert!(tb.contains("Traceback") && tb.contains("return"), "{tb}");

    // stderr is separate from stdout.
    let l = exec(
        a,
        json!({"code": "import sys; print('oops', file=sys.stderr)"}),
    )
    .await;
    assert_eq!(of_type(&l, "stderr")[0]["text"], "oops\n");

    // env_vars apply to one execution only.
    let l = exec(
        a,
        json!({"code": "import os; print(os.environ.get('KILN_T'))", "env_vars": {"KILN_T": "v1"}}),
    )
    .await;
    assert_eq!(stdout(&l), "v1\n");
    let l = exec(a, json!({"code": "print(os.environ.get('KILN_T'))"})).await;
    assert_eq!(stdout(&l), "None\n");
    // The helper names do not linger in the user's namespace.
    let l = exec(
        a,
        json!({"code": "[n for n in dir() if n.startswith('_k')]"}),
    )
    .await;
    assert_eq!(of_type(&l, "result")[0]["text"], "[]");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matplotlib_charts_and_dataframes() {
    let Some(svc) = start().await else { return };
    let a = svc.addr;
    let code = "import matplotlib.pyplot as plt\n\
                fig, ax = plt.subplots()\n\
                ax.plot([1, 2, 3], [4, 5, 7], label='growth')\n\
                ax.set_title('Line'); ax.set_xlabel('t'); ax.set_ylabel('v')\n\
                plt.show()";
    let l = exec(a, json!({"code": code})).await;
    let r = of_type(&l, "result");
    assert_eq!(r.len(), 1, "{l:?}");
    let png = base64::engine::general_purpose::STANDARD
        .decode(r[0]["png"].as_str().unwrap())
        .unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let c = &r[0]["chart"];
    assert_eq!(c["type"], "line");
    assert_eq!(c["title"], "Line");
    assert_eq!(c["x_label"], "t");
    assert_eq!(c["y_label"], "v");
    assert_eq!(c["x_scale"], "linear");
    assert_eq!(c["elements"][0]["label"], "growth");
    assert_eq!(c["elements"][0]["points"], json!([[1, 4], [2, 5], [3, 7]]));

    let l = exec(
        a,
        json!({"code": "plt.bar(['a', 'b'], [3, 5]); plt.title('Bars'); plt.show()"}),
    )
    .await;
    let c = &of_type(&l, "result")[0]["chart"];
    assert_eq!(c["type"], "bar");
    assert_eq!(c["title"], "Bars");
    let vals: Vec<(String, f64)> = c["elements"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["label"].as_str().unwrap().to_string(),
                e["value"].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(vals, vec![("a".into(), 3.0), ("b".into(), 5.0)]);

    let l = exec(
        a,
        json!({"code": "plt.pie([1, 3], labels=['p', 'q']); plt.show()"}),
    )
    .await;
    let c = &of_type(&l, "result")[0]["chart"];
    assert_eq!(c["type"], "pie");
    assert_eq!(c["elements"][1]["label"], "q");
    assert_eq!(c["elements"][1]["angle"], 270);

    let l = exec(
        a,
        json!({"code": "plt.scatter([1, 2], [3, 4]); plt.show()"}),
    )
    .await;
    let c = &of_type(&l, "result")[0]["chart"];
    assert_eq!(c["type"], "scatter");
    assert_eq!(c["elements"][0]["points"], json!([[1, 3], [2, 4]]));

    let l = exec(
        a,
        json!({"code": "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})"}),
    )
    .await;
    let r = of_type(&l, "result");
    assert!(r[0]["html"].as_str().unwrap().contains("<table"), "{r:?}");
    assert_eq!(r[0]["data"]["columns"], json!(["a", "b"]));
    assert_eq!(r[0]["data"]["data"], json!([[1, "x"], [2, "y"]]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contexts_bash_restart_and_interrupt() {
    let Some(svc) = start().await else { return };
    let a = svc.addr;
    let cwd = svc._dir.path().join("work");
    std::fs::create_dir_all(&cwd).unwrap();
    let (s, b) = request(
        a,
        "POST",
        "/contexts",
        Some(json!({"language": "python", "cwd": cwd})),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    let ctx: Value = serde_json::from_str(&b).unwrap();
    let id = ctx["id"].as_str().unwrap().to_string();
    assert_eq!(ctx["language"], "python");
    let l = exec(
        a,
        json!({"code": "import os; y = 7; os.getcwd()", "context_id": id}),
    )
    .await;
    assert_eq!(
        of_type(&l, "result")[0]["text"],
        format!("'{}'", cwd.display())
    );
    // Contexts are separate: the default one has no `y`.
    let l = exec(a, json!({"code": "y"})).await;
    assert_eq!(of_type(&l, "error")[0]["name"], "NameError");

    // A cell that outlives its client is interrupted; the context keeps its state.
    let mut s = send(
        a,
        "POST",
        "/execute",
        Some(json!({"code": "import time\nprint('start', flush=True)\ntime.sleep(60)", "context_id": id})),
    )
    .await;
    let mut r = BufReader::new(&mut s);
    let mut line = String::new();
    while !line.contains("start") {
        line.clear();
        assert!(r.read_line(&mut line).await.unwrap() > 0);
    }
    drop(s);
    let t0 = Instant::now();
    let l = exec(a, json!({"code": "y + 1", "context_id": id})).await;
    assert_eq!(
        of_type(&l, "result").first().map(|r| r["text"].clone()),
        Some(json!("8")),
        "{l:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());

    // Restart: same id, fresh state.
    let (s, b) = request(a, "POST", &format!("/contexts/{id}/restart"), None).await;
    assert_eq!(s, 200, "{b}");
    let l = exec(a, json!({"code": "y", "context_id": id})).await;
    assert_eq!(of_type(&l, "error")[0]["name"], "NameError");

    // Bash: state persists between cells, failures are errors.
    let (_, b) = request(a, "POST", "/contexts", Some(json!({"language": "bash"}))).await;
    let bash: Value = serde_json::from_str(&b).unwrap();
    let bid = bash["id"].as_str().unwrap();
    let l = exec(
        a,
        json!({"code": "Z=5; cd /; echo $KV", "context_id": bid, "env_vars": {"KV": "e"}}),
    )
    .await;
    assert_eq!(stdout(&l), "e\n");
    let l = exec(
        a,
        json!({"code": "echo $Z $KV; pwd; ls /nonexistent-kiln", "context_id": bid}),
    )
    .await;
    assert_eq!(stdout(&l), "5\n/\n");
    let err = of_type(&l, "stderr");
    assert!(
        err[0]["text"]
            .as_str()
            .unwrap()
            .contains("nonexistent-kiln"),
        "{l:?}"
    );
    assert_eq!(of_type(&l, "error")[0]["value"], "exit status 2");

    let (_, b) = request(a, "GET", "/contexts", None).await;
    let all: Vec<Value> = serde_json::from_str(&b).unwrap();
    assert!(all.iter().any(|c| c["id"] == id.as_str()));
    assert!(all
        .iter()
        .any(|c| c["id"] == bid && c["language"] == "bash"));
    let (s, _) = request(a, "DELETE", &format!("/contexts/{id}"), None).await;
    assert_eq!(s, 204);
    let (s, _) = request(a, "DELETE", &format!("/contexts/{id}"), None).await;
    assert_eq!(s, 404);
    let (s, _) = request(
        a,
        "POST",
        "/execute",
        Some(json!({"code": "1", "context_id": id})),
    )
    .await;
    assert_eq!(s, 404);
    let (s, _) = request(
        a,
        "POST",
        "/execute",
        Some(json!({"code": "1", "language": "cobol"})),
    )
    .await;
    assert_eq!(s, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn javascript_contexts() {
    let Some(svc) = start().await else { return };
    let a = svc.addr;
    if !kiln_testkit::needs().tool("node").ok() {
        return;
    }
    let l = exec(
        a,
        json!({"code": "let n = 40; console.log('hi', [1]); n + 2", "language": "javascript"}),
    )
    .await;
    assert_eq!(stdout(&l), "hi [ 1 ]\n");
    assert_eq!(of_type(&l, "result")[0]["text"], "42");
    // console.log's value is undefined: no result.
    let l = exec(a, json!({"code": "console.log(1 + 1)", "language": "js"})).await;
    assert_eq!(stdout(&l), "2\n");
    assert!(of_type(&l, "result").is_empty(), "{l:?}");
    let l = exec(
        a,
        json!({"code": "n + Number(process.env.JS_ADD)", "language": "js", "env_vars": {"JS_ADD": "2"}}),
    )
    .await;
    assert_eq!(of_type(&l, "result")[0]["text"], "42");
    let l = exec(a, json!({"code": "process.env.JS_ADD", "language": "js"})).await;
    assert!(of_type(&l, "result").is_empty(), "{l:?}");
    let l = exec(a, json!({"code": "null.x", "language": "js"})).await;
    assert_eq!(of_type(&l, "error")[0]["name"], "TypeError");
    let l = exec(
        a,
        json!({"code": "globalThis.w = await Promise.resolve(7); return w", "language": "js"}),
    )
    .await;
    assert_eq!(of_type(&l, "result")[0]["text"], "7");

    // An endless loop outliving its client is interrupted; the context survives.
    let mut s = send(
        a,
        "POST",
        "/execute",
        Some(json!({"code": "while (true) {}", "language": "js"})),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    drop(s.shutdown().await);
    drop(s);
    let t0 = Instant::now();
    let l = exec(a, json!({"code": "n", "language": "js"})).await;
    assert_eq!(of_type(&l, "result")[0]["text"], "40");
    assert!(t0.elapsed() < Duration::from_secs(20));
}
