//! The web console's server side through the real router and SQLite store (no sandbox is
//! started): sign-in with a key into a session cookie, wrong keys, CSRF and origin checks,
//! team scoping of `/console/api/`, revocation ending the session, the embedded bundle.
//! (Webhook URLs name the project's own test range, 198.51.100.0/24; no event is ever sent.)

use crate::common;

use http::{header, StatusCode};

use common::requests::{send, sign_in, FORM};

#[tokio::test]
async fn sign_in_sessions_csrf_and_team_scope() {
    let dir = common::state_dir();
    let (app, admin) = common::empty_app(dir.path()).await;
    let red = common::team_key(dir.path(), "red").await;

    // Signed out: the sign-in page, for the page and for the API alike.
    let (s, h, page) = send(&app, "GET", "/console", &[], "").await;
    assert_eq!(s, StatusCode::OK);
    assert!(
        page.contains(r#"<label for="key">API key</label>"#),
        "{page}"
    );
    assert!(h[header::CONTENT_SECURITY_POLICY]
        .to_str()
        .unwrap()
        .contains("script-src 'self'"));
    let (s, _, _) = send(
        &app,
        "GET",
        "/console/api/webhooks",
        &[("x-api-key", &red)],
        "",
    )
    .await;
    assert_eq!(
        s,
        StatusCode::UNAUTHORIZED,
        "the console takes no API key header"
    );

    // A wrong key: the sign-in page again, with the reason.
    let (s, h, page) = send(&app, "POST", "/console/login", &[FORM], "key=e2b_nope").await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert!(h.get(header::SET_COOKIE).is_none());
    assert!(
        page.contains("invalid API key") && page.contains(r#"role="alert""#),
        "{page}"
    );
    let (s, _, page) = send(&app, "POST", "/console/login", &[FORM], "key=").await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{page}");
    // A sign-in posted from another site is refused, even with a good key.
    let cross = [FORM, ("origin", "http://evil.test"), ("host", "kiln.local")];
    let (s, _, _) = send(
        &app,
        "POST",
        "/console/login",
        &cross,
        &format!("key={red}"),
    )
    .await;
    assert_eq!(s, StatusCode::FORBIDDEN);

    // A webhook of the operator's team and one of red's, through the API.
    for (key, url) in [
        (&admin, "http://198.51.100.7/admin"),
        (&red, "http://198.51.100.7/red"),
    ] {
        let (s, v) = common::call(
            &app,
            Some(key),
            "POST",
            "/webhooks",
            Some(&format!(r#"{{"url":"{url}"}}"#)),
            &[],
        )
        .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
    }

    // Signed in as red: the console's API sees red's things only.
    let (cookie, csrf) = sign_in(&app, &red).await;
    let c = ("cookie", cookie.as_str());
    let (s, _, list) = send(&app, "GET", "/console/api/webhooks", &[c], "").await;
    assert_eq!(s, StatusCode::OK, "{list}");
    assert!(list.contains("/red") && !list.contains("/admin"), "{list}");

    // State-changing calls need the token (and this origin).
    let json = ("content-type", "application/json");
    let body = r#"{"url":"http://198.51.100.7/console"}"#;
    let (s, _, v) = send(&app, "POST", "/console/api/webhooks", &[c, json], body).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert!(v.contains("CSRF"), "{v}");
    let wrong = ("x-csrf-token", "0000");
    let (s, _, _) = send(
        &app,
        "POST",
        "/console/api/webhooks",
        &[c, json, wrong],
        body,
    )
    .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let t = ("x-csrf-token", csrf.as_str());
    let other = [
        c,
        json,
        t,
        ("origin", "http://evil.test"),
        ("host", "kiln.local"),
    ];
    let (s, _, _) = send(&app, "POST", "/console/api/webhooks", &other, body).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, _, v) = send(&app, "POST", "/console/api/webhooks", &[c, json, t], body).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    // Made as red: red's API key sees it.
    let (_, v) = common::call(&app, Some(&red), "GET", "/webhooks", None, &[]).await;
    assert!(v.to_string().contains("/console"), "{v}");
    // The API's own errors pass through unchanged.
    let (s, _, v) = send(&app, "GET", "/console/api/sandboxes/nope", &[c], "").await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");

    // Sign-out needs the token too; after it the cookie opens nothing.
    let (s, _, _) = send(&app, "POST", "/console/logout", &[c, FORM], "csrf=x").await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, h, _) = send(
        &app,
        "POST",
        "/console/logout",
        &[c, FORM],
        &format!("csrf={csrf}"),
    )
    .await;
    assert_eq!(s, StatusCode::SEE_OTHER);
    assert!(h[header::SET_COOKIE]
        .to_str()
        .unwrap()
        .contains("Max-Age=0"));
    let (s, _, _) = send(&app, "GET", "/console/api/webhooks", &[c], "").await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);

    // Revoking the key ends its sessions at once.
    let (cookie, _) = sign_in(&app, &red).await;
    let store = common::store(dir.path());
    let id = store
        .list_keys()
        .await
        .unwrap()
        .into_iter()
        .find(|k| k.team == "red")
        .unwrap()
        .id;
    store.revoke_key(&id).await.unwrap();
    let (s, _, _) = send(
        &app,
        "GET",
        "/console/api/webhooks",
        &[("cookie", &cookie)],
        "",
    )
    .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _, page) = send(&app, "GET", "/console", &[("cookie", &cookie)], "").await;
    assert_eq!(s, StatusCode::OK);
    assert!(page.contains("API key</label>"), "the sign-in page again");
}

