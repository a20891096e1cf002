//! The event loop: one epoll over the VM exit and reset eventfds, the control API listener and its
//! connections, the virtio queue ioeventfds and the devices' host sockets.

use std::collections::HashMap;
use std::io::Write;
use std::os::fd::AsRawFd;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::{ioe, Vmm, VmmError};
use crate::api::ApiRequest;
use crate::vstate::vcpu::ExitReason;

impl Vmm {
    fn handle_api(&mut self, req: ApiRequest) -> (serde_json::Value, bool) {
        let ok = |v: serde_json::Value| {
            let mut v = v;
            if let Some(o) = v.as_object_mut() {
                o.insert("ok".into(), true.into());
            }
            v
        };
        let err = |e: String| serde_json::json!({"ok": false, "error": e});
        match req {
            ApiRequest::Start | ApiRequest::Resume => {
                if self.paused {
                    self.resume_all();
                }
                (ok(serde_json::json!({"state": "running"})), false)
            }
            ApiRequest::Pause => match self.pause_all() {
                Ok(()) => (ok(serde_json::json!({"state": "paused"})), false),
                Err(e) => (err(e), false),
            },
            ApiRequest::Snapshot { dir, resume } => {
                match self.snapshot(&dir, resume.unwrap_or(true)) {
                    Ok(v) => (ok(v), false),
                    Err(e) => (err(format!("snapshot failed: {e}")), false),
                }
            }
            ApiRequest::Stats => (ok(self.stats()), false),
            ApiRequest::Stop => (ok(serde_json::json!({"state": "stopped"})), true),
        }
    }

    /// Runs the event loop until the VM ends; returns why it ended.
    pub fn run(mut self) -> Result<ExitReason, VmmError> {
        const T_EXIT: u64 = 1;
        const T_RESET: u64 = 2;
        const T_API: u64 = 3;
        const T_CONN: u64 = 1 << 40;
        const T_QUEUE: u64 = 2 << 40;
        const T_HOST: u64 = 3 << 40;
        let epoll = Epoll::new().map_err(ioe("epoll"))?;
        let add = |fd: i32, tok: u64| {
            epoll
                .ctl(
                    ControlOperation::Add,
                    fd,
                    EpollEvent::new(EventSet::IN, tok),
                )
                .map_err(ioe("epoll_ctl"))
        };
        add(self.exit.evt.as_raw_fd(), T_EXIT)?;
        add(self.reset_evt.as_raw_fd(), T_RESET)?;
        if let Some(api) = &self.api {
            add(api.listener.as_raw_fd(), T_API)?;
        }
        for (d, t) in self.transports.iter().enumerate() {
            let t = t.lock().unwrap_or_else(|p| p.into_inner());
            for (q, evt) in t.queue_evts.iter().enumerate() {
                add(evt.as_raw_fd(), T_QUEUE | (d as u64) << 16 | q as u64)?;
            }
            if let Some(fd) = t.device.host_fd() {
                add(fd, T_HOST | d as u64)?;
            }
        }
        if self.seccomp {
            let f = crate::seccomp::vmm_filter().map_err(VmmError::Seccomp)?;
            seccompiler::apply_filter(&f).map_err(|e| VmmError::Seccomp(e.to_string()))?;
        }
        let mut conns: HashMap<u64, crate::api::ApiConn> = HashMap::new();
        let mut next_conn = 0u64;
        let mut events = vec![EpollEvent::default(); 64];
        let reason = 'outer: loop {
            let n = match epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(VmmError::Io {
                        what: "epoll_wait".into(),
                        err: e,
                    })
                }
            };
            for ev in events.iter().take(n) {
                let tok = ev.data();
                match tok {
                    T_EXIT => {
                        let r = self
                            .exit
                            .reason
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .clone();
                        break 'outer r.unwrap_or(ExitReason::GuestShutdown);
                    }
                    T_RESET => break 'outer ExitReason::GuestReset,
                    T_API => {
                        if let Some(api) = &self.api {
                            while let Some(c) = api.accept() {
                                let tok = T_CONN | next_conn;
                                next_conn += 1;
                                if add(c.stream.as_raw_fd(), tok).is_ok() {
                                    conns.insert(tok, c);
                                }
                            }
                        }
                    }
                    t if t & (0xff << 40) == T_CONN => {
                        let Some(c) = conns.get_mut(&t) else { continue };
                        let (reqs, closed) = c.read_requests();
                        let mut stop = false;
                        for r in reqs {
                            let resp = match r {
                                Ok(req) => {
                                    let (resp, s) = self.handle_api(req);
                                    stop |= s;
                                    resp
                                }
                                Err(e) => serde_json::json!({"ok": false, "error": e}),
                            };
                            if let Some(c) = conns.get_mut(&t) {
                                c.respond(&resp);
                            }
                        }
                        if closed {
                            if let Some(c) = conns.remove(&t) {
                                let _ = epoll.ctl(
                                    ControlOperation::Delete,
                                    c.stream.as_raw_fd(),
                                    EpollEvent::default(),
                                );
                            }
                        }
                        if stop {
                            break 'outer ExitReason::Stopped;
                        }
                    }
                    t if t & (0xff << 40) == T_QUEUE => {
                        let d = ((t >> 16) & 0xffff) as usize;
                        let q = (t & 0xffff) as usize;
                        if let Some(tr) = self.transports.get(d) {
                            tr.lock().unwrap_or_else(|p| p.into_inner()).queue_event(q);
                        }
                    }
                    t if t & (0xff << 40) == T_HOST => {
                        let d = (t & 0xffff) as usize;
                        if let Some(tr) = self.transports.get(d) {
                            tr.lock().unwrap_or_else(|p| p.into_inner()).host_event();
                        }
                    }
                    _ => {}
                }
            }
        };
        for v in self.vcpus.iter_mut() {
            v.stop();
        }
        let _ = std::io::stdout().flush();
        Ok(reason)
    }
}
