//! What the tap reads of filesystem requests, and the names it gives operations.

use serde_json::{json, Value};

use super::tap_record::{decode, first_envelope, Codec};

pub(super) fn fs_request(c: Codec, m: &str, body: &[u8]) -> Option<Value> {
    use kiln_proto::filesystem as fs;
    Some(match m {
        "Stat" => json!({ "path": decode::<fs::StatRequest>(c, body)?.path }),
        "MakeDir" => json!({ "path": decode::<fs::MakeDirRequest>(c, body)?.path }),
        "Remove" => json!({ "path": decode::<fs::RemoveRequest>(c, body)?.path }),
        "ListDir" => {
            let r = decode::<fs::ListDirRequest>(c, body)?;
            json!({ "path": r.path, "depth": r.depth })
        }
        "Move" => {
            let r = decode::<fs::MoveRequest>(c, body)?;
            json!({ "path": r.source, "destination": r.destination })
        }
        "WatchDir" => {
            let p = first_envelope(body)?;
            let r = decode::<fs::WatchDirRequest>(c, &p)?;
            json!({ "path": r.path, "recursive": r.recursive })
        }
        "CreateWatcher" => {
            let r = decode::<fs::CreateWatcherRequest>(c, body)?;
            json!({ "path": r.path, "recursive": r.recursive })
        }
        "RemoveWatcher" => json!({
            "watcherId": decode::<fs::RemoveWatcherRequest>(c, body)?.watcher_id
        }),
        _ => return None,
    })
}

pub(super) fn fs_op(m: &str) -> String {
    match m {
        "Stat" => "stat".into(),
        "MakeDir" => "mkdir".into(),
        "Remove" => "remove".into(),
        "ListDir" => "list".into(),
        "Move" => "move".into(),
        "WatchDir" => "watch".into(),
        "CreateWatcher" => "watch".into(),
        "RemoveWatcher" => "unwatch".into(),
        other => other.to_ascii_lowercase(),
    }
}

pub(super) fn event_name(m: &str) -> String {
    match m {
        "SendInput" => "input".into(),
        "StreamInput" => "input_stream".into(),
        "SendSignal" => "signal".into(),
        "CloseStdin" => "close_stdin".into(),
        "Update" => "resize".into(),
        other => other.to_ascii_lowercase(),
    }
}
