//! One build step inside the build sandbox, through its agent: `RUN` as the step's user in
//! its working directory with the build's environment (output lines go to the build log),
//! and `COPY` (the verified archive written into the sandbox, unpacked and placed as Docker
//! places it, owner and mode applied). Also the start request's checks.

use std::collections::VecDeque;

use kiln_envd::{bash_request, ProcessEvent};

use super::{Builds, Env, StartSpec, Step};
use crate::error::{Error, Result};

/// Output lines of a failing step shown in its error.
const TAIL_LINES: usize = 15;
/// Longest one RUN step may take.
const STEP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1800);

/// Checks a start request before anything runs (400 with what is wrong).
pub fn validate(spec: &StartSpec) -> Result<()> {
    if spec.from_image.is_some() && spec.from_template.is_some() {
        return Err(Error::bad_request(
            "give fromImage or fromTemplate, not both",
        ));
    }
    if let Some(reg) = &spec.from_image_registry {
        match reg.get("type").and_then(|t| t.as_str()) {
            Some("registry" | "gcp") => {}
            Some("aws") => {
                return Err(Error::bad_request(
                    "fromImageRegistry type \"aws\" (from_aws_registry) is not supported by \
                     kiln: kiln does not call AWS to turn access keys into a registry login. Use \
                     from_image(image, username=\"AWS\", password=TOKEN) with TOKEN from \
                     `aws ecr get-login-password --region REGION` (valid 12 hours), or copy the \
                     image into a registry kiln reaches (`--registry-mirror`, `kiln template \
                     import`)",
                ))
            }
            other => {
                return Err(Error::bad_request(format!(
                    "fromImageRegistry type {other:?} is unknown"
                )))
            }
        }
    }
    for (i, s) in spec.steps.iter().enumerate() {
        let n = i + 1;
        let bad = |why: &str| Err(Error::bad_request(format!("step {n} ({}): {why}", s.kind)));
        match s.kind.as_str() {
            "RUN" if s.args.is_empty() || s.args.len() > 2 => {
                return bad("args must be [command] or [command, user]")
            }
            "COPY" => {
                if s.args.len() < 2 || s.args.len() > 4 {
                    return bad("args must be [src, dest, user, mode]");
                }
                if !s.files_hash.as_deref().is_some_and(super::files::is_hash) {
                    return bad("filesHash must be a SHA-256 in lowercase hex");
                }
                if let Some(m) = s.args.get(3).filter(|m| !m.is_empty()) {
                    if u32::from_str_radix(m, 8).map_or(true, |v| v > 0o7777) {
                        return bad("mode must be octal, e.g. 0755");
                    }
                }
            }
            "ENV" if s.args.is_empty() || s.args.len() % 2 != 0 => {
                return bad("args must be [name, value, ...]")
            }
            "WORKDIR" | "USER" if s.args.len() != 1 || s.args[0].is_empty() => {
                return bad("args must be one non-empty value")
            }
            "RUN" | "ENV" | "WORKDIR" | "USER" => {}
            _ => return bad("unknown step type (use COPY, RUN, ENV, WORKDIR or USER)"),
        }
    }
    Ok(())
}

/// Single-quotes `s` for bash.
pub fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// `p` as an absolute path, relative ones against `workdir`.
pub fn absolute(p: &str, workdir: &str) -> String {
    if p.starts_with('/') {
        p.to_string()
    } else {
        format!("{}/{p}", workdir.trim_end_matches('/'))
    }
}

/// Where a failing step stopped: its message for the build's `reason`.
pub struct StepFailure(pub String);

