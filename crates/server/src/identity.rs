//! Workload identity (E2B's `iam.tokens`): a sandbox created with
//! `iam: {tokens: {NAME: {audience, tokenType: "JWT-SVID"}}}` gets, wherever a network rule's
//! header says `${e2b.identity.tokens.NAME}`, a JWT minted by the egress proxy for each
//! request: JWT-SVID claims (`sub` = `spiffe://<trust domain>/team/<team>/sandbox/<id>`, `aud`
//! as asked, `iat`/`nbf`/`exp` a few minutes apart, a random `jti`, `iss` the server), signed
//! ES256 (ring) with the server's identity key `<state>/identity.key` (PKCS#8, mode 0600, made
//! at first start). Upstreams verify tokens against the public key served at
//! `GET /.well-known/jwks.json` ([`crate::api::jwks`]). The token never enters the sandbox.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine;
use ring::rand::{SecureRandom, SystemRandom};
use ring::signature::{EcdsaKeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
use serde_json::{json, Value};

/// File name of the identity key in the state directory.
pub const KEY_FILE: &str = "identity.key";
/// How long a minted token is valid.
pub const TOKEN_TTL: Duration = Duration::from_secs(300);
/// The token type E2B's API accepts.
pub const TOKEN_TYPE: &str = "JWT-SVID";
/// Most tokens one sandbox may define.
pub const MAX_TOKENS: usize = 16;
/// Longest token name and audience, bytes.
const MAX_NAME: usize = 128;
const MAX_AUDIENCE: usize = 512;

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("identity key {path}: {source}")]
    Key {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("identity key {0} is not a PKCS#8 P-256 key: restore it from a backup or remove it (a new one is then made, and upstreams must fetch the new JWKS)")]
    BadKey(String),
}

/// The server's token issuer: its signing key and the claims every token shares.
pub struct Issuer {
    key: EcdsaKeyPair,
    rng: SystemRandom,
    kid: String,
    /// The public key as a JWK.
    jwk: Value,
    /// `iss` of every token.
    pub issuer: String,
    /// SPIFFE trust domain of the tokens' subjects.
    pub trust_domain: String,
}

impl std::fmt::Debug for Issuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issuer")
            .field("kid", &self.kid)
            .field("issuer", &self.issuer)
            .finish()
    }
}

/// Reads the PKCS#8 key at `path`, making a new one (mode 0600) when there is none.
fn load_or_make_key(path: &Path, rng: &SystemRandom) -> Result<Vec<u8>, IdentityError> {
    let err = |source| IdentityError::Key {
        path: path.display().to_string(),
        source,
    };
    match std::fs::read(path) {
        Ok(k) => {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
            Ok(k)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let doc = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, rng)
                .map_err(|_| err(std::io::Error::other("no system randomness")))?;
            crate::vault::write_key_file(path, doc.as_ref()).map_err(err)?;
            Ok(doc.as_ref().to_vec())
        }
        Err(e) => Err(err(e)),
    }
}

/// The SPIFFE trust domain of `domain`: lower-cased, other characters than letters, digits,
/// `.`, `-` and `_` dropped.
fn trust_domain_of(domain: &str) -> String {
    let d: String = domain
        .to_ascii_lowercase()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
        .collect();
    if d.is_empty() {
        "kiln".into()
    } else {
        d
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Issuer {
    /// The issuer of state directory `dir` (its key made there at first use), naming itself
    /// `issuer` and its subjects under the trust domain of `domain`.
    pub fn open(dir: &Path, issuer: &str, domain: &str) -> Result<Self, IdentityError> {
        let path = dir.join(KEY_FILE);
        let der = load_or_make_key(&path, &SystemRandom::new())?;
        Self::from_pkcs8(&der, issuer, domain)
            .map_err(|_| IdentityError::BadKey(path.display().to_string()))
    }

    /// A new random key, PKCS#8 (for a key kept elsewhere than a state directory: a
    /// cluster's, in etcd).
    pub fn generate_pkcs8() -> Result<Vec<u8>, IdentityError> {
        EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &SystemRandom::new())
            .map(|d| d.as_ref().to_vec())
            .map_err(|_| IdentityError::BadKey("(a new key: no system randomness)".into()))
    }

    /// The issuer signing with the PKCS#8 key `der`, naming itself `issuer` and its subjects
    /// under the trust domain of `domain`.
    pub fn from_pkcs8(der: &[u8], issuer: &str, domain: &str) -> Result<Self, IdentityError> {
        let rng = SystemRandom::new();
        let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, der, &rng)
            .map_err(|_| IdentityError::BadKey("(given)".into()))?;
        // An uncompressed point: 0x04, x, y.
        let point = key.public_key().as_ref();
        let (x, y) = (B64.encode(&point[1..33]), B64.encode(&point[33..65]));
        // RFC 7638 thumbprint: SHA-256 of the required members in lexicographic order.
        let canonical = format!(r#"{{"crv":"P-256","kty":"EC","x":"{x}","y":"{y}"}}"#);
        let kid = B64.encode(ring::digest::digest(
            &ring::digest::SHA256,
            canonical.as_bytes(),
        ));
        let jwk = json!({"kty": "EC", "crv": "P-256", "x": x, "y": y,
                         "kid": kid, "alg": "ES256", "use": "sig"});
        Ok(Self {
            key,
            rng,
            kid,
            jwk,
            issuer: issuer.trim_end_matches('/').to_string(),
            trust_domain: trust_domain_of(domain),
        })
    }

    /// `GET /.well-known/jwks.json`.
    pub fn jwks(&self) -> Value {
        json!({ "keys": [self.jwk] })
    }

    /// The subject of sandbox `sandbox` of `team`.
    pub fn subject(&self, team: &str, sandbox: &str) -> String {
        format!(
            "spiffe://{}/team/{team}/sandbox/{sandbox}",
            self.trust_domain
        )
    }

    /// A token for sandbox `sandbox` of `team`, for `audience`, valid [`TOKEN_TTL`].
    pub fn mint(&self, team: &str, sandbox: &str, audience: &str) -> Result<String, String> {
        let now = now_secs();
        let mut jti = [0u8; 16];
        self.rng
            .fill(&mut jti)
            .map_err(|_| "no system randomness".to_string())?;
        let header = json!({"alg": "ES256", "typ": "JWT", "kid": self.kid});
        let claims = json!({
            "iss": self.issuer,
            "sub": self.subject(team, sandbox),
            "aud": audience,
            "iat": now,
            "nbf": now,
            "exp": now + TOKEN_TTL.as_secs(),
            "jti": B64.encode(jti),
        });
        let input = format!(
            "{}.{}",
            B64.encode(header.to_string()),
            B64.encode(claims.to_string())
        );
        let sig = self
            .key
            .sign(&self.rng, input.as_bytes())
            .map_err(|_| "signing the token failed".to_string())?;
        Ok(format!("{input}.{}", B64.encode(sig.as_ref())))
    }
}

/// One token a sandbox defines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenSpec {
    pub audience: String,
}

