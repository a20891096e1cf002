//! Computer-use actions: one JSON object each, in Anthropic's or OpenAI's vocabulary (the
//! `action` or `type` field), parsed into [`Action`]; [`super::input`] turns input actions into
//! the steps the X side plays.

use serde_json::{Map, Value};

use super::{keys, keysyms};

/// Mouse buttons as X numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Button {
    Left = 1,
    Middle = 2,
    Right = 3,
    Back = 8,
    Forward = 9,
}

impl Button {
    fn parse(v: Option<&Value>) -> Result<Button, String> {
        match v.and_then(Value::as_str).unwrap_or("left") {
            "left" => Ok(Button::Left),
            "middle" | "wheel" => Ok(Button::Middle),
            "right" => Ok(Button::Right),
            "back" => Ok(Button::Back),
            "forward" => Ok(Button::Forward),
            other => Err(format!("unknown mouse button {other:?}")),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Point {
    pub x: i64,
    pub y: i64,
}

/// One action, normalised.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    Screenshot,
    CursorPosition,
    DisplayInfo,
    Move(Point),
    Click {
        at: Option<Point>,
        button: Button,
        count: u32,
        modifiers: Vec<String>,
    },
    MouseDown(Button),
    MouseUp(Button),
    /// Press at the first point, move through the rest, release at the last.
    Drag {
        path: Vec<Point>,
        button: Button,
    },
    /// Wheel clicks: positive dy scrolls down, positive dx right.
    Scroll {
        at: Option<Point>,
        dx: i64,
        dy: i64,
        modifiers: Vec<String>,
    },
    Type {
        text: String,
        delay_ms: u64,
    },
    Key {
        combo: String,
        repeat: u32,
    },
    HoldKey {
        combo: String,
        seconds: f64,
    },
    Wait {
        seconds: f64,
    },
    /// A screenshot of a region `[x0, y0, x1, y1]`.
    Zoom {
        region: [i64; 4],
    },
}

/// Longest wait or hold one action may ask for.
pub const MAX_WAIT_SECONDS: f64 = 60.0;
/// OpenAI's scroll amounts are pixels; one wheel click is this many.
pub const PIXELS_PER_WHEEL_CLICK: i64 = 100;

fn num(v: &Value) -> Option<f64> {
    v.as_f64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
}

fn point_of(v: &Value) -> Option<Point> {
    match v {
        Value::Array(a) if a.len() == 2 => Some(Point {
            x: num(&a[0])?.round() as i64,
            y: num(&a[1])?.round() as i64,
        }),
        Value::Object(o) => Some(Point {
            x: num(o.get("x")?)?.round() as i64,
            y: num(o.get("y")?)?.round() as i64,
        }),
        _ => None,
    }
}

/// `coordinate: [x, y]` (Anthropic) or `x`, `y` (OpenAI, E2B).
fn point(o: &Map<String, Value>, field: &str) -> Result<Option<Point>, String> {
    if let Some(v) = o.get(field) {
        return point_of(v)
            .map(Some)
            .ok_or_else(|| format!("{field} must be [x, y] or {{x, y}}"));
    }
    if field == "coordinate" && o.contains_key("x") {
        let p = point_of(&Value::Object(o.clone()))
            .ok_or_else(|| "x and y must be numbers".to_string())?;
        return Ok(Some(p));
    }
    Ok(None)
}

fn need_point(o: &Map<String, Value>, field: &str) -> Result<Point, String> {
    point(o, field)?.ok_or_else(|| format!("missing {field}"))
}

/// Keys given as `keys: [..]` (OpenAI), `text: "ctrl+s"` (Anthropic) or `key: ".."`.
fn key_list(o: &Map<String, Value>) -> Result<Vec<String>, String> {
    if let Some(Value::Array(a)) = o.get("keys") {
        let ks: Vec<String> = a
            .iter()
            .filter_map(|k| k.as_str().map(str::to_string))
            .collect();
        if ks.is_empty() || ks.len() != a.len() {
            return Err("keys must be a non-empty list of key names".into());
        }
        return Ok(ks);
    }
    for f in ["text", "key", "keys"] {
        if let Some(s) = o.get(f).and_then(Value::as_str) {
            let ks = keys::split_combo(s);
            if !ks.is_empty() {
                return Ok(ks);
            }
        }
    }
    Err("missing keys (keys: [..] or text: \"ctrl+s\")".into())
}

/// Modifier keys held during a click or scroll: `modifiers: [..]`, OpenAI's `keys: [..]`, or
/// Anthropic's `text: "shift"`.
fn modifiers(o: &Map<String, Value>) -> Vec<String> {
    let from = |v: &Value| -> Vec<String> {
        match v {
            Value::Array(a) => a
                .iter()
                .filter_map(Value::as_str)
                .map(keys::keysym)
                .collect(),
            Value::String(s) => keys::split_combo(s)
                .iter()
                .map(|k| keys::keysym(k))
                .collect(),
            _ => Vec::new(),
        }
    };
    for f in ["modifiers", "keys", "text"] {
        if let Some(v) = o.get(f) {
            return from(v);
        }
    }
    Vec::new()
}

/// The combination of `key_list`, every key known (an unknown name is the request's error).
fn known_combo(o: &Map<String, Value>) -> Result<String, String> {
    let combo = keys::combo(&key_list(o)?);
    keysyms::combo_keysyms(&combo)?;
    Ok(combo)
}

fn known_modifiers(o: &Map<String, Value>) -> Result<Vec<String>, String> {
    let m = modifiers(o);
    keysyms::modifier_keysyms(&m)?;
    Ok(m)
}

fn seconds(o: &Map<String, Value>) -> Result<f64, String> {
    let s = if let Some(v) = o.get("duration").or(o.get("seconds")) {
        num(v).ok_or("duration must be a number of seconds")?
    } else if let Some(v) = o.get("ms") {
        num(v).ok_or("ms must be a number")? / 1000.0
    } else {
        1.0
    };
    if !(0.0..=MAX_WAIT_SECONDS).contains(&s) {
        return Err(format!("duration must be 0-{MAX_WAIT_SECONDS} seconds"));
    }
    Ok(s)
}

fn count(o: &Map<String, Value>, default: u32) -> Result<u32, String> {
    match o.get("count").or(o.get("repeat")) {
        None => Ok(default),
        Some(v) => match num(v) {
            Some(n) if (1.0..=100.0).contains(&n) => Ok(n as u32),
            _ => Err("count must be 1-100".into()),
        },
    }
}

impl Action {
    /// Parses one action object.
    pub fn parse(v: &Value) -> Result<Action, String> {
        let o = v.as_object().ok_or("an action is a JSON object")?;
        let name = o
            .get("action")
            .or(o.get("type"))
            .and_then(Value::as_str)
            .ok_or("missing action (or type)")?;
        let click = |button: Button, n: u32| -> Result<Action, String> {
            Ok(Action::Click {
                at: point(o, "coordinate")?,
                button,
                count: count(o, n)?,
                modifiers: known_modifiers(o)?,
            })
        };
        Ok(match name {
            "screenshot" => Action::Screenshot,
            "cursor_position" | "get_cursor_position" => Action::CursorPosition,
            "display_info" | "screen_size" => Action::DisplayInfo,
            "mouse_move" | "move" => Action::Move(need_point(o, "coordinate")?),
            "click" => click(Button::parse(o.get("button"))?, 1)?,
            "left_click" => click(Button::Left, 1)?,
            "right_click" => click(Button::Right, 1)?,
            "middle_click" => click(Button::Middle, 1)?,
            "double_click" => click(Button::parse(o.get("button"))?, 2)?,
            "triple_click" => click(Button::parse(o.get("button"))?, 3)?,
            "left_mouse_down" => Action::MouseDown(Button::Left),
            "left_mouse_up" => Action::MouseUp(Button::Left),
            "mouse_down" => Action::MouseDown(Button::parse(o.get("button"))?),
            "mouse_up" => Action::MouseUp(Button::parse(o.get("button"))?),
            "left_click_drag" => Action::Drag {
                path: vec![
                    need_point(o, "start_coordinate")?,
                    need_point(o, "coordinate")?,
                ],
                button: Button::Left,
            },
            "drag" => {
                let path: Vec<Point> = match o.get("path") {
                    Some(Value::Array(a)) => a
                        .iter()
                        .map(|p| point_of(p).ok_or("path points must be [x, y] or {x, y}"))
                        .collect::<Result<_, _>>()?,
                    _ => return Err("drag needs path: [{x, y}, ...]".into()),
                };
                if path.len() < 2 {
                    return Err("a drag path needs at least two points".into());
                }
                Action::Drag {
                    path,
                    button: Button::parse(o.get("button"))?,
                }
            }
            "scroll" => {
                let (dx, dy) = if let Some(dir) = o
                    .get("scroll_direction")
                    .or(o.get("direction"))
                    .and_then(Value::as_str)
                {
                    let n = match o.get("scroll_amount").or(o.get("amount")) {
                        None => 1,
                        Some(v) => num(v).ok_or("amount must be a number")?.round() as i64,
                    };
                    match dir {
                        "up" => (0, -n),
                        "down" => (0, n),
                        "left" => (-n, 0),
                        "right" => (n, 0),
                        other => return Err(format!("unknown scroll direction {other:?}")),
                    }
                } else {
                    let px = |f: &str| o.get(f).and_then(num).unwrap_or(0.0).round() as i64;
                    let clicks = |p: i64| {
                        if p == 0 {
                            0
                        } else {
                            p.signum() * (p.abs() / PIXELS_PER_WHEEL_CLICK).max(1)
                        }
                    };
                    (clicks(px("scroll_x")), clicks(px("scroll_y")))
                };
                if dx.abs() > 1000 || dy.abs() > 1000 {
                    return Err("scroll amount too large".into());
                }
                Action::Scroll {
                    at: point(o, "coordinate")?,
                    dx,
                    dy,
                    modifiers: known_modifiers(o)?,
                }
            }
            "type" => {
                let text = o
                    .get("text")
                    .and_then(Value::as_str)
                    .ok_or("type needs text")?
                    .to_string();
                let delay_ms = o.get("delay_ms").and_then(num).unwrap_or(12.0);
                if !(0.0..=1000.0).contains(&delay_ms) {
                    return Err("delay_ms must be 0-1000".into());
                }
                Action::Type {
                    text,
                    delay_ms: delay_ms as u64,
                }
            }
            "key" | "keypress" => Action::Key {
                combo: known_combo(o)?,
                repeat: count(o, 1)?,
            },
            "hold_key" => Action::HoldKey {
                combo: known_combo(o)?,
                seconds: seconds(o)?,
            },
            "wait" => Action::Wait {
                seconds: if o.contains_key("duration")
                    || o.contains_key("seconds")
                    || o.contains_key("ms")
                {
                    seconds(o)?
                } else {
                    // OpenAI's wait has no duration; its reference loops wait about 2 s.
                    2.0
                },
            },
            "zoom" => {
                let r = match o.get("region") {
                    Some(Value::Array(a)) if a.len() == 4 => {
                        let mut r = [0i64; 4];
                        for (i, v) in a.iter().enumerate() {
                            r[i] = num(v).ok_or("region must be four numbers")?.round() as i64;
                        }
                        r
                    }
                    _ => return Err("zoom needs region: [x0, y0, x1, y1]".into()),
                };
                if r[2] <= r[0] || r[3] <= r[1] || r[0] < 0 || r[1] < 0 {
                    return Err("region must be [x0, y0, x1, y1] with x1 > x0 and y1 > y0".into());
                }
                Action::Zoom { region: r }
            }
            other => return Err(format!("unknown action {other:?}")),
        })
    }

    /// Scales every coordinate by `(sx, sy)` (model space to screen).
    pub fn scale(&mut self, sx: f64, sy: f64) {
        let s = |p: &mut Point| {
            p.x = (p.x as f64 * sx).round() as i64;
            p.y = (p.y as f64 * sy).round() as i64;
        };
        match self {
            Action::Move(p) => s(p),
            Action::Click { at: Some(p), .. } | Action::Scroll { at: Some(p), .. } => s(p),
            Action::Drag { path, .. } => path.iter_mut().for_each(s),
            Action::Zoom { region } => {
                let mut a = Point {
                    x: region[0],
                    y: region[1],
                };
                let mut b = Point {
                    x: region[2],
                    y: region[3],
                };
                s(&mut a);
                s(&mut b);
                *region = [a.x, a.y, b.x, b.y];
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn p(v: Value) -> Action {
        Action::parse(&v).unwrap()
    }

    #[test]
    fn anthropic_actions() {
        assert_eq!(
            p(json!({"action": "double_click", "coordinate": [10, 20], "text": "shift"})),
            Action::Click {
                at: Some(Point { x: 10, y: 20 }),
                button: Button::Left,
                count: 2,
                modifiers: vec!["shift".into()]
            }
        );
        assert_eq!(
            p(
                json!({"action": "scroll", "coordinate": [5, 5], "scroll_direction": "up", "scroll_amount": 3})
            ),
            Action::Scroll {
                at: Some(Point { x: 5, y: 5 }),
                dx: 0,
                dy: -3,
                modifiers: vec![]
            }
        );
        assert_eq!(
            p(json!({"action": "key", "text": "ctrl+s"})),
            Action::Key {
                combo: "ctrl+s".into(),
                repeat: 1
            }
        );
        assert_eq!(
            p(json!({"action": "hold_key", "text": "shift", "duration": 0.5})),
            Action::HoldKey {
                combo: "shift".into(),
                seconds: 0.5
            }
        );
        assert!(matches!(
            p(json!({"action": "left_click_drag", "start_coordinate": [1, 2], "coordinate": [3, 4]})),
            Action::Drag { path, .. } if path.len() == 2
        ));
        assert_eq!(
            p(json!({"action": "zoom", "region": [0, 0, 100, 50]})),
            Action::Zoom {
                region: [0, 0, 100, 50]
            }
        );
    }

    #[test]
    fn openai_actions() {
        assert_eq!(
            p(json!({"type": "click", "x": 3, "y": 4, "button": "right"})),
            Action::Click {
                at: Some(Point { x: 3, y: 4 }),
                button: Button::Right,
                count: 1,
                modifiers: vec![]
            }
        );
        assert_eq!(
            p(json!({"type": "scroll", "x": 1, "y": 1, "scroll_x": 0, "scroll_y": 250})),
            Action::Scroll {
                at: Some(Point { x: 1, y: 1 }),
                dx: 0,
                dy: 2,
                modifiers: vec![]
            }
        );
        assert_eq!(
            p(json!({"type": "keypress", "keys": ["CTRL", "A"]})),
            Action::Key {
                combo: "ctrl+A".into(),
                repeat: 1
            }
        );
        assert!(matches!(
            p(json!({"type": "drag", "path": [{"x": 1, "y": 1}, {"x": 2, "y": 2}, {"x": 3, "y": 3}]})),
            Action::Drag { path, .. } if path.len() == 3
        ));
        assert_eq!(p(json!({"type": "wait"})), Action::Wait { seconds: 2.0 });
    }

    #[test]
    fn bad_actions_are_errors() {
        for v in [
            json!({"action": "fly"}),
            json!({"action": "mouse_move"}),
            json!({"action": "wait", "duration": 1e9}),
            json!({"action": "zoom", "region": [10, 10, 5, 5]}),
            json!({"type": "drag", "path": [[1, 1]]}),
            json!({"action": "key", "text": "ctrl+nosuchkey"}),
            json!({"action": "left_click", "coordinate": [1, 1], "text": "hyperdrive"}),
            json!("click"),
        ] {
            assert!(Action::parse(&v).is_err(), "{v}");
        }
    }

    #[test]
    fn scaling() {
        let mut a = p(json!({"action": "mouse_move", "coordinate": [50, 50]}));
        a.scale(2.0, 0.5);
        assert_eq!(a, Action::Move(Point { x: 100, y: 25 }));
    }
}
