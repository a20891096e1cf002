//! The X display side of the computer-use service, in process: one X11 connection (x11rb's
//! pure-Rust client), XTEST for pointer and key input, `GetImage` plus the XFixes cursor image
//! for screenshots (the pointer drawn in, as `scrot --pointer` did), encoded here.
//!
//! The connection is made on first use (the SDK starts Xvfb after the sandbox is up) and made
//! again after it breaks (a restarted X server). X calls block, so they run on tokio's blocking
//! threads, one at a time.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use x11rb::connection::{Connection as _, RequestConnection as _};
use x11rb::errors::{ConnectError, ConnectionError, ReplyError};
use x11rb::protocol::xfixes::ConnectionExt as _;
use x11rb::protocol::xproto::{self, ConnectionExt as _, ImageFormat, ImageOrder};
use x11rb::protocol::xtest::{self, ConnectionExt as _};
use x11rb::rust_connection::RustConnection;
use x11rb::wrapper::ConnectionExt as _;

use super::image::{self, Cursor, ImageError, PixelFormat};
use super::input::Step;
use super::keymap::{KeyMap, KeyStroke};

/// JPEG quality of screenshots (scrot's `--quality 80`).
const JPEG_QUALITY: u8 = 80;
/// How long a keysym mapped onto a free keycode stays before the keycode is restored when a
/// batch runs out of free keycodes: clients read the new mapping when they handle its
/// MappingNotify, which may be after the key events were sent.
const REMAP_SETTLE: Duration = Duration::from_millis(100);
/// How long keycodes lent to keysyms outside the layout stay mapped after the batch that typed
/// them: a client reads a mapping when it handles the MappingNotify, which on a busy host comes
/// long after the key events were sent; restored before that, the keys reach it as nothing.
const LEND_FOR: Duration = Duration::from_secs(1);
const SHIFT_L: u32 = 0xffe1;

