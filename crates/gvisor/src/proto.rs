//! Just enough protobuf decoding for gVisor's trace messages ([`super::trace`]): a message is
//! a list of fields, each a varint or a length-delimited run of bytes (strings, nested
//! messages, packed data); fixed-size fields are skipped.

/// One field of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Field<'a> {
    Varint(u32, u64),
    Bytes(u32, &'a [u8]),
    Fixed(u32),
}

impl<'a> Field<'a> {
    /// The field's value as an integer if it is field `n` (two's complement for int64).
    pub fn int(&self, n: u32) -> Option<i64> {
        match self {
            Field::Varint(k, v) if *k == n => Some(*v as i64),
            _ => None,
        }
    }
    pub fn bytes(&self, n: u32) -> Option<&'a [u8]> {
        match self {
            Field::Bytes(k, v) if *k == n => Some(v),
            _ => None,
        }
    }
    pub fn str(&self, n: u32) -> Option<String> {
        self.bytes(n)
            .map(|b| String::from_utf8_lossy(b).into_owned())
    }
    /// The field's nested message if it is field `n` (and decodes).
    pub fn msg(&self, n: u32) -> Option<Vec<Field<'a>>> {
        self.bytes(n).and_then(fields)
    }
}

fn varint(b: &[u8], i: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*i)?;
        *i += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// The fields of a message (`None` if malformed).
pub fn fields(b: &[u8]) -> Option<Vec<Field<'_>>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let key = varint(b, &mut i)?;
        let n = u32::try_from(key >> 3).ok()?;
        match key & 7 {
            0 => out.push(Field::Varint(n, varint(b, &mut i)?)),
            1 => {
                i += 8;
                out.push(Field::Fixed(n));
            }
            2 => {
                let len = usize::try_from(varint(b, &mut i)?).ok()?;
                let end = i.checked_add(len)?;
                out.push(Field::Bytes(n, b.get(i..end)?));
                i = end;
            }
            5 => {
                i += 4;
                out.push(Field::Fixed(n));
            }
            _ => return None,
        }
    }
    (i == b.len()).then_some(out)
}
