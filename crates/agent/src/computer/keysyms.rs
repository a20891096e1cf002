//! X keysym names and values (from X11's keysymdef.h and XF86keysym.h): the names `xdotool`
//! and the vendors' key lists use, characters as keysyms, and `U20AC` / `0xff0d` forms.

/// Named keysyms outside Latin-1's printable characters (which are their own keysyms).
const NAMED: &[(&str, u32)] = &[
    ("BackSpace", 0xff08),
    ("Tab", 0xff09),
    ("Linefeed", 0xff0a),
    ("Clear", 0xff0b),
    ("Return", 0xff0d),
    ("Pause", 0xff13),
    ("Scroll_Lock", 0xff14),
    ("Sys_Req", 0xff15),
    ("Escape", 0xff1b),
    ("Multi_key", 0xff20),
    ("Home", 0xff50),
    ("Left", 0xff51),
    ("Up", 0xff52),
    ("Right", 0xff53),
    ("Down", 0xff54),
    ("Prior", 0xff55),
    ("Page_Up", 0xff55),
    ("Next", 0xff56),
    ("Page_Down", 0xff56),
    ("End", 0xff57),
    ("Begin", 0xff58),
    ("Select", 0xff60),
    ("Print", 0xff61),
    ("Execute", 0xff62),
    ("Insert", 0xff63),
    ("Undo", 0xff65),
    ("Redo", 0xff66),
    ("Menu", 0xff67),
    ("Find", 0xff68),
    ("Cancel", 0xff69),
    ("Help", 0xff6a),
    ("Break", 0xff6b),
    ("Mode_switch", 0xff7e),
    ("Num_Lock", 0xff7f),
    ("KP_Space", 0xff80),
    ("KP_Tab", 0xff89),
    ("KP_Enter", 0xff8d),
    ("KP_F1", 0xff91),
    ("KP_F2", 0xff92),
    ("KP_F3", 0xff93),
    ("KP_F4", 0xff94),
    ("KP_Home", 0xff95),
    ("KP_Left", 0xff96),
    ("KP_Up", 0xff97),
    ("KP_Right", 0xff98),
    ("KP_Down", 0xff99),
    ("KP_Prior", 0xff9a),
    ("KP_Page_Up", 0xff9a),
    ("KP_Next", 0xff9b),
    ("KP_Page_Down", 0xff9b),
    ("KP_End", 0xff9c),
    ("KP_Begin", 0xff9d),
    ("KP_Insert", 0xff9e),
    ("KP_Delete", 0xff9f),
    ("KP_Multiply", 0xffaa),
    ("KP_Add", 0xffab),
    ("KP_Separator", 0xffac),
    ("KP_Subtract", 0xffad),
    ("KP_Decimal", 0xffae),
    ("KP_Divide", 0xffaf),
    ("KP_0", 0xffb0),
    ("KP_1", 0xffb1),
    ("KP_2", 0xffb2),
    ("KP_3", 0xffb3),
    ("KP_4", 0xffb4),
    ("KP_5", 0xffb5),
    ("KP_6", 0xffb6),
    ("KP_7", 0xffb7),
    ("KP_8", 0xffb8),
    ("KP_9", 0xffb9),
    ("KP_Equal", 0xffbd),
    ("Shift_L", 0xffe1),
    ("Shift_R", 0xffe2),
    ("Control_L", 0xffe3),
    ("Control_R", 0xffe4),
    ("Caps_Lock", 0xffe5),
    ("Shift_Lock", 0xffe6),
    ("Meta_L", 0xffe7),
    ("Meta_R", 0xffe8),
    ("Alt_L", 0xffe9),
    ("Alt_R", 0xffea),
    ("Super_L", 0xffeb),
    ("Super_R", 0xffec),
    ("Hyper_L", 0xffed),
    ("Hyper_R", 0xffee),
    ("ISO_Level3_Shift", 0xfe03),
    ("ISO_Left_Tab", 0xfe20),
    ("Delete", 0xffff),
    // xdotool's modifier aliases.
    ("shift", 0xffe1),
    ("ctrl", 0xffe3),
    ("control", 0xffe3),
    ("alt", 0xffe9),
    ("meta", 0xffe7),
    ("super", 0xffeb),
    // Latin-1 punctuation by name.
    ("space", 0x20),
    ("exclam", 0x21),
    ("quotedbl", 0x22),
    ("numbersign", 0x23),
    ("dollar", 0x24),
    ("percent", 0x25),
    ("ampersand", 0x26),
    ("apostrophe", 0x27),
    ("quoteright", 0x27),
    ("parenleft", 0x28),
    ("parenright", 0x29),
    ("asterisk", 0x2a),
    ("plus", 0x2b),
    ("comma", 0x2c),
    ("minus", 0x2d),
    ("period", 0x2e),
    ("slash", 0x2f),
    ("colon", 0x3a),
    ("semicolon", 0x3b),
    ("less", 0x3c),
    ("equal", 0x3d),
    ("greater", 0x3e),
    ("question", 0x3f),
    ("at", 0x40),
    ("bracketleft", 0x5b),
    ("backslash", 0x5c),
    ("bracketright", 0x5d),
    ("asciicircum", 0x5e),
    ("underscore", 0x5f),
    ("grave", 0x60),
    ("quoteleft", 0x60),
    ("braceleft", 0x7b),
    ("bar", 0x7c),
    ("braceright", 0x7d),
    ("asciitilde", 0x7e),
    ("nobreakspace", 0xa0),
    ("EuroSign", 0x20ac),
    // Media and browser keys (XF86keysym.h).
    ("XF86MonBrightnessUp", 0x1008ff02),
    ("XF86MonBrightnessDown", 0x1008ff03),
    ("XF86AudioLowerVolume", 0x1008ff11),
    ("XF86AudioMute", 0x1008ff12),
    ("XF86AudioRaiseVolume", 0x1008ff13),
    ("XF86AudioPlay", 0x1008ff14),
    ("XF86AudioStop", 0x1008ff15),
    ("XF86AudioPrev", 0x1008ff16),
    ("XF86AudioNext", 0x1008ff17),
    ("XF86HomePage", 0x1008ff18),
    ("XF86Mail", 0x1008ff19),
    ("XF86Search", 0x1008ff1b),
    ("XF86Calculator", 0x1008ff1d),
    ("XF86Back", 0x1008ff26),
    ("XF86Forward", 0x1008ff27),
    ("XF86Refresh", 0x1008ff29),
    ("XF86AudioPause", 0x1008ff31),
    ("XF86Copy", 0x1008ff57),
    ("XF86Cut", 0x1008ff58),
    ("XF86Paste", 0x1008ff6d),
];