#[tokio::test]
async fn the_bundle_is_embedded() {
    let dir = common::state_dir();
    let (app, _) = common::empty_app(dir.path()).await;
    for (path, ty, needle) in [
        ("/console/app.js", "text/javascript", "xterm"),
        ("/console/app.css", "text/css", ".uplot"),
    ] {
        let (s, h, body) = send(&app, "GET", path, &[], "").await;
        assert_eq!(s, StatusCode::OK);
        assert!(h[header::CONTENT_TYPE].to_str().unwrap().starts_with(ty));
        assert!(body.len() > 10_000 && body.contains(needle), "{path}");
    }
    // The terminal is a WebSocket only (its session and token checks run in the browser
    // test, which can upgrade).
    let (s, _, _) = send(&app, "GET", "/console/terminal/x", &[], "").await;
    assert!(s.is_client_error(), "{s}");
}

#[tokio::test]
async fn desktop_routes_refuse_without_session_token_or_sandbox() {
    let dir = common::state_dir();
    let (app, _) = common::empty_app(dir.path()).await;
    let red = common::team_key(dir.path(), "red").await;
    let status = "/console/desktop/nosuch";
    let start = "/console/desktop/nosuch/stream";
    let vnc = "/console/vnc/nosuch";

    // No session: 401 on every route, as JSON naming what to do.
    for (m, p) in [("GET", status), ("POST", start), ("GET", vnc)] {
        let (s, _, body) = send(&app, m, p, &[], "").await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{m} {p}: {body}");
        assert!(body.contains("sign in"), "{body}");
    }

    let (cookie, csrf) = sign_in(&app, &red).await;
    let c = ("cookie", cookie.as_str());
    // The stream's start and the WebSocket need the token, and this origin.
    let (s, _, body) = send(&app, "POST", start, &[c], "").await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{body}");
    assert!(body.contains("CSRF"), "{body}");
    let (s, _, _) = send(&app, "GET", vnc, &[c], "").await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, _, _) = send(
        &app,
        "GET",
        &format!("{vnc}?csrf={}", "0".repeat(64)),
        &[c],
        "",
    )
    .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let t = ("x-csrf-token", csrf.as_str());
    let cross = [c, t, ("origin", "http://evil.test"), ("host", "kiln.local")];
    let (s, _, _) = send(&app, "POST", start, &cross, "").await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let cross = [c, ("origin", "http://evil.test"), ("host", "kiln.local")];
    let (s, _, _) = send(&app, "GET", &format!("{vnc}?csrf={csrf}"), &cross, "").await;
    assert_eq!(s, StatusCode::FORBIDDEN);

    // With everything right, a sandbox the team does not have is not found.
    for (m, p, h) in [
        ("GET", status.to_string(), vec![c]),
        ("POST", start.to_string(), vec![c, t]),
        ("GET", format!("{vnc}?csrf={csrf}"), vec![c]),
    ] {
        let (s, _, body) = send(&app, m, &p, &h, "").await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{m} {p}: {body}");
        assert!(
            body.contains("sandbox nosuch not found") && !body.contains("/var"),
            "{body}"
        );
    }
}
