//! The console's server-rendered HTML: the sign-in page (plain form, works without script)
//! and the shell page that loads the embedded bundle with the session's CSRF token.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use super::session::Session;

/// Content-Security-Policy of every console page: nothing but this server, no inline script.
const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
     img-src 'self' data:; connect-src 'self'; frame-src 'self'; frame-ancestors 'none'; \
     base-uri 'none'; form-action 'self'";

/// Escapes text for HTML content and attribute values.
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// An HTML answer with the console's security headers.
pub fn html(status: StatusCode, body: String) -> Response {
    let mut r = (status, body).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    r
}

/// The sign-in page, with `error` (already a sentence for a person) shown above the form.
pub fn sign_in(status: StatusCode, error: Option<&str>) -> Response {
    let error = error
        .map(|e| {
            format!(
                r#"<p class="error" role="alert" id="signin-error">{}</p>"#,
                esc(e)
            )
        })
        .unwrap_or_default();
    html(
        status,
        format!(
            r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Sign in · kiln console</title>
<link rel="stylesheet" href="/console/app.css">
</head><body class="signin">
<main class="signin-box">
<h1>kiln console</h1>
{error}
<form method="post" action="/console/login">
<label for="key">API key</label>
<input id="key" name="key" type="password" autocomplete="current-password" required
  placeholder="e2b_…" autofocus>
<button type="submit">Sign in</button>
</form>
<p class="hint">Use one of your team's API keys (<code>kiln keys create</code> makes one).
The key is checked once; the browser keeps only a session cookie.</p>
</main>
</body></html>
"#
        ),
    )
}

/// The application page for a signed-in session.
pub fn app(s: &Session) -> Response {
    html(
        StatusCode::OK,
        format!(
            r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="kiln-csrf" content="{csrf}">
<meta name="kiln-team" content="{team}">
<meta name="kiln-key" content="{key}">
<title>kiln console</title>
<link rel="stylesheet" href="/console/app.css">
<script type="module" src="/console/app.js"></script>
</head><body>
<div id="app"><p class="loading">Loading…</p></div>
<noscript><p>The console needs JavaScript. The REST API and <code>kiln</code> CLI work without it.</p></noscript>
</body></html>
"#,
            csrf = esc(&s.csrf),
            team = esc(&s.caller.team),
            key = esc(&s.caller.key_id),
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup() {
        assert_eq!(
            esc(r#"<a href="x">&'"#),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }
}