/// The keysym of a character: Latin-1 characters are their own keysyms, others are Unicode
/// keysyms (0x0100_0000 + code point); a newline (or carriage return) is Return, so typed lines
/// end as Enter ends them in terminals, editors and dialogs alike, and a tab is Tab.
pub fn of_char(c: char) -> u32 {
    match c {
        '\n' | '\r' => 0xff0d,
        '\t' => 0xff09,
        c if matches!(c as u32, 0x20..=0x7e | 0xa0..=0xff) => c as u32,
        c => 0x0100_0000 + c as u32,
    }
}

/// A keysym name to its value: a name from the table (exact, else ignoring case for names
/// longer than one character), `F1`-`F35`, a single character, `U20AC` or `0xff0d`.
pub fn from_name(name: &str) -> Option<u32> {
    if let Some((_, v)) = NAMED.iter().find(|(n, _)| *n == name) {
        return Some(*v);
    }
    let mut chars = name.chars();
    if let (Some(c), None) = (chars.next(), chars.next()) {
        return Some(of_char(c));
    }
    if let Some(n) = name
        .strip_prefix('F')
        .and_then(|n| n.parse::<u32>().ok())
        .filter(|n| (1..=35).contains(n))
    {
        return Some(0xffbe + n - 1);
    }
    if let Some(hex) = name.strip_prefix("0x") {
        return u32::from_str_radix(hex, 16).ok().filter(|v| *v != 0);
    }
    if let Some(hex) = name
        .strip_prefix('U')
        .filter(|h| (4..=6).contains(&h.len()))
    {
        if let Some(c) = u32::from_str_radix(hex, 16).ok().and_then(char::from_u32) {
            return Some(of_char(c));
        }
    }
    NAMED
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| *v)
}

/// The keysyms of a combination such as `"ctrl+shift+T"` (keys.rs names), in press order.
pub fn combo_keysyms(combo: &str) -> Result<Vec<u32>, String> {
    let mut names: Vec<&str> = combo.split('+').filter(|k| !k.is_empty()).collect();
    if combo.ends_with("++") || combo == "+" {
        names.push("plus");
    }
    if names.is_empty() {
        return Err("an empty key combination".into());
    }
    names
        .iter()
        .map(|n| from_name(n).ok_or_else(|| format!("unknown key {n:?}")))
        .collect()
}

/// The keysyms of modifier names.
pub fn modifier_keysyms(names: &[String]) -> Result<Vec<u32>, String> {
    names
        .iter()
        .map(|n| from_name(n).ok_or_else(|| format!("unknown key {n:?}")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_to_keysyms() {
        assert_eq!(from_name("Return"), Some(0xff0d));
        assert_eq!(from_name("ctrl"), Some(0xffe3));
        assert_eq!(from_name("super"), Some(0xffeb));
        assert_eq!(from_name("Page_Down"), Some(0xff56));
        assert_eq!(from_name("F1"), Some(0xffbe));
        assert_eq!(from_name("F12"), Some(0xffc9));
        assert_eq!(from_name("F35"), Some(0xffe0));
        assert_eq!(from_name("KP_Enter"), Some(0xff8d));
        assert_eq!(from_name("XF86AudioMute"), Some(0x1008ff12));
        assert_eq!(from_name("a"), Some(0x61));
        assert_eq!(from_name("A"), Some(0x41));
        assert_eq!(from_name("plus"), Some(0x2b));
        assert_eq!(from_name("U20AC"), Some(0x10020ac));
        assert_eq!(from_name("0xff0d"), Some(0xff0d));
        assert_eq!(from_name("backspace"), Some(0xff08));
        assert_eq!(from_name("no_such_key"), None);
        assert_eq!(from_name("F36"), None);
    }

    #[test]
    fn characters_to_keysyms() {
        assert_eq!(of_char('x'), 0x78);
        assert_eq!(of_char('~'), 0x7e);
        assert_eq!(of_char('é'), 0xe9);
        assert_eq!(of_char('€'), 0x10020ac);
        assert_eq!(of_char('日'), 0x10065e5);
        assert_eq!(of_char('\n'), 0xff0d);
        assert_eq!(of_char('\t'), 0xff09);
    }
}
