// Calls into the REST API through the console's /console/api/ (the session cookie
// authenticates; state-changing calls carry the page's CSRF token).

const meta = (n) => document.querySelector(`meta[name="${n}"]`)?.content ?? "";
export const session = { csrf: meta("kiln-csrf"), team: meta("kiln-team"), key: meta("kiln-key") };

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function call(method, url, body) {
  const opts = { method, headers: { accept: "application/json" }, credentials: "same-origin" };
  if (method !== "GET") opts.headers["x-csrf-token"] = session.csrf;
  if (body !== undefined) {
    opts.headers["content-type"] = "application/json";
    opts.body = JSON.stringify(body);
  }
  const r = await fetch(url, opts);
  if (r.status === 401) {
    location.href = "/console";
    throw new ApiError(401, "signed out");
  }
  const text = await r.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = text;
  }
  if (!r.ok) throw new ApiError(r.status, (data && data.message) || `${r.status} ${r.statusText}`);
  return data;
}

// The REST API's `path` as the session's caller.
export const api = (method, path, body) => call(method, `/console/api${path}`, body);
// The console's own routes (`/console${path}`).
export const own = (method, path, body) => call(method, `/console${path}`, body);
export const get = (path) => api("GET", path);
export const enc = encodeURIComponent;
