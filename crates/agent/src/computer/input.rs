//! Input actions as the low-level steps the X side plays through XTEST: pointer moves, button
//! and key presses and releases (keys as keysyms), and pauses, with xdotool's timing (80 ms
//! between the clicks of a double click, 50 ms between repeated key combinations and between
//! the points of a drag, half the typing delay after each press and each release).

use std::time::Duration;

use super::actions::{Action, Point};
use super::keysyms;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Move { x: i64, y: i64 },
    Button { button: u8, press: bool },
    Key { keysym: u32, press: bool },
    Sleep(Duration),
}

const CLICK_GAP: Duration = Duration::from_millis(80);
const SCROLL_GAP: Duration = Duration::from_millis(30);
const KEY_REPEAT_GAP: Duration = Duration::from_millis(50);
const DRAG_GAP: Duration = Duration::from_millis(50);

struct Steps(Vec<Step>);

impl Steps {
    fn push(&mut self, s: Step) {
        self.0.push(s);
    }
    fn sleep(&mut self, d: Duration) {
        if !d.is_zero() {
            self.0.push(Step::Sleep(d));
        }
    }
    fn move_to(&mut self, p: Point) {
        self.push(Step::Move { x: p.x, y: p.y });
    }
    fn keys(&mut self, keysyms: &[u32], press: bool) {
        let mut ks = keysyms.to_vec();
        if !press {
            ks.reverse();
        }
        for keysym in ks {
            self.push(Step::Key { keysym, press });
        }
    }
    fn clicks(&mut self, button: u8, n: u32, gap: Duration) {
        for i in 0..n {
            if i > 0 {
                self.sleep(gap);
            }
            self.push(Step::Button {
                button,
                press: true,
            });
            self.push(Step::Button {
                button,
                press: false,
            });
        }
    }
}