#[derive(Debug, thiserror::Error)]
pub enum XError {
    #[error("cannot connect to the X display {0}: {1}")]
    Connect(String, ConnectError),
    #[error("the X connection failed: {0}")]
    Connection(#[from] ConnectionError),
    #[error("an X request failed: {0}")]
    Reply(#[from] ReplyError),
    #[error("the X server lacks the {0} extension")]
    Extension(&'static str),
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error("{0}")]
    Other(String),
}

impl XError {
    /// True when the connection is unusable (and is made again on the next call).
    fn is_fatal(&self) -> bool {
        matches!(
            self,
            XError::Connection(_) | XError::Reply(ReplyError::ConnectionError(_))
        )
    }
}

/// A captured image.
#[derive(Debug, Clone)]
pub struct Image {
    pub format: &'static str,
    pub bytes: Vec<u8>,
    pub width: u32,
    pub height: u32,
}

/// An open connection and what it needs from the server's setup.
struct Conn {
    c: RustConnection,
    root: xproto::Window,
    lent: std::cell::RefCell<Lent>,
}

/// Keycodes past batches mapped to keysyms outside the layout, given back [`LEND_FOR`] after
/// the last batch.
#[derive(Default)]
struct Lent {
    /// Each keycode with the keysyms to give back.
    keys: Vec<(u8, Vec<u32>)>,
    /// When the last batch that used them ended.
    since: Option<Instant>,
}

impl Conn {
    fn open(display: &str) -> Result<Conn, XError> {
        let (c, screen) = RustConnection::connect(Some(display))
            .map_err(|e| XError::Connect(display.into(), e))?;
        let root = c
            .setup()
            .roots
            .get(screen)
            .ok_or_else(|| XError::Other(format!("the X display has no screen {screen}")))?
            .root;
        if c.extension_information(xtest::X11_EXTENSION_NAME)?
            .is_none()
        {
            return Err(XError::Extension("XTEST"));
        }
        c.xtest_get_version(2, 2)?.reply()?;
        // XFixes answers cursor requests only after the client said which version it speaks.
        c.xfixes_query_version(5, 0)?.reply()?;
        Ok(Conn {
            c,
            root,
            lent: Default::default(),
        })
    }

    /// Gives the lent keycodes back once [`LEND_FOR`] has passed since the batch that used
    /// them last; whether any were given back.
    fn give_back_lent(&self) -> Result<bool, XError> {
        let mut lent = self.lent.borrow_mut();
        let due = lent.since.is_some_and(|at| at.elapsed() >= LEND_FOR);
        if lent.keys.is_empty() || !due {
            return Ok(false);
        }
        for (keycode, old) in lent.keys.drain(..) {
            self.c
                .change_keyboard_mapping(1, keycode, old.len() as u8, &old)?;
        }
        lent.since = None;
        self.c.sync()?;
        self.drain()?;
        Ok(true)
    }

    fn size(&self) -> Result<(u32, u32), XError> {
        let g = self.c.get_geometry(self.root)?.reply()?;
        Ok((g.width as u32, g.height as u32))
    }

    fn cursor(&self) -> Result<(i64, i64), XError> {
        let p = self.c.query_pointer(self.root)?.reply()?;
        Ok((p.root_x as i64, p.root_y as i64))
    }

    /// Events nobody asked for still arrive (MappingNotify goes to every client): drop them.
    fn drain(&self) -> Result<(), XError> {
        while self.c.poll_for_event()?.is_some() {}
        Ok(())
    }

    fn fake(&self, kind: u8, detail: u8, x: i16, y: i16) -> Result<(), XError> {
        self.c
            .xtest_fake_input(kind, detail, 0, self.root, x, y, 0)?;
        Ok(())
    }

    fn keymap(&self) -> Result<KeyMap, XError> {
        let s = self.c.setup();
        let (min, max) = (s.min_keycode, s.max_keycode);
        let r = self.c.get_keyboard_mapping(min, max - min + 1)?.reply()?;
        Ok(KeyMap {
            min_keycode: min,
            per_keycode: r.keysyms_per_keycode as usize,
            keysyms: r.keysyms,
        })
    }

    /// Plays input steps, then waits until the server has handled them; whether keycodes are
    /// lent to keysyms outside the layout now.
    fn play(&self, steps: &[Step]) -> Result<bool, XError> {
        let mut keys = None;
        let res = steps.iter().try_for_each(|s| match *s {
            Step::Move { x, y } => {
                let clamp = |v: i64| v.clamp(i16::MIN as i64, i16::MAX as i64) as i16;
                self.fake(xproto::MOTION_NOTIFY_EVENT, 0, clamp(x), clamp(y))
            }
            Step::Button { button, press } => {
                let kind = if press {
                    xproto::BUTTON_PRESS_EVENT
                } else {
                    xproto::BUTTON_RELEASE_EVENT
                };
                self.fake(kind, button, 0, 0)
            }
            Step::Key { keysym, press } => {
                if keys.is_none() {
                    let lent = std::mem::take(&mut self.lent.borrow_mut().keys);
                    keys = Some(Keyboard::new(self.keymap()?, lent));
                }
                keys.as_mut().expect("just set").key(self, keysym, press)
            }
            Step::Sleep(d) => {
                self.c.flush()?;
                std::thread::sleep(d);
                Ok(())
            }
        });
        if let Some(k) = keys {
            k.finish(self)?;
        }
        res?;
        self.c.sync()?;
        self.drain()?;
        Ok(!self.lent.borrow().keys.is_empty())
    }

    /// The screen or a region `[x0, y0, x1, y1]` of it as RGB, with the pointer drawn in.
    fn capture(&self, region: Option<[i64; 4]>) -> Result<(Vec<u8>, u32, u32), XError> {
        let (sw, sh) = self.size()?;
        let [x0, y0, x1, y1] = region.unwrap_or([0, 0, sw as i64, sh as i64]);
        let (x0, y0) = (x0.clamp(0, sw as i64), y0.clamp(0, sh as i64));
        let (x1, y1) = (x1.clamp(x0, sw as i64), y1.clamp(y0, sh as i64));
        let (w, h) = ((x1 - x0) as u16, (y1 - y0) as u16);
        if w == 0 || h == 0 {
            return Err(XError::Other("the region is outside the screen".into()));
        }
        let img = self.c.get_image(
            ImageFormat::Z_PIXMAP,
            self.root,
            x0 as i16,
            y0 as i16,
            w,
            h,
            !0,
        )?;
        let cursor = self.c.xfixes_get_cursor_image()?;
        let img = img.reply()?;
        let format = self.pixel_format(img.depth, img.visual)?;
        let mut rgb = image::to_rgb(&img.data, w as usize, h as usize, &format)?;
        if let Ok(c) = cursor.reply() {
            let cur = Cursor {
                x: c.x as i64 - c.xhot as i64,
                y: c.y as i64 - c.yhot as i64,
                width: c.width as usize,
                height: c.height as usize,
                argb: &c.cursor_image,
            };
            image::draw_cursor(&mut rgb, w as usize, h as usize, (x0, y0), &cur);
        }
        Ok((rgb, w as u32, h as u32))
    }

    fn pixel_format(&self, depth: u8, visual: xproto::Visualid) -> Result<PixelFormat, XError> {
        let s = self.c.setup();
        let f = s
            .pixmap_formats
            .iter()
            .find(|f| f.depth == depth)
            .ok_or_else(|| XError::Other(format!("no pixmap format for depth {depth}")))?;
        let v = s
            .roots
            .iter()
            .flat_map(|r| &r.allowed_depths)
            .flat_map(|d| &d.visuals)
            .find(|v| v.visual_id == visual)
            .ok_or_else(|| XError::Other(format!("unknown visual {visual:#x}")))?;
        Ok(PixelFormat {
            bits_per_pixel: f.bits_per_pixel,
            scanline_pad: f.scanline_pad,
            big_endian: s.image_byte_order == ImageOrder::MSB_FIRST,
            red_mask: v.red_mask,
            green_mask: v.green_mask,
            blue_mask: v.blue_mask,
        })
    }
}

/// Key input of one batch: keysyms to keycodes (Shift added for a keysym in the shifted
/// column, as xdotool does), keysyms the layout lacks mapped onto free keycodes, which stay
/// lent for [`LEND_FOR`] after the batch ([`Conn::give_back_lent`]).
struct Keyboard {
    map: KeyMap,
    free: Vec<u8>,
    /// Keycodes mapped for this batch or lent by earlier ones, with the keysyms to restore.
    borrowed: Vec<(u8, Vec<u32>)>,
    /// Keysyms held down: their keycode and whether Shift was pressed for them.
    down: Vec<(u32, KeyStroke, bool)>,
    shift_down: bool,
}

impl Keyboard {
    /// The keyboard as `map` has it, `lent` keycodes still mapped by earlier batches (not
    /// free, reused for their keysyms).
    fn new(map: KeyMap, lent: Vec<(u8, Vec<u32>)>) -> Keyboard {
        let mut free = map.free_keycodes();
        free.reverse();
        Keyboard {
            map,
            free,
            borrowed: lent,
            down: Vec::new(),
            shift_down: false,
        }
    }

    fn stroke(&mut self, x: &Conn, keysym: u32) -> Result<KeyStroke, XError> {
        if let Some(k) = self.map.find(keysym) {
            return Ok(k);
        }
        if self.free.is_empty() {
            // Every free keycode is in use: give them back and start over.
            self.restore(x)?;
            self.free = self.map.free_keycodes();
            self.free.reverse();
        }
        let keycode = self
            .free
            .pop()
            .ok_or_else(|| XError::Other(format!("no free keycode to type keysym {keysym:#x}")))?;
        let old = self.map.row(keycode).unwrap_or_default().to_vec();
        self.map.set(keycode, keysym);
        let row = self.map.row(keycode).unwrap_or_default().to_vec();
        x.c.change_keyboard_mapping(1, keycode, row.len() as u8, &row)?;
        self.borrowed.push((keycode, old));
        Ok(KeyStroke {
            keycode,
            shift: false,
        })
    }

    fn key(&mut self, x: &Conn, keysym: u32, press: bool) -> Result<(), XError> {
        let shift_code = self.map.find(SHIFT_L).map(|k| k.keycode);
        if press {
            let k = self.stroke(x, keysym)?;
            let mut with_shift = false;
            if k.shift && !self.shift_down {
                if let Some(sc) = shift_code {
                    x.fake(xproto::KEY_PRESS_EVENT, sc, 0, 0)?;
                    with_shift = true;
                }
            }
            if keysym == SHIFT_L {
                self.shift_down = true;
            }
            x.fake(xproto::KEY_PRESS_EVENT, k.keycode, 0, 0)?;
            self.down.push((keysym, k, with_shift));
            return Ok(());
        }
        let held = self.down.iter().rposition(|(s, _, _)| *s == keysym);
        let (k, with_shift) = match held {
            Some(i) => {
                let (_, k, w) = self.down.remove(i);
                (k, w)
            }
            None => (self.stroke(x, keysym)?, false),
        };
        x.fake(xproto::KEY_RELEASE_EVENT, k.keycode, 0, 0)?;
        if keysym == SHIFT_L {
            self.shift_down = false;
        }
        if let (true, Some(sc)) = (with_shift, shift_code) {
            x.fake(xproto::KEY_RELEASE_EVENT, sc, 0, 0)?;
        }
        Ok(())
    }

    /// Gives the borrowed keycodes back (their keysyms as before), once clients had time to
    /// read the temporary mapping.
    fn restore(&mut self, x: &Conn) -> Result<(), XError> {
        if self.borrowed.is_empty() {
            return Ok(());
        }
        x.c.sync()?;
        std::thread::sleep(REMAP_SETTLE);
        for (keycode, old) in self.borrowed.drain(..) {
            x.c.change_keyboard_mapping(1, keycode, old.len() as u8, &old)?;
            self.map.put(keycode, &old);
        }
        x.c.sync()?;
        Ok(())
    }

    /// Ends the batch: what it borrowed stays lent to the connection (given back once
    /// [`LEND_FOR`] has passed without another batch).
    fn finish(self, x: &Conn) -> Result<(), XError> {
        let mut lent = x.lent.borrow_mut();
        lent.keys.extend(self.borrowed);
        lent.since = Some(Instant::now());
        Ok(())
    }
}

#[derive(Clone)]
pub struct Display {
    pub name: String,
    conn: Arc<Mutex<Option<Conn>>>,
}

impl std::fmt::Debug for Display {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Display").field("name", &self.name).finish()
    }
}

impl Display {
    pub fn new(name: impl Into<String>) -> Display {
        Display {
            name: name.into(),
            conn: Arc::new(Mutex::new(None)),
        }
    }

