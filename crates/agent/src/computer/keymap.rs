//! The X server's core keyboard mapping (keycode → keysyms) as the input side reads it: which
//! keycode types a keysym (and whether Shift goes with it), and which keycodes are free to map
//! a keysym the layout lacks, the way xdotool types characters outside the layout.

/// A snapshot of `GetKeyboardMapping` for every keycode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyMap {
    pub min_keycode: u8,
    /// Keysyms listed per keycode (the columns: 0 plain, 1 with Shift, then other groups).
    pub per_keycode: usize,
    /// `per_keycode` keysyms for each keycode from `min_keycode` on.
    pub keysyms: Vec<u32>,
}

/// How to type one keysym.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyStroke {
    pub keycode: u8,
    pub shift: bool,
}

impl KeyMap {
    fn rows(&self) -> impl Iterator<Item = (u8, &[u32])> {
        let per = self.per_keycode.max(1);
        self.keysyms
            .chunks(per)
            .enumerate()
            .map(move |(i, row)| (self.min_keycode.saturating_add(i as u8), row))
    }

    /// The keycode that types `keysym` without Shift, else with Shift (core protocol columns
    /// 0 and 1, the first group). Keysyms only in other groups or levels count as absent.
    pub fn find(&self, keysym: u32) -> Option<KeyStroke> {
        if keysym == 0 {
            return None;
        }
        for (col, shift) in [(0, false), (1, true)] {
            if let Some((keycode, _)) = self
                .rows()
                .find(|(_, row)| row.get(col).copied() == Some(keysym))
            {
                return Some(KeyStroke { keycode, shift });
            }
        }
        None
    }

    /// Keycodes with no keysym at all: free to map a missing keysym for a moment.
    pub fn free_keycodes(&self) -> Vec<u8> {
        self.rows()
            .filter(|(_, row)| row.iter().all(|s| *s == 0))
            .map(|(k, _)| k)
            .collect()
    }

    /// The keysyms of `keycode` (for restoring it after a temporary mapping).
    pub fn row(&self, keycode: u8) -> Option<&[u32]> {
        let i = keycode.checked_sub(self.min_keycode)? as usize;
        let per = self.per_keycode.max(1);
        self.keysyms.get(i * per..(i + 1) * per)
    }

    /// Records that `keycode` now types `keysym` (in both columns, so no Shift is needed).
    pub fn set(&mut self, keycode: u8, keysym: u32) {
        let mut row = vec![0; self.per_keycode.max(1)];
        row[0] = keysym;
        if row.len() > 1 {
            row[1] = keysym;
        }
        self.put(keycode, &row);
    }

    /// Records the keysyms of `keycode` (a row as [`KeyMap::row`] returned it).
    pub fn put(&mut self, keycode: u8, keysyms: &[u32]) {
        let Some(i) = keycode.checked_sub(self.min_keycode) else {
            return;
        };
        let per = self.per_keycode.max(1);
        if let Some(row) = self
            .keysyms
            .get_mut(i as usize * per..(i as usize + 1) * per)
        {
            if row.len() == keysyms.len() {
                row.copy_from_slice(keysyms);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keycodes 8-12: `a A`, free, `1 !`, `Shift_L`, free.
    fn map() -> KeyMap {
        KeyMap {
            min_keycode: 8,
            per_keycode: 2,
            keysyms: vec![0x61, 0x41, 0, 0, 0x31, 0x21, 0xffe1, 0, 0, 0],
        }
    }

    #[test]
    fn finds_keycodes_and_shift() {
        let m = map();
        let k = |keycode, shift| Some(KeyStroke { keycode, shift });
        assert_eq!(m.find(0x61), k(8, false));
        assert_eq!(m.find(0x41), k(8, true));
        assert_eq!(m.find(0x21), k(10, true));
        assert_eq!(m.find(0xffe1), k(11, false));
        assert_eq!(m.find(0xe9), None);
        assert_eq!(m.find(0), None);
    }

    #[test]
    fn maps_a_free_keycode_and_restores_it() {
        let mut m = map();
        assert_eq!(m.free_keycodes(), vec![9, 12]);
        let before = m.row(9).unwrap().to_vec();
        m.set(9, 0x10020ac);
        assert_eq!(
            m.find(0x10020ac),
            Some(KeyStroke {
                keycode: 9,
                shift: false
            })
        );
        assert_eq!(m.free_keycodes(), vec![12]);
        assert_eq!(before, vec![0, 0]);
        m.put(9, &before);
        assert_eq!(m.find(0x10020ac), None);
        assert_eq!(m.free_keycodes(), vec![9, 12]);
        assert_eq!(m.row(13), None);
        assert_eq!(m.row(7), None);
    }
}
