//! The local terminal: raw mode for `kiln sandbox shell` and the window size.

/// Puts the terminal on `fd` in raw mode until the guard is dropped.
pub struct RawMode {
    fd: i32,
    saved: libc::termios,
}

impl RawMode {
    pub fn enable(fd: i32) -> std::io::Result<Self> {
        // SAFETY: termios is plain old data for which all-zero bytes are a valid value.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: `t` is a valid, writable termios; errors come back through the result.
        if unsafe { libc::tcgetattr(fd, &mut t) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let saved = t;
        // SAFETY: `t` holds the attributes tcgetattr just filled in.
        unsafe { libc::cfmakeraw(&mut t) };
        // SAFETY: `t` is a valid termios; a bad fd is reported through the result.
        if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &t) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { fd, saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // SAFETY: puts back the attributes `enable` read from this same fd.
        unsafe { libc::tcsetattr(self.fd, libc::TCSANOW, &self.saved) };
    }
}

/// The size (cols, rows) of the terminal on `fd`, if it is one.
pub fn size(fd: i32) -> Option<(u16, u16)> {
    // SAFETY: winsize is plain old data; all-zero is a valid value.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ writes one winsize through the valid, writable pointer.
    let rc = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) };
    (rc == 0 && ws.ws_col > 0).then_some((ws.ws_col, ws.ws_row))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_pipe_is_not_a_terminal() {
        let mut fds = [0i32; 2];
        // SAFETY: `fds` has room for the two descriptors pipe() writes.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        assert_eq!(super::size(fds[0]), None);
        assert!(super::RawMode::enable(fds[0]).is_err());
        for fd in fds {
            // SAFETY: closing the descriptors this test opened.
            unsafe { libc::close(fd) };
        }
    }
}