/// The steps of an input action, or `Ok(None)` for actions that are not input.
pub fn steps(a: &Action) -> Result<Option<Vec<Step>>, String> {
    let mut s = Steps(Vec::new());
    match a {
        Action::Move(p) => s.move_to(*p),
        Action::Click {
            at,
            button,
            count,
            modifiers,
        } => {
            let mods = keysyms::modifier_keysyms(modifiers)?;
            if let Some(p) = at {
                s.move_to(*p);
            }
            s.keys(&mods, true);
            s.clicks(*button as u8, *count, CLICK_GAP);
            s.keys(&mods, false);
        }
        Action::MouseDown(b) => s.push(Step::Button {
            button: *b as u8,
            press: true,
        }),
        Action::MouseUp(b) => s.push(Step::Button {
            button: *b as u8,
            press: false,
        }),
        Action::Drag { path, button } => {
            let button = *button as u8;
            s.move_to(path[0]);
            s.push(Step::Button {
                button,
                press: true,
            });
            for p in &path[1..] {
                s.sleep(DRAG_GAP);
                s.move_to(*p);
            }
            s.sleep(DRAG_GAP);
            s.push(Step::Button {
                button,
                press: false,
            });
        }
        Action::Scroll {
            at,
            dx,
            dy,
            modifiers,
        } => {
            let mods = keysyms::modifier_keysyms(modifiers)?;
            if let Some(p) = at {
                s.move_to(*p);
            }
            s.keys(&mods, true);
            // Wheel buttons: 4 up, 5 down, 6 left, 7 right.
            for (n, neg, pos) in [(*dy, 4, 5), (*dx, 6, 7)] {
                if n != 0 {
                    let b = if n < 0 { neg } else { pos };
                    s.clicks(b, n.unsigned_abs() as u32, SCROLL_GAP);
                }
            }
            s.keys(&mods, false);
        }
        Action::Type { text, delay_ms } => {
            let half = Duration::from_millis(*delay_ms) / 2;
            let mut chars = text.chars().peekable();
            while let Some(c) = chars.next() {
                if c == '\r' && chars.peek() == Some(&'\n') {
                    continue;
                }
                let keysym = keysyms::of_char(c);
                s.push(Step::Key {
                    keysym,
                    press: true,
                });
                s.sleep(half);
                s.push(Step::Key {
                    keysym,
                    press: false,
                });
                s.sleep(half);
            }
        }
        Action::Key { combo, repeat } => {
            let ks = keysyms::combo_keysyms(combo)?;
            for i in 0..*repeat {
                if i > 0 {
                    s.sleep(KEY_REPEAT_GAP);
                }
                s.keys(&ks, true);
                s.keys(&ks, false);
            }
        }
        Action::HoldKey { combo, seconds } => {
            let ks = keysyms::combo_keysyms(combo)?;
            s.keys(&ks, true);
            s.sleep(Duration::from_secs_f64(*seconds));
            s.keys(&ks, false);
        }
        _ => return Ok(None),
    }
    Ok(Some(s.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use Step::*;

    fn of(v: serde_json::Value) -> Vec<Step> {
        steps(&Action::parse(&v).unwrap()).unwrap().unwrap()
    }

    #[test]
    fn click_with_modifiers() {
        assert_eq!(
            of(json!({"action": "double_click", "coordinate": [7, 8], "modifiers": ["ctrl"]})),
            vec![
                Move { x: 7, y: 8 },
                Key {
                    keysym: 0xffe3,
                    press: true
                },
                Button {
                    button: 1,
                    press: true
                },
                Button {
                    button: 1,
                    press: false
                },
                Sleep(CLICK_GAP),
                Button {
                    button: 1,
                    press: true
                },
                Button {
                    button: 1,
                    press: false
                },
                Key {
                    keysym: 0xffe3,
                    press: false
                },
            ]
        );
    }

    #[test]
    fn key_combinations_release_in_reverse() {
        assert_eq!(
            of(json!({"type": "keypress", "keys": ["CTRL", "SHIFT", "t"]})),
            vec![
                Key {
                    keysym: 0xffe3,
                    press: true
                },
                Key {
                    keysym: 0xffe1,
                    press: true
                },
                Key {
                    keysym: 0x74,
                    press: true
                },
                Key {
                    keysym: 0x74,
                    press: false
                },
                Key {
                    keysym: 0xffe1,
                    press: false
                },
                Key {
                    keysym: 0xffe3,
                    press: false
                },
            ]
        );
        assert_eq!(
            keysyms::combo_keysyms("ctrl++").unwrap(),
            vec![0xffe3, 0x2b]
        );
        assert_eq!(keysyms::combo_keysyms("plus").unwrap(), vec![0x2b]);
        assert!(keysyms::combo_keysyms("ctrl+nosuchkey").is_err());
    }

    #[test]
    fn typing_text_with_non_ascii_characters() {
        assert_eq!(
            of(json!({"action": "type", "text": "é\r\n€", "delay_ms": 0})),
            vec![
                Key {
                    keysym: 0xe9,
                    press: true
                },
                Key {
                    keysym: 0xe9,
                    press: false
                },
                Key {
                    keysym: 0xff0d,
                    press: true
                },
                Key {
                    keysym: 0xff0d,
                    press: false
                },
                Key {
                    keysym: 0x10020ac,
                    press: true
                },
                Key {
                    keysym: 0x10020ac,
                    press: false
                },
            ]
        );
        let typed = of(json!({"action": "type", "text": "ab", "delay_ms": 20}));
        assert_eq!(typed.len(), 8);
        assert_eq!(typed[1], Sleep(Duration::from_millis(10)));
    }

    #[test]
    fn scroll_drag_and_hold() {
        assert_eq!(
            of(json!({"type": "scroll", "x": 1, "y": 2, "scroll_x": -100, "scroll_y": 0})),
            vec![
                Move { x: 1, y: 2 },
                Button {
                    button: 6,
                    press: true
                },
                Button {
                    button: 6,
                    press: false
                },
            ]
        );
        let drag = of(
            json!({"action": "left_click_drag", "start_coordinate": [1, 2], "coordinate": [3, 4]}),
        );
        assert_eq!(drag.first(), Some(&Move { x: 1, y: 2 }));
        assert_eq!(
            drag.last(),
            Some(&Button {
                button: 1,
                press: false
            })
        );
        assert!(drag.contains(&Move { x: 3, y: 4 }));
        let hold = of(json!({"action": "hold_key", "text": "shift", "duration": 0.25}));
        assert_eq!(hold[1], Sleep(Duration::from_millis(250)));
        assert_eq!(steps(&Action::Screenshot).unwrap(), None);
    }
}