    /// Runs `f` on the connection slot (whoever holds it, one call at a time) on a blocking
    /// thread: X calls block.
    async fn on_slot<T, F>(&self, f: F) -> Result<T, String>
    where
        T: Send + 'static,
        F: FnOnce(&mut Option<Conn>, &str) -> Result<T, XError> + Send + 'static,
    {
        let (slot, name) = (self.conn.clone(), self.name.clone());
        let run = move || f(&mut slot.lock().unwrap_or_else(|e| e.into_inner()), &name);
        tokio::task::spawn_blocking(run)
            .await
            .map_err(|e| format!("the X worker failed: {e}"))?
            .map_err(|e| e.to_string())
    }

    /// Runs `f` on the connection (made when there is none) on a blocking thread. With `retry`
    /// (for calls that change nothing), a connection found broken is made again and `f` runs
    /// once more.
    async fn with<T, F>(&self, retry: bool, f: F) -> Result<T, String>
    where
        T: Send + 'static,
        F: Fn(&Conn) -> Result<T, XError> + Send + 'static,
    {
        self.on_slot(move |g, name| {
            let mut tries = if retry { 2 } else { 1 };
            loop {
                let had = g.is_some();
                if !had {
                    *g = Some(Conn::open(name)?);
                }
                match f(g.as_ref().expect("connected above")) {
                    Err(e) if e.is_fatal() => {
                        *g = None;
                        tries -= 1;
                        if !had || tries == 0 {
                            return Err(e);
                        }
                    }
                    r => return r,
                }
            }
        })
        .await
    }