impl Builds {
    /// Runs `cmd` with `bash -l -c` in sandbox `sid` as `user` in `cwd`, each output line a
    /// log line of step `step`; a non-zero exit fails with the output's tail.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn run_in(
        &self,
        build: &str,
        sid: &str,
        step: &str,
        cmd: &str,
        user: &str,
        cwd: &str,
        env: &Env,
    ) -> std::result::Result<(), StepFailure> {
        let agent = self.manager.agent(sid, None);
        let mut req = bash_request(
            cmd,
            env.clone().into_iter().collect(),
            Some(cwd.into()),
            None,
        );
        req.stdin = Some(false);
        let mut tail: VecDeque<String> = VecDeque::new();
        let mut partial = Vec::new();
        let run = async {
            let mut stream = agent
                .start(&req, Some(user))
                .await
                .map_err(|e| StepFailure(format!("starting the command as {user:?}: {e}")))?;
            loop {
                match stream.next_event().await {
                    Ok(Some(
                        ProcessEvent::Stdout(b) | ProcessEvent::Stderr(b) | ProcessEvent::Pty(b),
                    )) => {
                        partial.extend_from_slice(&b);
                        while let Some(nl) = partial.iter().position(|c| *c == b'\n') {
                            let line: Vec<u8> = partial.drain(..=nl).collect();
                            let text = String::from_utf8_lossy(&line).trim_end().to_string();
                            self.log(build, "info", Some(step), text.clone()).await;
                            tail.push_back(text);
                            if tail.len() > TAIL_LINES {
                                tail.pop_front();
                            }
                        }
                    }
                    Ok(Some(ProcessEvent::Exited { code, error })) => {
                        if !partial.is_empty() {
                            let text = String::from_utf8_lossy(&partial).trim_end().to_string();
                            self.log(build, "info", Some(step), text.clone()).await;
                            tail.push_back(text);
                        }
                        return Ok((code, error));
                    }
                    Ok(Some(ProcessEvent::Started { .. })) => {}
                    Ok(None) => return Err(StepFailure("the command's output ended early".into())),
                    Err(e) => return Err(StepFailure(format!("the sandbox agent: {e}"))),
                }
            }
        };
        let (code, error) = tokio::time::timeout(STEP_TIMEOUT, run)
            .await
            .map_err(|_| {
                StepFailure(format!("still running after {}s", STEP_TIMEOUT.as_secs()))
            })??;
        if code == 0 {
            return Ok(());
        }
        let why = error.map(|e| format!(" ({e})")).unwrap_or_default();
        let tail: Vec<String> = tail.into_iter().collect();
        Err(StepFailure(format!(
            "exited with code {code}{why}; last output:\n{}",
            tail.join("\n")
        )))
    }

    /// Makes `workdir` in sandbox `sid` (as root) and gives it to `user`, as a step's working
    /// directory: with `/bin/bash`, as the steps run (an image may have nothing else, not
    /// even `mkdir`), but not as a login shell (whose profile costs more than the command).
    pub(super) async fn make_workdir(
        &self,
        sid: &str,
        workdir: &str,
        user: &str,
    ) -> std::result::Result<(), StepFailure> {
        let quoted = sh_quote(workdir);
        let cmd = format!(
            "mkdir -p {quoted} && chown {} {quoted} 2>/dev/null; true",
            sh_quote(user)
        );
        let opts = kiln_envd::RunOptions {
            user: Some("root".into()),
            cwd: Some("/".into()),
            timeout: Some(std::time::Duration::from_secs(60)),
            ..Default::default()
        };
        match self
            .manager
            .agent(sid, None)
            .exec("/bin/bash", &["-c", &cmd], opts)
            .await
        {
            Ok(out) if out.exit_code == 0 => Ok(()),
            Ok(out) => Err(StepFailure(format!(
                "exited with code {}: {}",
                out.exit_code,
                String::from_utf8_lossy(&out.stderr).trim_end()
            ))),
            Err(e) => Err(StepFailure(format!("the sandbox agent: {e}"))),
        }
    }

    /// `COPY`: the archive of `step` (already verified) placed in sandbox `sid`.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn copy_in(
        &self,
        build: &str,
        sid: &str,
        label: &str,
        team: &str,
        s: &Step,
        user: &str,
        workdir: &str,
    ) -> std::result::Result<(), StepFailure> {
        let hash = s.files_hash.clone().unwrap_or_default();
        let (src, dest) = (s.args[0].clone(), s.args[1].clone());
        let path = super::files::archive_path(&self.files_dir, team, &hash);
        if !path.is_file() {
            return Err(StepFailure(format!(
                "the files of COPY {src} (filesHash {hash}) were not uploaded"
            )));
        }
        let (p, max) = (path.clone(), self.upload_max * 8);
        let (src2, dest2) = (src.clone(), dest.clone());
        let got =
            tokio::task::spawn_blocking(move || super::files::files_hash(&p, &src2, &dest2, max))
                .await
                .map_err(|e| StepFailure(format!("checking the archive: {e}")))?
                .map_err(|e| StepFailure(format!("the uploaded files of COPY {src}: {e}")))?;
        if got != hash {
            return Err(StepFailure(format!(
                "the uploaded files of COPY {src} do not match its filesHash ({got} != {hash})"
            )));
        }
        let data = tokio::fs::read(&path)
            .await
            .map_err(|e| StepFailure(format!("reading the uploaded files: {e}")))?;
        let staged = "/tmp/.kiln-copy.tar";
        self.manager
            .agent(sid, None)
            .write_file(staged, data, Some("root"))
            .await
            .map_err(|e| StepFailure(format!("writing the files into the build sandbox: {e}")))?;
        let owner = s
            .args
            .get(2)
            .filter(|u| !u.is_empty())
            .cloned()
            .unwrap_or_else(|| user.into());
        let mode = s
            .args
            .get(3)
            .filter(|m| !m.is_empty())
            .cloned()
            .unwrap_or_default();
        let script = copy_script(
            &src,
            &absolute(&dest, workdir),
            dest.ends_with('/'),
            &owner,
            &mode,
            staged,
        );
        self.run_in(build, sid, label, &script, "root", "/", &Env::new())
            .await
    }
}

