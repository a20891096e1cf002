//! The X display side of the computer-use service: xdotool for input and queries, scrot for
//! screenshots (the same tools `e2b-desktop` runs, so both see the same screen).

use std::path::PathBuf;
use std::time::Duration;

use tokio::process::Command;

/// Longest any one tool run may take (a hold or drag included).
const TOOL_TIMEOUT: Duration = Duration::from_secs(90);

#[derive(Debug, Clone)]
pub struct Display {
    pub name: String,
    pub tmp: PathBuf,
}

/// A captured image.
#[derive(Debug, Clone)]
pub struct Image {
    pub format: &'static str,
    pub bytes: Vec<u8>,
    pub width: u32,
    pub height: u32,
}

/// Width and height of a PNG from its IHDR chunk.
pub fn png_size(b: &[u8]) -> Option<(u32, u32)> {
    if b.len() < 24 || &b[..8] != b"\x89PNG\r\n\x1a\n" {
        return None;
    }
    let w = u32::from_be_bytes(b[16..20].try_into().ok()?);
    let h = u32::from_be_bytes(b[20..24].try_into().ok()?);
    Some((w, h))
}

impl Display {
    async fn run(&self, tool: &str, args: &[String]) -> Result<String, String> {
        let mut cmd = Command::new(tool);
        cmd.args(args)
            .env("DISPLAY", &self.name)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        let out = tokio::time::timeout(TOOL_TIMEOUT, cmd.output())
            .await
            .map_err(|_| format!("{tool} did not finish within {TOOL_TIMEOUT:?}"))?
            .map_err(|e| format!("running {tool}: {e}"))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            return Err(format!(
                "{tool} failed ({}): {}",
                out.status,
                err.trim().chars().take(500).collect::<String>()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Runs a chain of xdotool commands.
    pub async fn xdotool(&self, args: &[String]) -> Result<String, String> {
        self.run("xdotool", args).await
    }

    /// The pointer position.
    pub async fn cursor(&self) -> Result<(i64, i64), String> {
        let out = self
            .xdotool(&["getmouselocation".into(), "--shell".into()])
            .await?;
        let get = |k: &str| {
            out.lines()
                .find_map(|l| l.strip_prefix(k)?.strip_prefix('=')?.trim().parse().ok())
        };
        match (get("X"), get("Y")) {
            (Some(x), Some(y)) => Ok((x, y)),
            _ => Err(format!("unexpected xdotool output: {out:?}")),
        }
    }

    /// The screen size.
    pub async fn size(&self) -> Result<(u32, u32), String> {
        let out = self.xdotool(&["getdisplaygeometry".into()]).await?;
        let mut it = out.split_whitespace().filter_map(|s| s.parse().ok());
        match (it.next(), it.next()) {
            (Some(w), Some(h)) => Ok((w, h)),
            _ => Err(format!("unexpected xdotool output: {out:?}")),
        }
    }

    /// A screenshot (with the pointer) of the screen or of a region `[x0, y0, x1, y1]`.
    pub async fn screenshot(&self, jpeg: bool, region: Option<[i64; 4]>) -> Result<Image, String> {
        let _ = std::fs::create_dir_all(&self.tmp);
        let ext = if jpeg { "jpg" } else { "png" };
        let path = self
            .tmp
            .join(format!("shot-{:016x}.{ext}", rand::random::<u64>()));
        let mut args: Vec<String> = vec!["--pointer".into(), "--overwrite".into()];
        if jpeg {
            args.extend(["--quality".into(), "80".into()]);
        }
        if let Some([x0, y0, x1, y1]) = region {
            args.push("--autoselect".into());
            args.push(format!("{x0},{y0},{},{}", x1 - x0, y1 - y0));
        }
        args.push(path.display().to_string());
        let res = self.run("scrot", &args).await;
        let bytes = std::fs::read(&path);
        let _ = std::fs::remove_file(&path);
        res?;
        let bytes = bytes.map_err(|e| format!("reading the screenshot: {e}"))?;
        let (width, height) = match png_size(&bytes) {
            Some(s) => s,
            None => match region {
                Some([x0, y0, x1, y1]) => ((x1 - x0) as u32, (y1 - y0) as u32),
                None => self.size().await?,
            },
        };
        Ok(Image {
            format: if jpeg { "jpeg" } else { "png" },
            bytes,
            width,
            height,
        })
    }
}