/// Parses and checks E2B's `iam` (`{tokens: {NAME: {audience, tokenType}}}`); a missing or
/// empty one is no tokens. The error says what is wrong, for a 400.
pub fn parse_iam(v: Option<&Value>) -> Result<BTreeMap<String, TokenSpec>, String> {
    let mut out = BTreeMap::new();
    let iam = match v {
        None | Some(Value::Null) => return Ok(out),
        Some(Value::Object(m)) => m,
        Some(_) => return Err("iam: expected an object {tokens: {...}}".into()),
    };
    if let Some(other) = iam.keys().find(|k| *k != "tokens") {
        return Err(format!("iam: unknown field {other:?}"));
    }
    let tokens = match iam.get("tokens") {
        None | Some(Value::Null) => return Ok(out),
        Some(Value::Object(t)) => t,
        Some(_) => return Err("iam.tokens: expected an object of name → token".into()),
    };
    if tokens.len() > MAX_TOKENS {
        return Err(format!(
            "iam.tokens: at most {MAX_TOKENS} tokens per sandbox"
        ));
    }
    for (name, t) in tokens {
        if name.is_empty()
            || name.len() > MAX_NAME
            || name.chars().any(|c| c.is_control() || c == '{' || c == '}')
        {
            return Err(format!(
                "iam.tokens: {name:?} is not a usable token name (1-{MAX_NAME} bytes, no '{{', \
                 '}}' or control characters)"
            ));
        }
        let t = t
            .as_object()
            .ok_or_else(|| format!("iam.tokens.{name}: expected {{audience, tokenType}}"))?;
        let audience = t
            .get("audience")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("iam.tokens.{name}: audience must be a string"))?;
        if audience.trim().is_empty()
            || audience.len() > MAX_AUDIENCE
            || audience.chars().any(char::is_control)
        {
            return Err(format!(
                "iam.tokens.{name}: audience {audience:?} is not usable (1-{MAX_AUDIENCE} \
                 bytes, not blank, no control characters)"
            ));
        }
        match t.get("tokenType").and_then(Value::as_str) {
            Some(TOKEN_TYPE) => {}
            Some(other) => {
                return Err(format!(
                    "iam.tokens.{name}: tokenType {other:?} is not supported (only \
                     {TOKEN_TYPE:?})"
                ))
            }
            None => return Err(format!("iam.tokens.{name}: tokenType must be a string")),
        }
        if let Some(other) = t
            .keys()
            .find(|k| !matches!(k.as_str(), "audience" | "tokenType"))
        {
            return Err(format!("iam.tokens.{name}: unknown field {other:?}"));
        }
        out.insert(
            name.clone(),
            TokenSpec {
                audience: audience.to_string(),
            },
        );
    }
    Ok(out)
}

/// One sandbox's tokens: what the egress proxy mints from. The sandbox's id is bound when its
/// policy is put in force ([`kiln_net::intercept::TokenSource::bind`]).
pub struct SandboxTokens {
    issuer: Arc<Issuer>,
    team: String,
    tokens: BTreeMap<String, TokenSpec>,
    sandbox: OnceLock<String>,
}

