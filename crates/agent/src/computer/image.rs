//! Screenshots from X pixels: a ZPixmap image (as `GetImage` returns it) to RGB, the pointer
//! (an XFixes cursor image, premultiplied ARGB) drawn over it, then PNG or JPEG.

/// How the X server lays out the pixels of a ZPixmap image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PixelFormat {
    pub bits_per_pixel: u8,
    /// Each row is padded to a multiple of this many bits.
    pub scanline_pad: u8,
    pub big_endian: bool,
    pub red_mask: u32,
    pub green_mask: u32,
    pub blue_mask: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("unsupported pixel format ({0} bits per pixel)")]
    Format(u8),
    #[error("the image holds {got} bytes, {want} expected")]
    Short { got: usize, want: usize },
    #[error("encoding the PNG: {0}")]
    Png(#[from] png::EncodingError),
    #[error("encoding the JPEG: {0}")]
    Jpeg(#[from] jpeg_encoder::EncodingError),
}

/// One colour channel of a pixel scaled to 0-255.
fn channel(pixel: u32, mask: u32) -> u8 {
    if mask == 0 {
        return 0;
    }
    let v = (pixel & mask) >> mask.trailing_zeros();
    let max = mask >> mask.trailing_zeros();
    if max == 255 {
        v as u8
    } else {
        (v * 255 / max) as u8
    }
}

/// The `width` × `height` ZPixmap `data` as packed RGB.
pub fn to_rgb(
    data: &[u8],
    width: usize,
    height: usize,
    f: &PixelFormat,
) -> Result<Vec<u8>, ImageError> {
    let bpp = f.bits_per_pixel as usize;
    if !matches!(bpp, 16 | 24 | 32) {
        return Err(ImageError::Format(f.bits_per_pixel));
    }
    let pad = (f.scanline_pad as usize).max(8);
    let stride = (width * bpp).div_ceil(pad) * pad / 8;
    let want = stride * height;
    if data.len() < want {
        return Err(ImageError::Short {
            got: data.len(),
            want,
        });
    }
    let mut out = Vec::with_capacity(width * height * 3);
    // The usual case (depth 24 in 32-bit little-endian pixels, BGRX in memory) without shifts.
    if bpp == 32
        && !f.big_endian
        && (f.red_mask, f.green_mask, f.blue_mask) == (0xff0000, 0xff00, 0xff)
    {
        for row in data.chunks_exact(stride).take(height) {
            for px in row[..width * 4].chunks_exact(4) {
                out.extend_from_slice(&[px[2], px[1], px[0]]);
            }
        }
        return Ok(out);
    }
    let bytes = bpp / 8;
    for row in data.chunks_exact(stride).take(height) {
        for px in row[..width * bytes].chunks_exact(bytes) {
            let mut b = [0u8; 4];
            let p = if f.big_endian {
                b[4 - bytes..].copy_from_slice(px);
                u32::from_be_bytes(b)
            } else {
                b[..bytes].copy_from_slice(px);
                u32::from_le_bytes(b)
            };
            out.extend_from_slice(&[
                channel(p, f.red_mask),
                channel(p, f.green_mask),
                channel(p, f.blue_mask),
            ]);
        }
    }
    Ok(out)
}

/// A cursor image: its top-left corner on the screen and premultiplied ARGB pixels.
#[derive(Debug, Clone)]
pub struct Cursor<'a> {
    pub x: i64,
    pub y: i64,
    pub width: usize,
    pub height: usize,
    pub argb: &'a [u32],
}

/// Draws `c` over the RGB image whose top-left corner is at `(x0, y0)` on the screen.
pub fn draw_cursor(rgb: &mut [u8], width: usize, height: usize, (x0, y0): (i64, i64), c: &Cursor) {
    for cy in 0..c.height {
        let y = c.y + cy as i64 - y0;
        if y < 0 || y >= height as i64 {
            continue;
        }
        for cx in 0..c.width {
            let x = c.x + cx as i64 - x0;
            if x < 0 || x >= width as i64 {
                continue;
            }
            let Some(&p) = c.argb.get(cy * c.width + cx) else {
                return;
            };
            let a = p >> 24;
            if a == 0 {
                continue;
            }
            let i = (y as usize * width + x as usize) * 3;
            for (k, shift) in [16, 8, 0].into_iter().enumerate() {
                let src = (p >> shift) & 0xff;
                let dst = rgb[i + k] as u32;
                rgb[i + k] = (src + dst * (255 - a) / 255).min(255) as u8;
            }
        }
    }
}