/// The shell script that unpacks `staged` and places what `src` matched at `dest` like
/// Docker's COPY: a directory's contents merge into `dest`; one file goes to `dest` (into it
/// when it ends with `/` or is a directory); several sources need `dest` to be a directory.
fn copy_script(
    src: &str,
    dest: &str,
    into_dir: bool,
    owner: &str,
    mode: &str,
    staged: &str,
) -> String {
    let q = sh_quote;
    let src = src.trim_start_matches("./").trim_end_matches('/');
    let src = if src.is_empty() { "." } else { src };
    format!(
        r#"set -e
S=$(mktemp -d /tmp/.kiln-copy.XXXXXX)
tar -xf {staged} -C "$S" --no-same-owner
rm -f {staged}
cd "$S"
shopt -s dotglob nullglob globstar
set -- {src_glob}
[ $# -gt 0 ] || {{ echo "COPY: nothing matched {src_show} in the uploaded files" >&2; exit 1; }}
D={dest}
if [ $# -gt 1 ] || [ -d "$1" ] || {into_dir} || [ -d "$D" ]; then
  mkdir -p "$D"
  for m in "$@"; do
    if [ -d "$m" ] && [ ! -L "$m" ]; then cp -a "$m"/. "$D"/; T="$D"; else cp -a "$m" "$D"/; T="$D/$(basename "$m")"; fi
    [ -z {owner} ] || chown -R {owner} "$T"
    [ -z {mode} ] || find "$T" -type f -exec chmod {mode_arg} {{}} +
  done
else
  mkdir -p "$(dirname "$D")"
  cp -a "$1" "$D"
  [ -z {owner} ] || chown -h {owner} "$D"
  [ -z {mode} ] || chmod {mode_arg} "$D"
fi
cd /
rm -rf "$S"
"#,
        staged = q(staged),
        src_glob = glob_words(src),
        src_show = src.replace(['"', '$', '`', '\\'], "_"),
        dest = q(dest),
        into_dir = if into_dir { "true" } else { "false" },
        owner = q(owner),
        mode = q(mode),
        mode_arg = if mode.is_empty() { "0".into() } else { q(mode) },
    )
}

/// `src` as bash words: glob characters stay live, everything else is quoted.
fn glob_words(src: &str) -> String {
    let mut out = String::new();
    for c in src.chars() {
        if matches!(c, '*' | '?' | '[' | ']') {
            out.push(c);
        } else {
            out.push_str(&sh_quote(&c.to_string()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_requests_are_checked() {
        let mut spec = StartSpec {
            from_template: Some("base".into()),
            ..Default::default()
        };
        assert!(validate(&spec).is_ok());
        spec.from_image = Some("x".into());
        assert!(validate(&spec).is_err());
        spec.from_image = None;
        spec.from_image_registry = Some(serde_json::json!({"type": "aws"}));
        let e = validate(&spec).unwrap_err();
        assert!(matches!(e, Error::BadRequest(_)), "{e:?}");
        let e = e.to_string();
        for what in [
            "not supported",
            "username=\"AWS\"",
            "aws ecr get-login-password",
        ] {
            assert!(e.contains(what), "{what}: {e}");
        }
        spec.from_image_registry = Some(serde_json::json!({"type": "gcp"}));
        assert!(validate(&spec).is_ok());
        spec.from_image_registry = None;
        spec.steps = vec![Step {
            kind: "COPY".into(),
            args: vec!["a".into(), "/b".into()],
            force: None,
            files_hash: Some("nothex".into()),
            force_upload: None,
        }];
        assert!(validate(&spec)
            .unwrap_err()
            .to_string()
            .contains("step 1 (COPY)"));
        spec.steps[0].kind = "FROB".into();
        assert!(validate(&spec).is_err());
    }

    #[test]
    fn quoting_and_paths() {
        assert_eq!(sh_quote("a'b"), r"'a'\''b'");
        assert_eq!(absolute("x", "/home/user/"), "/home/user/x");
        assert_eq!(absolute("/x", "/w"), "/x");
        assert_eq!(glob_words("a b*"), "'a'' ''b'*");
    }
}