impl SandboxTokens {
    pub fn new(issuer: Arc<Issuer>, team: &str, tokens: BTreeMap<String, TokenSpec>) -> Self {
        Self {
            issuer,
            team: team.to_string(),
            tokens,
            sandbox: OnceLock::new(),
        }
    }
}

impl kiln_net::intercept::TokenSource for SandboxTokens {
    fn mint(&self, name: &str) -> Result<String, String> {
        let spec = self.tokens.get(name).ok_or_else(|| {
            format!("workload identity token {name:?} is not in the sandbox's iam.tokens")
        })?;
        let sandbox = self
            .sandbox
            .get()
            .ok_or_else(|| "the sandbox's identity is not bound yet".to_string())?;
        self.issuer.mint(&self.team, sandbox, &spec.audience)
    }

    fn bind(&self, sandbox: &str) {
        let _ = self.sandbox.set(sandbox.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_net::intercept::TokenSource;

    fn claims(jwt: &str) -> Value {
        let part = jwt.split('.').nth(1).unwrap();
        serde_json::from_slice(&B64.decode(part).unwrap()).unwrap()
    }

    #[test]
    fn tokens_are_signed_jwt_svids_that_verify_against_the_jwks() {
        let dir = tempfile::tempdir().unwrap();
        let i = Arc::new(Issuer::open(dir.path(), "http://kiln.test/", "Kiln.Test").unwrap());
        let mode = std::fs::metadata(dir.path().join(KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let jwt = i.mint("red", "sbx1", "sts.example").unwrap();
        let c = claims(&jwt);
        assert_eq!(c["sub"], "spiffe://kiln.test/team/red/sandbox/sbx1");
        assert_eq!(
            (c["aud"].as_str(), c["iss"].as_str()),
            (Some("sts.example"), Some("http://kiln.test"))
        );
        assert_eq!(
            c["exp"].as_u64().unwrap() - c["iat"].as_u64().unwrap(),
            TOKEN_TTL.as_secs()
        );
        assert_ne!(
            claims(&i.mint("red", "sbx1", "a").unwrap())["jti"],
            c["jti"]
        );
        // The signature verifies with the public key the JWKS serves.
        let jwk = &i.jwks()["keys"][0];
        let mut point = vec![4u8];
        point.extend(B64.decode(jwk["x"].as_str().unwrap()).unwrap());
        point.extend(B64.decode(jwk["y"].as_str().unwrap()).unwrap());
        let (input, sig) = jwt.rsplit_once('.').unwrap();
        let pk = ring::signature::UnparsedPublicKey::new(
            &ring::signature::ECDSA_P256_SHA256_FIXED,
            &point,
        );
        pk.verify(input.as_bytes(), &B64.decode(sig).unwrap())
            .unwrap();
        assert!(pk.verify(b"other", &B64.decode(sig).unwrap()).is_err());
        // The key outlives a restart: the same JWKS.
        let again = Issuer::open(dir.path(), "http://kiln.test", "kiln.test").unwrap();
        assert_eq!(again.jwks(), i.jwks());

        let spec = parse_iam(Some(&json!({"tokens": {"aws": {"audience": "sts.example",
            "tokenType": "JWT-SVID"}}})))
        .unwrap();
        let t = SandboxTokens::new(i.clone(), "red", spec);
        assert!(t.mint("aws").unwrap_err().contains("not bound"));
        t.bind("sbx9");
        assert_eq!(
            claims(&t.mint("aws").unwrap())["sub"],
            "spiffe://kiln.test/team/red/sandbox/sbx9"
        );
        assert!(t.mint("gcp").unwrap_err().contains("\"gcp\""));
    }

    #[test]
    fn bad_iam_is_refused() {
        assert!(parse_iam(None).unwrap().is_empty());
        assert!(parse_iam(Some(&json!({}))).unwrap().is_empty());
        let tok =
            |aud: Value, ty: Value| json!({"tokens": {"a": {"audience": aud, "tokenType": ty}}});
        for (bad, says) in [
            (tok(json!(""), json!("JWT-SVID")), "audience"),
            (tok(json!(" "), json!("JWT-SVID")), "audience"),
            (tok(json!("a\nb"), json!("JWT-SVID")), "audience"),
            (tok(json!("x".repeat(600)), json!("JWT-SVID")), "audience"),
            (tok(json!(5), json!("JWT-SVID")), "audience"),
            (tok(json!("a"), json!("X509-SVID")), "tokenType"),
            (
                json!({"tokens": {"a}b": {"audience": "a", "tokenType": "JWT-SVID"}}}),
                "token name",
            ),
            (
                json!({"tokens": {"": {"audience": "a", "tokenType": "JWT-SVID"}}}),
                "token name",
            ),
            (json!({"tokens": []}), "iam.tokens"),
            (json!({"other": {}}), "unknown field"),
            (json!("x"), "iam"),
        ] {
            let e = parse_iam(Some(&bad)).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