/// RGB to PNG, with fast compression (a screenshot is sent once; its bytes matter less than
/// the time to make it).
pub fn png(rgb: &[u8], width: u32, height: u32) -> Result<Vec<u8>, ImageError> {
    let mut out = Vec::with_capacity(rgb.len() / 8);
    let mut e = png::Encoder::new(&mut out, width, height);
    e.set_color(png::ColorType::Rgb);
    e.set_depth(png::BitDepth::Eight);
    e.set_compression(png::Compression::Fast);
    let mut w = e.write_header()?;
    w.write_image_data(rgb)?;
    w.finish()?;
    Ok(out)
}

/// RGB to JPEG at `quality` (1-100).
pub fn jpeg(rgb: &[u8], width: u32, height: u32, quality: u8) -> Result<Vec<u8>, ImageError> {
    let mut out = Vec::with_capacity(rgb.len() / 10);
    let e = jpeg_encoder::Encoder::new(&mut out, quality);
    e.encode(
        rgb,
        width as u16,
        height as u16,
        jpeg_encoder::ColorType::Rgb,
    )?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BGRX: PixelFormat = PixelFormat {
        bits_per_pixel: 32,
        scanline_pad: 32,
        big_endian: false,
        red_mask: 0xff0000,
        green_mask: 0xff00,
        blue_mask: 0xff,
    };

    #[test]
    fn zpixmap_to_rgb() {
        // 2x1 pixels: red, then blue, as BGRX bytes.
        let data = [0, 0, 255, 0, 255, 0, 0, 0];
        assert_eq!(
            to_rgb(&data, 2, 1, &BGRX).unwrap(),
            vec![255, 0, 0, 0, 0, 255]
        );
        // 16-bit 5-6-5, one white and one green pixel in a row padded to 32 bits.
        let f = PixelFormat {
            bits_per_pixel: 16,
            red_mask: 0xf800,
            green_mask: 0x07e0,
            blue_mask: 0x001f,
            ..BGRX
        };
        assert_eq!(
            to_rgb(&[0xff, 0xff, 0xe0, 0x07], 2, 1, &f).unwrap(),
            vec![255, 255, 255, 0, 255, 0]
        );
        assert!(matches!(
            to_rgb(&data, 3, 1, &BGRX),
            Err(ImageError::Short { .. })
        ));
        let f8 = PixelFormat {
            bits_per_pixel: 8,
            ..BGRX
        };
        assert!(matches!(
            to_rgb(&data, 2, 1, &f8),
            Err(ImageError::Format(8))
        ));
    }

    #[test]
    fn cursor_is_blended_over_the_image() {
        let mut rgb = vec![100u8; 3 * 3 * 3];
        // A 2x2 cursor at (1, 1) of the screen: opaque black, half white, clear, clear.
        let argb = [0xff00_0000, 0x8080_8080, 0, 0];
        let c = Cursor {
            x: 1,
            y: 1,
            width: 2,
            height: 2,
            argb: &argb,
        };
        draw_cursor(&mut rgb, 3, 3, (0, 0), &c);
        // 0x80 + 100 × (255 - 0x80) / 255 = 177.
        assert_eq!(&rgb[12..15], &[0, 0, 0]);
        assert_eq!(&rgb[15..18], &[177; 3]);
        assert_eq!(&rgb[24..27], &[100, 100, 100]);
        // Outside a region the cursor is not drawn.
        let mut small = vec![100u8; 3];
        draw_cursor(&mut small, 1, 1, (0, 0), &c);
        assert_eq!(small, vec![100, 100, 100]);
    }

    /// Width and height of a PNG from its IHDR chunk.
    fn png_size(b: &[u8]) -> Option<(u32, u32)> {
        if b.len() < 24 || &b[..8] != b"\x89PNG\r\n\x1a\n" {
            return None;
        }
        let w = u32::from_be_bytes(b[16..20].try_into().ok()?);
        let h = u32::from_be_bytes(b[20..24].try_into().ok()?);
        Some((w, h))
    }

    #[test]
    fn png_of_a_known_buffer_decodes_back() {
        let (w, h) = (64u32, 48u32);
        let rgb: Vec<u8> = (0..w * h * 3).map(|i| (i * 7 % 251) as u8).collect();
        let bytes = png(&rgb, w, h).unwrap();
        assert_eq!(png_size(&bytes), Some((w, h)));
        let dec = png::Decoder::new(std::io::Cursor::new(bytes));
        let mut r = dec.read_info().unwrap();
        let mut buf = vec![0; r.output_buffer_size()];
        let info = r.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), (w, h));
        assert_eq!(info.color_type, png::ColorType::Rgb);
        assert_eq!(&buf[..info.buffer_size()], &rgb[..]);
    }

    #[test]
    fn jpeg_has_its_markers() {
        let rgb = vec![200u8; 16 * 8 * 3];
        let bytes = jpeg(&rgb, 16, 8, 80).unwrap();
        assert_eq!(&bytes[..3], b"\xff\xd8\xff");
        assert_eq!(&bytes[bytes.len() - 2..], b"\xff\xd9");
    }
}