    /// Plays input steps. Keycodes the steps lent to keysyms outside the layout are given back
    /// [`LEND_FOR`] later, unless a later batch uses them (its own give-back follows it).
    pub async fn input(&self, steps: Vec<Step>) -> Result<(), String> {
        let lent = self.with(false, move |c| c.play(&steps)).await?;
        if lent {
            let display = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(LEND_FOR).await;
                if let Err(e) = display.give_back_keys().await {
                    tracing::warn!("giving lent keycodes back: {e}");
                }
            });
        }
        Ok(())
    }

    /// Gives back the keycodes input lent once [`LEND_FOR`] has passed since the last batch
    /// (nothing without a connection).
    async fn give_back_keys(&self) -> Result<bool, String> {
        self.on_slot(|g, _| {
            let Some(c) = g.as_ref() else {
                return Ok(false);
            };
            let r = c.give_back_lent();
            if r.as_ref().is_err_and(XError::is_fatal) {
                *g = None;
            }
            r
        })
        .await
    }

    /// The pointer position.
    pub async fn cursor(&self) -> Result<(i64, i64), String> {
        self.with(true, |c| c.cursor()).await
    }

    /// The screen size.
    pub async fn size(&self) -> Result<(u32, u32), String> {
        self.with(true, |c| c.size()).await
    }

    /// A screenshot (with the pointer) of the screen or of a region `[x0, y0, x1, y1]`.
    pub async fn screenshot(&self, jpeg: bool, region: Option<[i64; 4]>) -> Result<Image, String> {
        self.with(true, move |c| {
            let (rgb, width, height) = c.capture(region)?;
            let bytes = if jpeg {
                image::jpeg(&rgb, width, height, JPEG_QUALITY)?
            } else {
                image::png(&rgb, width, height)?
            };
            Ok(Image {
                format: if jpeg { "jpeg" } else { "png" },
                bytes,
                width,
                height,
            })
        })
        .await
    }
}
