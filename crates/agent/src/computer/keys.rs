//! Key names of the computer-use vendors (Anthropic's xdotool-style `ctrl+s`, OpenAI's
//! `["CTRL", "S"]`, E2B's `enter`) mapped to the X keysym names of [`super::keysyms`].

/// One key name to its X keysym name; other names pass through (keysym names as X spells
/// them, and single characters, which are their own keysyms).
pub fn keysym(name: &str) -> String {
    let lower = name.trim().to_ascii_lowercase();
    let mapped = match lower.as_str() {
        "alt" | "alt_l" | "alt_left" | "option" => "alt",
        "alt_r" | "alt_right" => "Alt_R",
        "ctrl" | "control" | "control_l" | "control_left" | "ctrl_l" => "ctrl",
        "control_r" | "control_right" | "ctrl_r" => "Control_R",
        "shift" | "shift_l" | "shift_left" => "shift",
        "shift_r" | "shift_right" => "Shift_R",
        "cmd" | "command" | "meta" | "super" | "super_l" | "win" | "windows" => "super",
        "super_r" | "super_right" => "Super_R",
        "enter" | "return" => "Return",
        "esc" | "escape" => "Escape",
        "backspace" | "back_space" => "BackSpace",
        "tab" => "Tab",
        "space" | " " => "space",
        "del" | "delete" => "Delete",
        "ins" | "insert" => "Insert",
        "home" => "Home",
        "end" => "End",
        "pageup" | "page_up" | "pgup" | "prior" => "Page_Up",
        "pagedown" | "page_down" | "pgdn" | "next" => "Page_Down",
        "up" | "arrowup" | "arrow_up" => "Up",
        "down" | "arrowdown" | "arrow_down" => "Down",
        "left" | "arrowleft" | "arrow_left" => "Left",
        "right" | "arrowright" | "arrow_right" => "Right",
        "capslock" | "caps_lock" => "Caps_Lock",
        "numlock" | "num_lock" => "Num_Lock",
        "scrolllock" | "scroll_lock" => "Scroll_Lock",
        "print" | "printscreen" | "print_screen" => "Print",
        "pause" | "break" => "Pause",
        "menu" => "Menu",
        "minus" => "minus",
        "plus" => "plus",
        _ => {
            if let Some(n) = lower.strip_prefix('f').and_then(|n| n.parse::<u8>().ok()) {
                if (1..=24).contains(&n) {
                    return format!("F{n}");
                }
            }
            // Single characters keep their case ("A" types a capital); other names are
            // keysyms as given ("Return", "KP_Enter", "XF86AudioMute").
            return name.trim().to_string();
        }
    };
    mapped.to_string()
}

/// A combination: `"ctrl+shift+t"`, `"Return"`, or a list of keys pressed together.
pub fn combo<S: AsRef<str>>(keys: &[S]) -> String {
    keys.iter()
        .map(|k| keysym(k.as_ref()))
        .collect::<Vec<_>>()
        .join("+")
}

/// Splits `"ctrl+s"` (also `"ctrl-s"` is not split: `-` is a key) into its keys. A lone `+`
/// is the plus key.
pub fn split_combo(s: &str) -> Vec<String> {
    if s.trim() == "+" {
        return vec!["plus".into()];
    }
    s.split('+')
        .filter(|k| !k.trim().is_empty())
        .map(|k| k.trim().to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vendor_names_map_to_keysyms() {
        assert_eq!(combo(&split_combo("ctrl+s")), "ctrl+s");
        assert_eq!(combo(&["CTRL", "SHIFT", "T"]), "ctrl+shift+T");
        assert_eq!(combo(&["ENTER"]), "Return");
        assert_eq!(combo(&split_combo("cmd+ArrowLeft")), "super+Left");
        assert_eq!(keysym("f5"), "F5");
        assert_eq!(keysym("Esc"), "Escape");
        assert_eq!(keysym("KP_Enter"), "KP_Enter");
        assert_eq!(combo(&split_combo("+")), "plus");
    }
}
